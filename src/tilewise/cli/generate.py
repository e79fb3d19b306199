"""Commands that run the denoiser: `generate` (text to image at any size) and `upscale` (tiled img2img).

Each checks its options, builds the recipe's options record (`GenerateOptions`, `UpscaleOptions`), runs
the recipe and reports. Imports of torch, PIL and the library layers are inside the functions: they keep
`tilewise --help` fast.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from ..atomic import write_text
from ..errors import BadRequest
from . import checks, options
from .batch import RayAddress, Workers
from .options import Config, Device, DType, Method, Mode, Model, NoClobber, Nproc, Quiet, Report, Scheduler
from .ranks import join_ranks
from .report import finish_report, run_folder, write_plan

if TYPE_CHECKING:
    from ..pipelines import GenerateOptions, GenerateResult, Loaded


def generate(
    out: Annotated[Path, typer.Option(help="output .png / .tif / .npy (streamed, written atomically); with "
                                      "--frames a frame pattern 'frames/f{:04d}.png', a .npy or .tif stack; "
                                      "with --prompts a folder")],
    prompt: Annotated[str | None, typer.Option(help="prompt for the whole image")] = None,
    prompts: Annotated[
        Path | None,
        typer.Option(help="a batch: one prompt per line, or JSON lines with prompt, width, height, seed, "
                     "negative, regions; one image per line (NNNNN.png, its line number) in --out DIR"),
    ] = None,
    width: Annotated[int, typer.Option(min=8, help="pixels, a multiple of 8")] = 1024,
    height: Annotated[int, typer.Option(min=8, help="pixels, a multiple of 8")] = 512,
    region: Annotated[
        list[str] | None, typer.Option(help="'x0,y0,x1,y1:prompt' in pixels; repeatable")
    ] = None,
    negative: Annotated[str, typer.Option(help="negative prompt")] = "",
    method: Annotated[Method, typer.Option(help="tile fusion of the denoiser")] = Method.mixture,
    tile: Annotated[int, typer.Option(min=1, help="denoiser tile, latent px")] = 16,
    overlap: Annotated[int, typer.Option(min=0, help="denoiser tile overlap, latent px")] = 4,
    batch_size: Annotated[
        int | None, typer.Option(min=1, help="tiles per UNet call (default 32 embedded, else 4)")
    ] = None,
    steps: Annotated[int, typer.Option(min=1, max=1000)] = 20,
    guidance: Annotated[float, typer.Option(min=0.0, help="classifier-free guidance scale")] = 5.0,
    seed: Annotated[int, typer.Option(min=0)] = 0,
    scheduler: Annotated[Scheduler, typer.Option()] = Scheduler.ddim,
    vae_tile: Annotated[int, typer.Option(min=1, help="VAE tile, latent px")] = 32,
    vae_mode: Annotated[
        Mode, typer.Option(help="exact = equals the untiled decode; fast = estimated statistics")
    ] = Mode.exact,
    frames: Annotated[
        int | None, typer.Option(min=1, help="video pipelines (Wan 2.x, ...): frames to generate, e.g. 81")
    ] = None,
    tile_frames: Annotated[
        int | None, typer.Option(min=1, help="video: overlapping frame windows of this many latent frames "
                                 "(default: every frame in each tile)")
    ] = None,
    frame_overlap: Annotated[int, typer.Option(min=0, help="video: latent frames shared by windows")] = 0,
    model: Model = None,
    config: Config = None,
    device: Device = "auto",
    dtype: DType = "float32",
    report: Report = None,
    quiet: Quiet = False,
    nproc: Nproc = 1,
    no_clobber: NoClobber = False,
    ray: RayAddress = None,
    workers: Workers = None,
) -> None:
    """Text to image at any size: tiled denoising, then tiled VAE decoding streamed to the output file.

    Example: tilewise generate --prompt grass --width 2048 --height 512
    --region "0,0,1024,512:brick" --region "1024,0,2048,512:gravel" --out wide.png

    Example (text to video, the decode streamed frame by frame): tilewise generate --model wan-folder
    --prompt "a fox in snow" --width 1280 --height 720 --frames 81 --tile 64 --out "frames/f{:04d}.png"

    Example (a batch, the model loaded once; resumable): tilewise generate --prompts prompts.txt --out images/
    """
    from ..pipelines import GenerateOptions, load_pipeline, parse_region, run_generate

    if (prompt is None) == (prompts is None):
        raise BadRequest("give --prompt TEXT (one image) or --prompts FILE (a batch), one of them")
    common = dict(width=width, height=height, negative=negative, method=method.value, tile_size=tile,
                  overlap=overlap, batch_size=batch_size, steps=steps, seed=seed, guidance=guidance,
                  vae_tile=vae_tile, vae_mode=vae_mode.value)  # (the GenerateOptions of every image)
    if prompts is not None:
        if region or frames is not None or report is not None or nproc != 1:
            raise BadRequest("--prompts takes regions in its JSON lines, and no --region, --frames, --report "
                             "or --nproc")
        opts = {**common, "progress": not quiet}
        settings = {"dtype": dtype, "scheduler": scheduler.value, "options": opts}
        return _batch("generate", prompts, out, model, config, device, settings, quiet, ray, workers)
    if ray is not None or workers is not None:
        raise BadRequest("--ray applies to batches: generate --prompts FILE")

    regions = [parse_region(r) for r in region or []]
    checks.regions(regions, width, height)
    _check_output(out, frames, no_clobber)
    checks.report_folder(report)
    checks.model_paths(model, config)
    device = options.resolve_device(device)
    checks.ranks(nproc, device)
    _check_size(model, config, width, height, dtype, device, len(regions))
    checks.output_room(out, height, width, 3, 8)
    group, rank = join_ranks(nproc)
    job = GenerateOptions(prompt, **common, regions=regions, out=str(out), progress=not (quiet or rank != 0),
                          process_group=group, replace=not no_clobber, frames=frames, tile_frames=tile_frames,
                          frame_overlap=frame_overlap)
    loaded = load_pipeline(model, config=config, scheduler=scheduler.value, device=device, dtype=dtype)
    t0 = time.perf_counter()
    res = run_generate(loaded, job)
    total = time.perf_counter() - t0
    if rank == 0:
        _report_generate(job, region or [], loaded, res, total, report)


def _check_size(model, config, width: int, height: int, dtype: str, device: str, regions: int) -> None:
    """The size against the model (multiples of its VAE's factor, twice that for a transformer's 2x2
    patches) and the memory there is, from its configs, before it loads (the recipe checks again)."""
    from ..pipelines.fits import check_generate_room
    from ..pipelines.folders import part_config, vae_factor_of

    f = vae_factor_of(part_config(model, "vae", config)) or 8
    transformer = part_config(model, "transformer", config)
    denoiser = transformer or part_config(model, "unet", config) or {}
    m = 2 * f if transformer is not None else f
    if width % m or height % m:
        raise BadRequest(f"width and height have to be positive multiples of {m} but are {width} and "
                         f"{height}")
    channels = int(denoiser.get("in_channels", 4) or 4)
    check_generate_room(channels, dtype, device, width, height, f, regions)


def _check_output(out: Path, frames: int | None, no_clobber: bool) -> None:
    """An image output, or for --frames one that takes that many frames (a pattern or a stack)."""
    if frames is None:
        checks.output(out, no_clobber=no_clobber, bits=8)
        return
    from ..pipelines.video import check_video_output

    checks.video_output(out, no_clobber=no_clobber, bits=8)
    check_video_output(str(out), 8, frames, replace=not no_clobber)


def _report_generate(job: GenerateOptions, region_texts: list[str], loaded: Loaded, res: GenerateResult,
                     total: float, report: Path | None) -> None:
    """The line of what `generate` wrote, and its run folder: tiles, VAE plan, the UNet's cost curve."""
    from ..geometry import TileGrid

    size = f"{job.width}x{job.height}"
    size = size if job.frames is None else f"{job.frames} frames of {size}"
    typer.echo(
        f"wrote {job.out} ({size}) in {total:.1f}s: denoise {res.seconds['denoise']:.1f}s "
        f"({res.unet_tiles_per_call} {'UNet' if loaded.denoiser == 'unet' else 'transformer'} tiles per "
        f"call), decode {res.seconds['decode']:.1f}s"
    )
    run_dir = run_folder(report, {
        "command": "generate", "prompt": job.prompt, "regions": region_texts, "size": [job.width, job.height],
        "method": job.method, "tile": job.tile_size, "overlap": job.overlap, "steps": job.steps,
        "frames": job.frames, "tile_frames": job.tile_frames, "frame_overlap": job.frame_overlap,
        "seed": job.seed, "model": loaded.source, "seconds": res.seconds, "output": job.out,
    })
    if run_dir is not None:
        pipe = loaded.pipe
        f = int(getattr(pipe, "vae_scale_factor_spatial", None) or getattr(pipe, "vae_scale_factor", 8))
        tile = job.tile_size
        grid = TileGrid(job.height // f, job.width // f, tile, overlap=job.overlap)
        grid.draw(str(run_dir / "tiles.png"), scale=f)
        write_plan(run_dir, res.vae_plan)
        if loaded.denoiser == "unet":  # the cost curve is measured on UNet calls
            _write_unet_costs(run_dir, loaded, job.guidance, sizes=(tile // 2, tile, 2 * tile, 3 * tile), f=f)
    finish_report(run_dir)


def _write_unet_costs(run_dir: Path, loaded, guidance: float, sizes, f: int) -> None:
    """Measure one UNet call at a few latent sizes (the real model's cost curve for the report)."""
    from ..buckets import profile_buckets
    from ..diffusion.adapters.unet import downsampling_factor

    unet = loaded.pipe.unet
    emb = loaded.encode("", "")["prompt_embeds"]

    def step(x):
        return unet(x, 500, encoder_hidden_states=emb.expand(len(x), -1, -1)).sample

    k = downsampling_factor(unet)
    sides = sorted({max(k, -(-s // k) * k) for s in sizes})
    buckets = [(s * f, s * f) for s in sides]
    prof = profile_buckets(step, buckets, guidance=guidance, repeats=2, device=unet.device, latent_factor=f,
                           channels=unet.config.in_channels, disable=True)
    write_text(run_dir / "costs.json", json.dumps(
        [{"tokens": t.tokens, "seconds": t.median, "label": "UNet call"} for t in prof.timings], indent=2))


def upscale(
    image: Annotated[Path, typer.Argument(help="input image; or a folder of images (a batch)")],
    out: Annotated[Path, typer.Option(help="output image; for a folder of images, a folder (names kept)")],
    scale: Annotated[float, typer.Option(min=0.01, help="output size = scale x input size")] = 2.0,
    strength: Annotated[float, typer.Option(min=0.0, max=1.0, help="how much to re-noise")] = 0.3,
    prompt: Annotated[str, typer.Option(help="prompt for the denoiser")] = "",
    method: Annotated[Method, typer.Option()] = Method.mixture,
    tile: Annotated[int, typer.Option(min=1, help="denoiser tile, latent px")] = 16,
    overlap: Annotated[int, typer.Option(min=0, help="latent px")] = 4,
    steps: Annotated[int, typer.Option(min=1, max=1000, help="denoising steps (schedulers train 1000)")] = 20,
    guidance: Annotated[float, typer.Option(min=0.0)] = 5.0,
    seed: Annotated[int, typer.Option(min=0)] = 0,
    vae_tile: Annotated[int, typer.Option(min=1, help="VAE tile, latent px")] = 32,
    controlnet: Annotated[
        Path | None,
        typer.Option(help="tile ControlNet folder (save_pretrained): run per tile with the resized input as "
                     "its control image"),
    ] = None,
    controlnet_scale: Annotated[float, typer.Option(min=0.0, help="ControlNet conditioning scale")] = 1.0,
    inversion_steps: Annotated[
        int,
        typer.Option(min=0, max=1000, help="DDIM-invert the input in N steps (same tiles) instead of fresh "
                     "noise; 0: off"),
    ] = 0,
    model: Model = None,
    config: Config = None,
    device: Device = "auto",
    dtype: DType = "float32",
    quiet: Quiet = False,
    nproc: Nproc = 1,
    no_clobber: NoClobber = False,
    ray: RayAddress = None,
    workers: Workers = None,
) -> None:
    """Tiled img2img upscaling: Lanczos resize, tiled encode, partial noise, tiled denoise, tiled decode.

    Example: tilewise upscale photo.png --scale 2 --strength 0.3 --prompt brick --out photo_2x.png

    Example: tilewise upscale photo.png --scale 2 --strength 0.5 --controlnet tile-cn --inversion-steps 10
    --out photo_2x.png

    Example (a folder, the model loaded once; resumable): tilewise upscale photos/ --scale 2 --out big/
    """
    from ..diffusion import UpscaleOptions, run_upscale

    common = dict(scale=scale, strength=strength, tile_size=tile, overlap=overlap, method=method.value,
                  vae_tile_size=vae_tile, num_inference_steps=steps, seed=seed,
                  inversion_steps=inversion_steps)  # (the UpscaleOptions of every image)
    if image.is_dir():
        if controlnet is not None or nproc != 1:
            raise BadRequest("upscale DIR takes no --controlnet or --nproc (use --ray for several processes)")
        opts = {**common, "disable": quiet}
        UpscaleOptions(**opts)  # checked now, before the model loads
        settings = {"dtype": dtype, "prompt": prompt, "guidance": guidance, "options": opts}
        return _batch("upscale", image, out, model, config, device, settings, quiet, ray, workers)
    if ray is not None or workers is not None:
        raise BadRequest("--ray applies to batches: upscale DIR --out DIR")
    from ..pipelines import load_pipeline
    from ..pipelines.fits import check_upscale_fits

    checks.output(out, no_clobber=no_clobber)
    src = checks.image_input(image, decode=True)  # at its depth (16-bit in, 16-bit out); alpha is not used
    checks.model_paths(model, config, controlnet=controlnet)
    device = options.resolve_device(device)
    checks.ranks(nproc, device)
    check_upscale_fits(src.width, src.height, scale)
    checks.output_room(out, round(src.height * scale), round(src.width * scale), 3, src.bits)
    group, rank = join_ranks(nproc)
    extra = _controlnet(controlnet, controlnet_scale, device, dtype)
    loaded = load_pipeline(model, config=config, device=device, dtype=dtype)
    cond = loaded.encode(prompt or "", "")
    job = UpscaleOptions(**common, disable=quiet or rank != 0, process_group=group)
    result = run_upscale(loaded.pipe, src.tensor((0.0, 1.0)), job, guidance_scale=guidance, **extra, **cond)
    if rank == 0:
        _write_upscaled(out, result, src, no_clobber)


def _batch(kind: str, source: Path, out: Path, model, config, device: str, settings: dict, quiet: bool,
           ray: str | None, workers: int | None) -> None:
    """A batch of generate (`source` the prompts file) or upscale (`source` the folder): the model
    checked, the runners' settings as JSON, the items run here or on Ray (`cli.batch`)."""
    from .batch import generate_batch, upscale_batch

    checks.model_paths(model, config)
    paths = {"model": model, "config": config}
    here = device if ray is not None else options.resolve_device(device)  # on Ray: each worker resolves
    settings = {**{k: None if v is None else str(v) for k, v in paths.items()}, "device": here, **settings}
    run = generate_batch if kind == "generate" else upscale_batch
    run(source, out, settings, quiet, ray, workers)


def _controlnet(folder: Path | None, scale: float, device: str, dtype: str) -> dict:
    """The upscale's ControlNet arguments: the model of --controlnet (small, and refused in one line before
    the pipeline loads) and its conditioning scale; none without one."""
    from ..pipelines.loading import load_controlnet

    if folder is None:
        return {}
    return dict(controlnet=load_controlnet(folder, device, dtype), controlnet_conditioning_scale=scale)


def _write_upscaled(out: Path, result, src, no_clobber: bool) -> None:
    """Write the upscaled image at the input's depth, and say so."""
    from ..sinks import open_sink

    h, w = result.shape[-2:]
    bits = src.bits
    with open_sink(str(out), h, w, 3, bits=bits, replace=not no_clobber, value_range=(0.0, 1.0)) as sink:
        sink.write(0, 0, result)
    typer.echo(f"wrote {out} ({w}x{h}, {bits}-bit) from {src.width}x{src.height} ({src.kind})")
