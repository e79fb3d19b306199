"""`tilewise plan`: the plan of a tiled VAE run printed before anything is spent (tiles, halos, memory per
stage, what it dispatches on the device it is planned for), its tile grid drawn, per-rank plans; of a
pipeline's VAE, the embedded one, or a VAE folder of any family (a video VAE's with its frames).
Imports of torch and the library layers are inside the functions: they keep `tilewise --help` fast.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ..errors import BadRequest
from . import checks, options
from .options import Config, DType, Mode, Model, NoClobber, Report, Staging
from .report import finish_report, run_folder, write_plan


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
    frames: Annotated[
        int | None, typer.Option(min=1, help="a video VAE's input frames (latent frames to decode, video "
                                 "frames to encode); default 1")
    ] = None,
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

    Example: tilewise plan --model wan-vae-folder --width 1280 --height 720 --frames 21 --budget 8GiB
    """
    from ..pipelines import load_vae
    from ..vae import TiledVAE

    _check_plan_options(kind, image, over, report, model, config, no_clobber)
    checks.budget(budget)
    device = options.resolve_device(device, present=False)
    kind_of = "cpu" if device.startswith("cpu") else "cuda"  # (any accelerator plans CUDA-shaped)
    video = _check_video_plan(model, kind, frames, ranks)  # (before anything loads)
    vae = load_vae(model, config=config, dtype=dtype)  # (on the CPU: planning runs nothing)
    tv = TiledVAE(vae, tile_size=tile, mode=mode.value, memory_budget=budget, staging=staging.value,
                  device_kind=kind_of)
    f = tv.factor("decode")
    if width % f or height % f:
        raise ValueError(f"width and height have to be multiples of {f} but are {width} and {height}")
    shape, p = _plan_of(tv, kind, width, height, f, (frames or 1,) if video else ())
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
    checks.model_paths(model, config, vae_folder=True)


def _check_video_plan(model, kind: str, frames: int | None, ranks: int) -> bool:
    """Whether the --model's VAE runs a video program for `kind`, read from its JSON (the embedded model's
    and a single file's: AutoencoderKL); --frames is a video VAE's, --ranks plans the 2-D VAEs' row bands
    (BadRequest otherwise)."""
    from ..locality.classes import BATCHED_VAES
    from ..locality.video_classes import VIDEO_VAES
    from ..pipelines.loading import vae_class

    name = vae_class(model) or "AutoencoderKL"
    video = name in VIDEO_VAES or name in BATCHED_VAES and kind == "decode"
    if frames is not None and not video:
        raise BadRequest(f"--frames {frames}: the {name} of --model is an image VAE (its input has no "
                         "frames); give --frames with a video VAE")
    if video and ranks > 1:
        raise BadRequest(f"--ranks {ranks}: per-rank plans cover the 2-D VAEs; a video VAE's ranks each run "
                         f"a band of tile rows of every step (tilewise decode --nproc {ranks})")
    return video


def _plan_of(tv, kind: str, width: int, height: int, f: int, frames: tuple[int, ...] = ()):
    """The input shape of a `kind` run over a width x height image (a video VAE's: of `frames` frames),
    and the TiledVAE's plan of it."""
    from ..errors import WontFit

    c = tv.program(kind, frames[0] if frames else None).in_channels
    shape = (1, c, *frames, height // f, width // f) if kind == "decode" else (1, c, *frames, height, width)
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
