"""Commands of the tiled VAE: `decode` and `encode` (`plan` is in `plan`, `analyze` and `compare` in
`measure`).

`decode` and `encode` build the recipes' options record (`VaeFileOptions`) from their typed options. Imports
of torch, numpy, PIL and the library layers are inside the functions: they keep `tilewise --help` fast.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ..errors import BadRequest
from . import checks, options
from .batch import RayAddress, Workers
from .options import Config, Device, Mode, Model, NoClobber, Nproc, Quiet, Report, Staging
from .ranks import join_ranks
from .report import finish_report, run_folder, write_plan


def decode(
    latents: Annotated[
        Path,
        typer.Argument(help=".safetensors with a 'latents' tensor (as the VAE's pipeline hands them to its "
                       "denoiser; 3-D VAE: B, C, T, H, W)"),
    ],
    out: Annotated[
        Path,
        typer.Option(
            help="output .png / .tif / .npy; a video: frame pattern f{:04d}.png, .npy or .tif stack"
        ),
    ],
    mode: Annotated[Mode, typer.Option()] = Mode.exact,
    tile: Annotated[int, typer.Option(min=1, help="VAE tile, latent px")] = 32,
    budget: Annotated[
        str | None, typer.Option(help="memory budget, e.g. 2GiB: picks tile and staging")
    ] = None,
    staging: Annotated[Staging, typer.Option()] = Staging.auto,
    bits: Annotated[int, typer.Option(help="8 or 16 bits per channel (32: float, .npy / .tif)")] = 8,
    decode_chunk_size: Annotated[
        int | None, typer.Option(min=1, help="SVD's temporal decoder: frames per decode call, as its "
                                 "pipeline's decode_chunk_size (the frames of one call mix); default: all")
    ] = None,
    model: Model = None,
    config: Config = None,
    device: Device = "auto",
    report: Report = None,
    quiet: Quiet = False,
    nproc: Nproc = 1,
    no_clobber: NoClobber = False,
) -> None:
    """Decode latents tile by tile, streamed to the output file.

    --model: a pipeline folder (its vae/, or the component holding its VAE: Kandinsky's movq/, LDM's
    vqvae/), a checkpoint, or a VAE folder (AutoencoderKL, Tiny, Flux.2, DC-AE, VQ,
    KVAE, HunyuanImage, AsymmetricKL, Qwen-Image 2.1, the 3-D VAEs, SVD's temporal decoder); a video VAE
    (Qwen-Image, Wan, LTX-Video, Cosmos, SVD, ...) decodes (B, C, T, H, W) latents, one frame to an
    image, several to a video. Cosmos' latents are scaled by its scheduler's sigma_data (the file's
    metadata, the pipeline folder's scheduler, else 0.5); SVD's are decoded in calls of
    --decode-chunk-size frames.

    Example: tilewise decode latents.safetensors --out image.tif --mode exact --budget 2GiB

    Example: tilewise decode video.safetensors --model wan-folder --out "frames/f{:04d}.png"

    Example: tilewise decode video.safetensors --model svd-folder --decode-chunk-size 8 --out video.npy
    """
    from ..pipelines import VaeFileOptions, load_vae, run_decode_file
    from ..pipelines.folders import scheduler_sigma_data

    checks.report_folder(report)
    checks.budget(budget)
    device = options.resolve_device(device)
    checks.ranks(nproc, device)
    _check_decode_input(latents, out, model, config, bits, no_clobber, decode_chunk_size)
    group, rank = join_ranks(nproc)
    job = VaeFileOptions(str(latents), str(out), tile_size=tile, mode=mode.value, budget=budget,
                         staging=staging.value, bits=bits, progress=not (quiet or rank != 0),
                         process_group=group, replace=not no_clobber, sigma_data=scheduler_sigma_data(model),
                         frames_per_call=decode_chunk_size)
    vae = load_vae(model, config=config, device=device)
    plan = run_decode_file(vae, job)
    if rank != 0:
        return
    typer.echo(f"{plan}\nwrote {out}")
    run_dir = run_folder(
        report, {"command": "decode", "latents": str(latents), "mode": mode.value, "output": str(out)}
    )
    write_plan(run_dir, plan)
    finish_report(run_dir)


def _check_decode_input(latents: Path, out: Path, model: Path | None, config: Path | None, bits: int,
                        no_clobber: bool, decode_chunk_size: int | None) -> None:
    """decode's latents and output before the model loads: the latents' layout (a video's (B, C, T, H, W),
    Qwen-Image 2.1's (1, C, 1, h, w)) and channels, the output's kind, frames and room on the disk, and
    --decode-chunk-size only for SVD's temporal decoder."""
    from ..pipelines.folders import part_config, vae_factor_of
    from ..pipelines.image_latents import FRAMED
    from ..pipelines.video_latents import SVD

    checks.model_paths(model, config, vae_folder=True)
    video = _video_vae(model)
    name = _vae_class(model)
    if decode_chunk_size is not None and name is not None and name != SVD:
        raise BadRequest(f"--decode-chunk-size applies to SVD's temporal decoder ({SVD}, whose decode takes "
                         f"its frames in calls), not to the {name} of --model {str(model)!r}")
    if not video:
        checks.output(out, no_clobber=no_clobber, bits=bits)
    cfg = part_config(model, "vae", config)
    shape = checks.latents_input(latents, video=video or name in FRAMED,
                                 channels=None if video else _latent_channels(cfg, name))
    if video:
        checks.video_output(out, no_clobber=no_clobber, bits=bits, frames=shape[-3])
    f = None if video else vae_factor_of(cfg)
    if f is not None:
        checks.output_room(out, shape[-2] * f, shape[-1] * f, 3, bits)


def encode(
    image: Annotated[
        Path,
        typer.Argument(
            help="input image; 3-D VAE: or a video (frame pattern f{:04d}.png, .npy or .tif stack)"
        ),
    ],
    out: Annotated[Path, typer.Option(help="output latents .safetensors; with --buckets the latent cache "
                                      "folder")],
    mode: Annotated[Mode, typer.Option()] = Mode.exact,
    tile: Annotated[int, typer.Option(min=1, help="VAE tile, latent px")] = 32,
    budget: Annotated[str | None, typer.Option(help="memory budget, e.g. 2GiB")] = None,
    staging: Annotated[Staging, typer.Option()] = Staging.auto,
    buckets: Annotated[
        Path | None,
        typer.Option(help="IMAGE is a dataset and this its manifest (tilewise buckets): write the latent "
                     "cache"),
    ] = None,
    shard_size: Annotated[int, typer.Option(min=1, help="with --buckets: images per shard")] = 64,
    batch_size: Annotated[int, typer.Option(min=1, help="with --buckets: images per VAE call")] = 8,
    tile_above: Annotated[
        int, typer.Option(min=1, help="with --buckets and no --budget: buckets of more pixels use the exact "
                          "tiled encode (with --budget every bucket is planned within it)")
    ] = 512 * 512,
    ray: RayAddress = None,
    workers: Workers = None,
    model: Model = None,
    config: Config = None,
    device: Device = "auto",
    quiet: Quiet = False,
    nproc: Nproc = 1,
    no_clobber: NoClobber = False,
) -> None:
    """Encode an image tile by tile into latents (the distribution's mean, as the VAE's pipeline hands them
    to its denoiser); or, with --buckets, a whole dataset into the latent cache (shards by bucket,
    resumable).

    8- and 16-bit, grey or colour images are read at their depth; an alpha channel is used by RGBA VAEs
    (Qwen-Image 2.1) only. --model as for decode; sides must be multiples of the VAE's factor (8, 16 for
    Wan 2.2; Flux.2: twice it, its latents' 2x2 patches). SVD's temporal decoder encodes each frame as an
    image; Cosmos records its scheduler's sigma_data in the latents file.

    Example: tilewise encode photo.png --out latents.safetensors

    Example: tilewise encode video.npy --model wan-folder --out video.safetensors

    Example: tilewise encode photos/ --buckets manifest.jsonl --out cache/ --ray local
    """
    if buckets is not None:
        from .batch import encode_dataset

        if nproc != 1 or config is not None:
            raise BadRequest("encode --buckets takes --ray for several processes, and --model without "
                             "--config")
        encode_dataset(image, buckets, out, shard_size, batch_size, tile_above, tile, budget, model, device,
                       quiet, ray, workers)
        return
    if ray is not None:
        raise BadRequest("--ray applies to encode DATASET --buckets MANIFEST")
    _encode_file(image, out, model, config, device, nproc, no_clobber, tile_size=tile, mode=mode.value,
                 budget=budget, staging=staging.value, quiet=quiet)


def _encode_file(image: Path, out: Path, model: Path | None, config: Path | None, device: str, nproc: int,
                 no_clobber: bool, *, quiet: bool, **settings) -> None:
    """encode of one image or video to a latents file: its checks before the model loads, then the run
    (`settings`: VaeFileOptions' tile_size, mode, budget and staging)."""
    from ..pipelines import VaeFileOptions, load_vae, run_encode_file
    from ..pipelines.folders import scheduler_sigma_data

    checks.output(out, suffixes=(".safetensors",), no_clobber=no_clobber)
    checks.model_paths(model, config, vae_folder=True)
    _check_encode_input(image, model, config)
    checks.budget(settings["budget"])
    device = options.resolve_device(device)
    checks.ranks(nproc, device)
    group, rank = join_ranks(nproc)
    job = VaeFileOptions(str(image), str(out), **settings, progress=not (quiet or rank != 0),
                         process_group=group, replace=not no_clobber, sigma_data=scheduler_sigma_data(model))
    vae = load_vae(model, config=config, device=device)
    plan = run_encode_file(vae, job)
    if rank != 0:
        return
    typer.echo(f"{plan}\nwrote {out}")


def _check_encode_input(image: Path, model: Path | None, config: Path | None) -> None:
    """encode's input before the model loads: a video for a 3-D VAE, else an image whose sides are
    multiples of the VAE's factor (where its config names it)."""
    from ..pipelines.folders import part_config, vae_factor_of
    from ..pipelines.recipes import check_image_size

    if _video_vae(model):
        checks.video_input(image)
        return
    cfg = part_config(model, "vae", config)
    pic = checks.image_input(image, decode=True, alpha=(cfg or {}).get("in_channels") == 4)  # (RGBA VAEs)
    f = vae_factor_of(cfg)
    if f is not None:
        check_image_size(str(image), pic.width, pic.height, f)


def _latent_channels(cfg: dict | None, name: str | None) -> int | None:
    """The channels of a 2-D VAE's latents file its config names (Flux.2: 4 x latent_channels, its 2x2
    patches; None: not known before it loads)."""
    from ..pipelines.image_latents import channels_of

    return channels_of(name or "AutoencoderKL", cfg or {})


def _vae_class(model) -> str | None:
    """The VAE class --model names (read from its JSON, nothing loaded; None: not known before it loads)."""
    from ..pipelines.loading import vae_class

    return vae_class(model)


def _video_vae(model) -> bool:
    """Whether --model holds a video VAE: a 3-D VAE or SVD's temporal decoder (read from its JSON, nothing
    loaded)."""
    from ..locality.classes import BATCHED_VAES
    from ..locality.video_classes import VIDEO_VAES

    return _vae_class(model) in (*VIDEO_VAES, *BATCHED_VAES)
