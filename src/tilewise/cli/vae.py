"""Commands of the tiled VAE: `decode`, `encode` and `plan` (`analyze` and `compare` are in `measure`).

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
from .options import Config, Device, DType, Mode, Model, NoClobber, Nproc, Quiet, Report, Staging
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


def plan(
    width: Annotated[int, typer.Option(min=8, help="image width in pixels")] = 2048,
    height: Annotated[int, typer.Option(min=8, help="image height in pixels")] = 2048,
    kind: Annotated[str, typer.Option(help="decode | encode")] = "decode",
    tile: Annotated[int, typer.Option(min=1, help="VAE tile, latent px")] = 32,
    mode: Annotated[Mode, typer.Option()] = Mode.exact,
    budget: Annotated[
        str | None, typer.Option(help="memory budget, e.g. 2GiB: picks tile and staging")
    ] = None,
    staging: Annotated[Staging, typer.Option()] = Staging.auto,
    image: Annotated[
        Path | None, typer.Option("--image", help="draw the tile grid and halos to this PNG")
    ] = None,
    over: Annotated[Path | None, typer.Option(help="picture to draw the grid over")] = None,
    ranks: Annotated[
        int, typer.Option(min=1, help="also plan N processes (--nproc N): rows, tiles, staged bytes per rank")
    ] = 1,
    model: Model = None,
    config: Config = None,
    device: Annotated[
        str,
        typer.Option(help="the device to plan for, e.g. cuda, cpu (need not be on this machine); "
                     "auto: cuda when one is present, else cpu"),
    ] = "auto",
    dtype: DType = "float32",
    report: Report = None,
    no_clobber: NoClobber = False,
) -> None:
    """Print the plan of a tiled VAE run before spending anything: tiles, halos, memory per stage, and what
    it dispatches on the device it is planned for (FLOPs, kernel launches, device peak, host<->device
    bytes, estimated time). A CUDA plan can be made and read on any machine.

    Example: tilewise plan --width 8192 --height 8192 --budget 2GiB --image plan.png --ranks 4

    Example: tilewise plan --width 4096 --height 4096 --device cuda --dtype float16 --budget 16GiB
    """
    from ..pipelines import load_pipeline
    from ..vae import TiledVAE

    _check_plan_options(kind, image, over, report, model, config, no_clobber)
    checks.budget(budget)
    device = options.resolve_device(device, present=False)
    kind_of = "cpu" if device.startswith("cpu") else "cuda"  # (any accelerator plans CUDA-shaped)
    loaded = load_pipeline(model, config=config, dtype=dtype)  # (on the CPU: planning runs nothing)
    f = int(getattr(loaded.pipe, "vae_scale_factor", 8))
    if width % f or height % f:
        raise ValueError(f"width and height have to be multiples of {f} but are {width} and {height}")
    tv = TiledVAE(loaded.pipe.vae, tile_size=tile, mode=mode.value, memory_budget=budget,
                  staging=staging.value, device_kind=kind_of)
    shape, p = _plan_of(tv, loaded.pipe.vae, kind, width, height, f)
    typer.echo(str(p))
    typer.echo(f"  device {device}: {_here(device)}")
    lat = (height // f, width // f)
    _check_ranks(ranks, lat, p.tile_size, width, height, kind)
    owner = _rank_owners(tv, shape, ranks, kind, p.tile_size, lat) if ranks > 1 else None
    _plan_outputs(p, report, image, over, kind, (width, height), lat, f, owner)


def _plan_outputs(p, report: Path | None, image: Path | None, over: Path | None, kind: str,
                  size: tuple[int, int], lat: tuple[int, int], f: int, owner: dict | None) -> None:
    """plan's files: the tile grid drawn to --image and to the report's tiles.png, and the report."""
    run_dir = run_folder(report, {"command": "plan", "size": list(size), "kind": kind})
    pictures = [q for q in (image, run_dir / "tiles.png" if run_dir else None) if q is not None]
    if pictures:
        _draw_plan(pictures, over, size, lat, p.tile_size, f, owner)
    write_plan(run_dir, p)
    finish_report(run_dir)


def _check_plan_options(kind: str, image: Path | None, over: Path | None, report: Path | None, model, config,
                        no_clobber: bool) -> None:
    """plan's checks before the model loads: the kind, the picture, the report folder, --over, the model."""
    if kind not in ("decode", "encode"):
        raise ValueError(f"--kind must be 'decode' or 'encode', got {kind!r}")
    checks.picture(image, "--image", no_clobber)
    checks.report_folder(report)
    if over is not None:
        checks.image_input(over, "--over")
    checks.model_paths(model, config)


def _plan_of(tv, vae, kind: str, width: int, height: int, f: int):
    """The input shape of a `kind` run of `vae` over a width x height image, and the TiledVAE's plan of it."""
    from ..errors import WontFit

    shape = (
        (1, vae.config.latent_channels, height // f, width // f)
        if kind == "decode"
        else (1, vae.config.in_channels, height, width)
    )
    try:
        return shape, tv.plan(shape, kind=kind)
    except WontFit as e:
        raise WontFit(f"plan of a {width}x{height} {kind} (latent {height // f}x{width // f}): {e}") from e


def _check_ranks(ranks: int, lat: tuple[int, int], tile: int, width: int, height: int, kind: str) -> None:
    """--ranks at most the plan's tile rows: each rank takes whole rows of tiles (more would hold none)."""
    from ..geometry import TileGrid

    rows = TileGrid(*lat, (min(tile, lat[0]), min(tile, lat[1]))).rows
    if ranks > rows:
        raise BadRequest(f"--ranks {ranks}: the {width}x{height} {kind} in tiles of {tile} latent px has "
                         f"{rows} tile row{'s' if rows > 1 else ''} and each rank takes whole rows; use "
                         f"--ranks 1..{rows} (or a smaller --tile)")


def _rank_owners(tv, shape: tuple[int, ...], ranks: int, kind: str, tile: int, lat: tuple[int, int]) -> dict:
    """Print each of `ranks` processes' plan, and return which rank owns each tile (its row band)."""
    from ..geometry import TileGrid
    from ..vae import plan_ranks
    from ..vae.run.sharding import RowBands

    for rp in plan_ranks(tv, shape, ranks, kind=kind, tile_size=tile):
        typer.echo(f"  {rp}")
    g = TileGrid(*lat, (min(tile, lat[0]), min(tile, lat[1])), order="serpentine")
    bands = RowBands.build(g, 0, ranks)
    return {i: r for r in range(ranks) for i in bands.tiles[r]}


def _draw_plan(pictures: list[Path], over: Path | None, size: tuple[int, int], lat: tuple[int, int],
               tile: int, f: int, owner: dict | None) -> None:
    """Draw the plan's tile grid (ranks coloured by `owner`) to each picture, over --over's image if given."""
    import numpy as np

    from ..geometry import TileGrid

    backdrop = None
    if over is not None:
        from PIL import Image

        from ..sources import read_image

        pic = read_image(over)  # the grid is drawn over an 8-bit view of it
        rgb = pic.pixels if pic.bits == 8 else (pic.pixels >> 8).astype(np.uint8)
        backdrop = np.asarray(Image.fromarray(rgb).resize(size))
    grid = TileGrid(*lat, tile, order="serpentine")
    for q in pictures:
        grid.draw(str(q), image=backdrop, scale=f, owner=owner)
        typer.echo(f"wrote {q}")


def _here(device: str) -> str:
    """Whether the device planned for is on this machine (and which it is)."""
    import torch

    if device.startswith("cpu"):
        return "this machine's CPU"
    if device.startswith("cuda") and torch.cuda.is_available():
        return f"{torch.cuda.get_device_name(torch.device(device))} on this machine"
    return ("not on this machine (a plan runs nothing: its counts come from its tiles, its time from the "
            "model)")
