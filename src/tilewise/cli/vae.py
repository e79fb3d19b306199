"""Commands of the tiled VAE: `decode`, `encode`, `analyze` (tileability), `plan`, `compare` (vs untiled).

`decode` and `encode` build the recipes' options record (`VaeFileOptions`) from their typed options. Imports
of torch, numpy, PIL and the library layers are inside the functions: they keep `tilewise --help` fast.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from ..atomic import write_text
from ..errors import BadRequest
from . import checks, options
from .options import Config, Device, DType, Mode, Model, NoClobber, Nproc, Quiet, Report, Staging, parse_size
from .ranks import join_ranks
from .report import finish_report, run_folder, write_plan


def decode(
    latents: Annotated[
        Path,
        typer.Argument(help=".safetensors with a 'latents' tensor (pipeline-scaled; 3-D VAE: B, C, T, H, W)"),
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
    model: Model = None,
    config: Config = None,
    device: Device = "auto",
    report: Report = None,
    quiet: Quiet = False,
    nproc: Nproc = 1,
    no_clobber: NoClobber = False,
) -> None:
    """Decode latents tile by tile, streamed to the output file.

    --model: a pipeline folder, a checkpoint, or a VAE folder; a 3-D VAE (Qwen-Image, Wan, LTX-Video)
    decodes (B, C, T, H, W) latents, one frame to an image, several to a video.

    Example: tilewise decode latents.safetensors --out image.tif --mode exact --budget 2GiB

    Example: tilewise decode video.safetensors --model wan-folder --out "frames/f{:04d}.png"
    """
    from ..pipelines import VaeFileOptions, load_vae, run_decode_file
    from ..pipelines.folders import part_config, vae_factor_of

    checks.model_paths(model, config, vae_folder=True)
    video = _video_vae(model, nproc)
    if not video:
        checks.output(out, no_clobber=no_clobber, bits=bits)
    cfg = part_config(model, "vae", config)
    shape = checks.latents_input(latents, video=video, channels=None if video else _latent_channels(cfg))
    if video:
        checks.video_output(out, no_clobber=no_clobber, bits=bits, frames=shape[-3])
    checks.report_folder(report)
    checks.budget(budget)
    device = options.resolve_device(device)
    checks.ranks(nproc, device)
    f = None if video else vae_factor_of(cfg)
    if f is not None:
        checks.output_room(out, shape[-2] * f, shape[-1] * f, 3, bits)
    group, rank = join_ranks(nproc)
    job = VaeFileOptions(str(latents), str(out), tile_size=tile, mode=mode.value, budget=budget,
                         staging=staging.value, bits=bits, progress=not (quiet or rank != 0),
                         process_group=group, replace=not no_clobber)
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


def encode(
    image: Annotated[
        Path,
        typer.Argument(
            help="input image; 3-D VAE: or a video (frame pattern f{:04d}.png, .npy or .tif stack)"
        ),
    ],
    out: Annotated[Path, typer.Option(help="output latents .safetensors")],
    mode: Annotated[Mode, typer.Option()] = Mode.exact,
    tile: Annotated[int, typer.Option(min=1, help="VAE tile, latent px")] = 32,
    budget: Annotated[str | None, typer.Option(help="memory budget, e.g. 2GiB")] = None,
    staging: Annotated[Staging, typer.Option()] = Staging.auto,
    model: Model = None,
    config: Config = None,
    device: Device = "auto",
    quiet: Quiet = False,
    nproc: Nproc = 1,
    no_clobber: NoClobber = False,
) -> None:
    """Encode an image tile by tile into latents (the distribution's mean, pipeline-scaled).

    8- and 16-bit, grey or colour images are read at their depth; an alpha channel is not used. --model as
    for decode; sides must be multiples of the VAE's factor (8, 16 for Wan 2.2).

    Example: tilewise encode photo.png --out latents.safetensors

    Example: tilewise encode video.npy --model wan-folder --out video.safetensors
    """
    from ..pipelines import VaeFileOptions, load_vae, run_encode_file
    from ..pipelines.folders import part_config, vae_factor_of
    from ..pipelines.recipes import check_image_size

    checks.output(out, suffixes=(".safetensors",), no_clobber=no_clobber)
    checks.model_paths(model, config, vae_folder=True)
    if _video_vae(model, nproc):
        checks.video_input(image)
    else:
        pic = checks.image_input(image, decode=True)
        f = vae_factor_of(part_config(model, "vae", config))
        if f is not None:
            check_image_size(str(image), pic.width, pic.height, f)
    checks.budget(budget)
    device = options.resolve_device(device)
    checks.ranks(nproc, device)
    group, rank = join_ranks(nproc)
    job = VaeFileOptions(str(image), str(out), tile_size=tile, mode=mode.value, budget=budget,
                         staging=staging.value, progress=not (quiet or rank != 0), process_group=group,
                         replace=not no_clobber)
    vae = load_vae(model, config=config, device=device)
    plan = run_encode_file(vae, job)
    if rank != 0:
        return
    typer.echo(f"{plan}\nwrote {out}")


def _latent_channels(cfg: dict | None) -> int | None:
    """The latent channels a 2-D VAE's config names (None: not known before it loads)."""
    c = (cfg or {}).get("latent_channels")
    return c if isinstance(c, int) else None


def _video_vae(model, nproc: int) -> bool:
    """Whether --model holds a 3-D VAE (read from its JSON, nothing loaded); --nproc is refused for one
    before launching ranks (its tiled runs are single-process)."""
    from ..locality.lowering3d import VIDEO_VAES
    from ..pipelines.loading import vae_class

    name = vae_class(model)
    if name not in VIDEO_VAES:
        return False
    if nproc > 1:
        raise BadRequest(f"--nproc {nproc}: {name} (a 3-D VAE) decodes and encodes in one process for now; "
                         "drop --nproc")
    return True


def analyze(
    size: Annotated[int, typer.Option(min=8, help="latent side used for the analysis and the probe")] = 32,
    model: Model = None,
    config: Config = None,
    device: Device = "auto",
) -> None:
    """Tileability of the model: static halos and sync points of the VAE, empirical probes of VAE and UNet.

    Example: tilewise analyze --size 32
    """
    import torch

    from ..locality import analyze as static
    from ..locality import probe_receptive_field
    from ..pipelines import load_pipeline

    checks.model_paths(model, config)
    device = options.resolve_device(device)
    _check_pixels(model, config, size, size, 2, "--size", f"{size}", device)
    loaded = load_pipeline(model, config=config, device=device)
    vae, unet = loaded.pipe.vae, loaded.pipe.unet
    f = int(getattr(loaded.pipe, "vae_scale_factor", 8))
    g = torch.Generator().manual_seed(0)
    z = torch.randn(1, vae.config.latent_channels, size, size, generator=g).to(device)
    x = torch.randn(1, vae.config.in_channels, size * f, size * f, generator=g).to(device)
    for name, module, example in (("VAE decoder", vae.decoder, z), ("VAE encoder", vae.encoder, x)):
        typer.echo(f"== {name} ==")
        typer.echo(str(static(module, example)))
        typer.echo(str(probe_receptive_field(module, example)))
    typer.echo("== UNet (probe at timestep 500, prompt embeddings zero) ==")
    cond = loaded.encode("", "")["prompt_embeds"]

    class _Step(torch.nn.Module):
        def forward(self, s):
            return unet(s, 500, encoder_hidden_states=cond.expand(len(s), -1, -1)).sample

    lz = torch.randn(1, unet.config.in_channels, size, size, generator=g).to(device)
    typer.echo(str(probe_receptive_field(_Step(), lz)))
    typer.echo(
        "The UNet's self-attention reaches the whole latent: tiled denoising is an approximation "
        "(global composition can change); choose it separately from the exact tiled VAE."
    )


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
    run_dir = run_folder(report, {"command": "plan", "size": [width, height], "kind": kind})
    pictures = [q for q in (image, run_dir / "tiles.png" if run_dir else None) if q is not None]
    if pictures:
        _draw_plan(pictures, over, (width, height), lat, p.tile_size, f, owner)
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


def compare(
    size: Annotated[str, typer.Option(help="latent size WxH")] = "64x64",
    pattern: Annotated[str, typer.Option(help="white | structured latent")] = "structured",
    tile: Annotated[int, typer.Option(min=1, help="VAE tile, latent px")] = 16,
    mode: Annotated[Mode, typer.Option()] = Mode.exact,
    heatmap: Annotated[Path | None, typer.Option(help="write the error heatmap PNG here")] = None,
    diffusers_tiling: Annotated[bool, typer.Option(help="also measure diffusers' enable_tiling")] = True,
    model: Model = None,
    config: Config = None,
    report: Report = None,
    quiet: Quiet = False,
    no_clobber: NoClobber = False,
) -> None:
    """Tiled vs untiled decode of the same latent: max/mean error, PSNR, seam score, tone drift, heatmap.

    Example: tilewise compare --size 96x64 --tile 16 --mode fast --heatmap err.png
    """
    from ..geometry import TileGrid
    from ..metrics import compare as measure
    from ..pipelines import load_pipeline

    if pattern not in ("white", "structured"):
        raise ValueError(f"--pattern must be 'white' or 'structured', got {pattern!r}")
    w, h = parse_size(size, "--size")
    checks.picture(heatmap, "--heatmap", no_clobber)
    checks.report_folder(report)
    checks.model_paths(model, config)
    _check_pixels(model, config, w, h, 3, "--size", size, "cpu")
    loaded = load_pipeline(model, config=config)
    vae = loaded.pipe.vae
    f = int(getattr(loaded.pipe, "vae_scale_factor", 8))
    z, ref, got = _decode_both(vae, pattern, (h, w), tile, mode.value, quiet)
    grid = TileGrid(h * f, w * f, tile * f)
    rows = {"tilewise " + mode.value: measure(got, ref, tiles=grid, data_range=2.0)}
    if diffusers_tiling:
        rows["diffusers enable_tiling"] = _diffusers_tiling_error(vae, z, ref, grid, tile, f)
    _echo_errors(rows)
    run_dir = run_folder(report, {"command": "compare", "size": size, "pattern": pattern, "tile": tile})
    targets = [q for q in (heatmap, run_dir / "heatmap.png" if run_dir else None) if q is not None]
    _write_heatmaps(targets, got, ref, grid, f"|tiled - untiled|, {mode.value}, tile {tile} latent px")
    if run_dir is not None:
        write_text(run_dir / "errors.json", json.dumps({k: v.as_dict() for k, v in rows.items()}, indent=2))
    finish_report(run_dir)


def _check_pixels(model, config, w: int, h: int, copies: int, option: str, value: str, device: str) -> None:
    """Refuse (WontFit) a latent size whose decoded images (`copies` float32 RGB images, a lower bound of
    what the command holds) cannot fit the memory there is, before the model loads."""
    from ..limits import check_memory
    from ..pipelines.folders import part_config, vae_factor_of

    f = vae_factor_of(part_config(model, "vae", config)) or 8
    check_memory(copies * 3 * 4 * (h * f) * (w * f), f"{option} {value}: {copies} images of {w * f}x{h * f} "
                 "float32 RGB", device, hint=f"a smaller {option}")


def _decode_both(vae, pattern: str, size: tuple[int, int], tile: int, mode: str, quiet: bool):
    """A test latent of `pattern` at size (h, w), decoded untiled (the reference) and by a TiledVAE."""
    import torch

    from ..patterns import structured_latent, white_latent
    from ..vae import TiledVAE

    shape = (1, vae.config.latent_channels, *size)
    z = (white_latent if pattern == "white" else structured_latent)(shape, seed=0).to(vae.dtype)
    with torch.no_grad():
        ref = vae.decode(z).sample
        got = TiledVAE(vae, tile_size=tile, mode=mode, progress=not quiet).decode(z).sample
    return z, ref, got


def _diffusers_tiling_error(vae, z, ref, grid, tile: int, f: int):
    """The error of diffusers' own tiled decode (enable_tiling, on a copy of `vae`) at the same tile size."""
    import copy

    import torch

    from ..metrics import compare as measure

    dv = copy.deepcopy(vae)
    dv.enable_tiling()
    dv.tile_latent_min_size, dv.tile_sample_min_size = tile, tile * f
    with torch.no_grad():
        return measure(dv.decode(z).sample, ref, tiles=grid, data_range=2.0)


def _echo_errors(rows: dict) -> None:
    """One line per decode: max and mean error, PSNR, seam score (and the untiled one's), tone drift."""
    for name, c in rows.items():
        seam = "-" if c.seam_score is None else f"{c.seam_score:.3f} (untiled {c.seam_score_reference:.3f})"
        typer.echo(
            f"{name:<26} max {c.max_abs:.3g}  mean {c.mean_abs:.3g}  PSNR {c.psnr:.1f} dB  "
            f"seam {seam}  tone drift {c.tone_drift:.3g}"
        )


def _write_heatmaps(targets: list[Path], got, ref, grid, title: str) -> None:
    """The error heatmap |got - ref| with the tile grid over it, to each target PNG."""
    from ..metrics import error_heatmap, save_heatmap_png

    for q in targets:
        save_heatmap_png(error_heatmap(got, ref), str(q), grid_or_boxes=grid, title=title)
        typer.echo(f"wrote {q}")
