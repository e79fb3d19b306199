"""Commands that measure a model: `analyze` (tileability: static halos and sync points, empirical probes)
and `compare` (a tiled decode against the untiled one). Imports of torch and the library layers are inside
the functions: they keep `tilewise --help` fast.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from ..atomic import write_text
from . import checks, options
from .options import Config, Device, Mode, Model, NoClobber, Quiet, Report, parse_size
from .report import finish_report, run_folder


def analyze(
    size: Annotated[int, typer.Option(min=8, help="latent side used for the analysis and the probe")] = 32,
    model: Model = None,
    config: Config = None,
    device: Device = "auto",
) -> None:
    """Tileability of the model: static halos and sync points of the VAE, empirical probes of VAE and UNet;
    of a VAE folder (any family TiledVAE tiles, image or video), its decode and encode programs' segments,
    halos, sync points and verdict, as the engine tiles them.

    Example: tilewise analyze --size 32

    Example: tilewise analyze --model wan-vae-folder
    """
    import torch

    from ..locality import analyze as static
    from ..locality import probe_receptive_field
    from ..pipelines import load_pipeline

    checks.model_paths(model, config, vae_folder=True)
    device = options.resolve_device(device)
    if _vae_folder(model):
        _analyze_vae(model, device)
        return
    checks.pixels_fit(model, config, size, size, 2, "--size", f"{size}", device)
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


def _vae_folder(model) -> bool:
    """Whether --model is a VAE folder (a config.json of its own, no model_index.json)."""
    from pathlib import Path

    return model is not None and Path(model).is_dir() and (Path(model) / "config.json").is_file() and not (
        Path(model) / "model_index.json").is_file()


def _analyze_vae(model, device: str) -> None:
    """A VAE folder's decode and encode programs, analysed as the engine tiles them (`tw.analyze`)."""
    from ..pipelines import load_vae
    from ..vae.analysis import analyze as whole

    vae = load_vae(model, device=device)
    for kind in ("decode", "encode"):
        typer.echo(f"== {type(vae).__name__} {kind} ==")
        typer.echo(str(whole(vae, kind=kind)))


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
    checks.pixels_fit(model, config, w, h, 3, "--size", size, "cpu")
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
