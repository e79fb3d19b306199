"""The `tilewise` command: a thin typed layer over the library (typer). Errors print one line; --debug
shows the traceback. Outputs are written under a temporary name and renamed when complete."""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from enum import Enum
from pathlib import Path
from typing import Annotated

import typer

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    context_settings={"help_option_names": ["-h", "--help"]},
    help="Memory-bounded high-resolution diffusion: exact tiled VAE, tiled denoising, resolution buckets.\n\n"
    "Runs on the embedded default model unless --model points at a diffusers pipeline folder or a "
    ".safetensors checkpoint (local files only).",
)
logger = logging.getLogger("tilewise.cli")
STATE = {"debug": False}


class Method(str, Enum):
    multidiffusion = "multidiffusion"
    mixture = "mixture"
    spot = "spot"


class Mode(str, Enum):
    exact = "exact"
    fast = "fast"


class Staging(str, Enum):
    auto = "auto"
    device = "device"
    host = "host"
    disk = "disk"


class Scheduler(str, Enum):
    ddim = "ddim"
    euler = "euler"
    euler_a = "euler_a"
    dpm = "dpm"


class Policy(str, Enum):
    pad = "pad"
    resize = "resize"
    crop = "crop"
    auto = "auto"


Model = Annotated[
    Path | None,
    typer.Option(
        help="diffusers pipeline folder or .safetensors checkpoint (default: the embedded model), "
        "e.g. --model sd15-folder or --model sd15.safetensors --config sd15-folder"
    ),
]
Config = Annotated[
    Path | None,
    typer.Option(
        "--config",
        help="diffusers pipeline folder (model_index.json, configs, tokenizer) of the same architecture "
        "as a single-file --model; needed offline, e.g. --model sd15.safetensors --config sd15-folder",
    ),
]
Device = Annotated[str, typer.Option(help="torch device, e.g. cpu, cuda, cuda:1")]
DType = Annotated[
    str, typer.Option(help="float32 | float16 | bfloat16 (keep the VAE in float32 on fp16 overflow)")
]
Report = Annotated[
    Path | None,
    typer.Option("--report", help="write a run folder with plan, pictures and an HTML report here"),
]
Quiet = Annotated[bool, typer.Option("--quiet", "-q", help="no progress bars")]
Nproc = Annotated[
    int,
    typer.Option(
        min=1,
        help="processes to split the tiles over (one per GPU), launched with torchrun on this machine; "
        "rank 0 writes the output. Several machines: run torchrun yourself, e.g. torchrun --nnodes 2 "
        "--nproc-per-node 8 --rdzv-endpoint HOST:29500 -m tilewise.cli generate ...",
    ),
]


def _ranks(nproc: int) -> tuple[object, int]:
    """(process group, rank): under torchrun join its group; with --nproc > 1 relaunch under torchrun.

    The relaunch runs `python -m torch.distributed.run --standalone --nproc-per-node N -m tilewise.cli
    ARGS` (ARGS without --nproc) and exits with its status: torchrun stops every rank when one fails.
    """
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and "RANK" in os.environ:
        from .distributed import init_from_env

        rank, _ = init_from_env()
        return "default", rank
    if nproc > 1:
        import subprocess

        from .distributed import torchrun_command

        cmd = torchrun_command(sys.argv[1:], nproc)
        logger.info("launching %d ranks: %s", nproc, " ".join(cmd))
        code = subprocess.call(cmd)
        if code:
            raise RankFailure(f"{nproc} ranks under torchrun: exit status {code} (the failing rank's "
                              "error is printed above)", code)
        raise typer.Exit(0)
    return None, 0


class RankFailure(RuntimeError):
    """A torchrun launch whose ranks failed (their errors were printed by the ranks themselves)."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


@app.callback()
def _main(
    debug: Annotated[bool, typer.Option(help="show tracebacks instead of one-line errors")] = False,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="debug logging")] = False,
) -> None:
    STATE["debug"] = debug
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO, format="%(levelname)s %(name)s: %(message)s"
    )


def _size(text: str) -> tuple[int, int]:
    """'WxH' -> (W, H)."""
    try:
        w, h = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise ValueError(f"size {text!r} must look like WIDTHxHEIGHT, e.g. 1024x768") from None
    return w, h


def _run_dir(report: Path | None, info: dict) -> Path | None:
    if report is None:
        return None
    report.mkdir(parents=True, exist_ok=True)
    (report / "run.json").write_text(json.dumps(info, indent=2, default=str))
    return report


def _write_plan(run_dir: Path | None, plan) -> None:
    if run_dir is None or plan is None:
        return
    from dataclasses import asdict

    (run_dir / "plan.json").write_text(json.dumps(asdict(plan), indent=2, default=str))


def _finish_report(run_dir: Path | None) -> None:
    if run_dir is None:
        return
    from .report import build_report

    typer.echo(f"report: {build_report(run_dir)}")


@app.command()
def generate(
    prompt: Annotated[str, typer.Option(help="prompt for the whole image")],
    out: Annotated[Path, typer.Option(help="output .png / .tif / .npy (streamed, written atomically)")],
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
    model: Model = None,
    config: Config = None,
    device: Device = "cpu",
    dtype: DType = "float32",
    report: Report = None,
    quiet: Quiet = False,
    nproc: Nproc = 1,
) -> None:
    """Text to image at any size: tiled denoising, then tiled VAE decoding streamed to the output file.

    Example: tilewise generate --prompt grass --width 2048 --height 512
    --region "0,0,1024,512:brick" --region "1024,0,2048,512:gravel" --out wide.png
    """
    from .pipelines import generate as run
    from .pipelines import load_pipeline, parse_region

    regions = [parse_region(r) for r in region or []]
    group, rank = _ranks(nproc)
    quiet = quiet or rank != 0
    loaded = load_pipeline(model, config=config, scheduler=scheduler.value, device=device, dtype=dtype)
    t0 = time.perf_counter()
    res = run(
        loaded,
        prompt,
        width,
        height,
        negative=negative,
        regions=regions,
        method=method.value,
        tile_size=tile,
        overlap=overlap,
        batch_size=batch_size,
        steps=steps,
        seed=seed,
        guidance=guidance,
        vae_tile=vae_tile,
        vae_mode=vae_mode.value,
        out=str(out),
        progress=not quiet,
        process_group=group,
    )
    total = time.perf_counter() - t0
    if rank != 0:
        return
    typer.echo(
        f"wrote {out} ({width}x{height}) in {total:.1f}s: denoise {res.seconds['denoise']:.1f}s "
        f"({res.unet_tiles_per_call} UNet tiles per call), decode {res.seconds['decode']:.1f}s"
    )
    run_dir = _run_dir(
        report,
        {
            "command": "generate",
            "prompt": prompt,
            "regions": region or [],
            "size": [width, height],
            "method": method.value,
            "tile": tile,
            "overlap": overlap,
            "steps": steps,
            "seed": seed,
            "model": loaded.source,
            "seconds": res.seconds,
            "output": str(out),
        },
    )
    if run_dir is not None:
        from .geometry import TileGrid

        f = int(getattr(loaded.pipe, "vae_scale_factor", 8))
        TileGrid(height // f, width // f, tile, overlap=overlap).draw(str(run_dir / "tiles.png"), scale=f)
        _write_plan(run_dir, res.vae_plan)
        _write_unet_costs(run_dir, loaded, guidance, sizes=(tile // 2, tile, 2 * tile, 3 * tile), f=f)
    _finish_report(run_dir)


def _write_unet_costs(run_dir: Path, loaded, guidance: float, sizes, f: int) -> None:
    """Measure one UNet call at a few latent sizes (the real model's cost curve for the report)."""
    from .buckets import profile_buckets
    from .diffusion.adapters.unet import downsampling_factor

    unet = loaded.pipe.unet
    emb = loaded.encode("", "")["prompt_embeds"]

    def step(x):
        return unet(x, 500, encoder_hidden_states=emb.expand(len(x), -1, -1)).sample

    k = downsampling_factor(unet)
    sides = sorted({max(k, -(-s // k) * k) for s in sizes})
    buckets = [(s * f, s * f) for s in sides]
    prof = profile_buckets(step, buckets, guidance=guidance, repeats=2, device=unet.device, latent_factor=f,
                           channels=unet.config.in_channels, disable=True)
    (run_dir / "costs.json").write_text(json.dumps(
        [{"tokens": t.tokens, "seconds": t.median, "label": "UNet call"} for t in prof.timings], indent=2))


@app.command()
def upscale(
    image: Annotated[Path, typer.Argument(help="input image")],
    out: Annotated[Path, typer.Option(help="output image")],
    scale: Annotated[float, typer.Option(min=0.01, help="output size = scale x input size")] = 2.0,
    strength: Annotated[float, typer.Option(min=0.0, max=1.0, help="how much to re-noise")] = 0.3,
    prompt: Annotated[str, typer.Option(help="prompt for the denoiser")] = "",
    method: Annotated[Method, typer.Option()] = Method.mixture,
    tile: Annotated[int, typer.Option(min=1, help="denoiser tile, latent px")] = 16,
    overlap: Annotated[int, typer.Option(min=0, help="latent px")] = 4,
    steps: Annotated[int, typer.Option(min=1)] = 20,
    guidance: Annotated[float, typer.Option(min=0.0)] = 5.0,
    seed: Annotated[int, typer.Option(min=0)] = 0,
    vae_tile: Annotated[int, typer.Option(min=1, help="VAE tile, latent px")] = 32,
    model: Model = None,
    config: Config = None,
    device: Device = "cpu",
    dtype: DType = "float32",
    quiet: Quiet = False,
    nproc: Nproc = 1,
) -> None:
    """Tiled img2img upscaling: Lanczos resize, tiled encode, partial noise, tiled denoise, tiled decode.

    Example: tilewise upscale photo.png --scale 2 --strength 0.3 --prompt brick --out photo_2x.png
    """
    from PIL import Image

    from .diffusion import upscale as run
    from .pipelines import load_pipeline
    from .sinks import open_sink

    group, rank = _ranks(nproc)
    quiet = quiet or rank != 0
    loaded = load_pipeline(model, config=config, device=device, dtype=dtype)
    cond = loaded.encode(prompt or "", "")
    with Image.open(image) as im:
        src = im.convert("RGB")
    result = run(
        loaded.pipe,
        src,
        scale=scale,
        strength=strength,
        tile_size=tile,
        overlap=overlap,
        method=method.value,
        vae_tile_size=vae_tile,
        num_inference_steps=steps,
        seed=seed,
        guidance_scale=guidance,
        disable=quiet,
        process_group=group,
        **cond,
    )
    if rank != 0:
        return
    import numpy as np

    arr = np.asarray(result)
    with open_sink(str(out), arr.shape[0], arr.shape[1], 3) as sink:
        sink.write(0, 0, arr)
    typer.echo(f"wrote {out} ({arr.shape[1]}x{arr.shape[0]}) from {src.width}x{src.height}")


@app.command()
def decode(
    latents: Annotated[Path, typer.Argument(help=".safetensors with a 'latents' tensor (pipeline-scaled)")],
    out: Annotated[Path, typer.Option(help="output .png / .tif / .npy")],
    mode: Annotated[Mode, typer.Option()] = Mode.exact,
    tile: Annotated[int, typer.Option(min=1, help="VAE tile, latent px")] = 32,
    budget: Annotated[
        str | None, typer.Option(help="memory budget, e.g. 2GiB: picks tile and staging")
    ] = None,
    staging: Annotated[Staging, typer.Option()] = Staging.auto,
    bits: Annotated[int, typer.Option(help="8 or 16 bits per channel")] = 8,
    model: Model = None,
    config: Config = None,
    device: Device = "cpu",
    report: Report = None,
    quiet: Quiet = False,
    nproc: Nproc = 1,
) -> None:
    """Decode latents tile by tile, streamed to the output file.

    Example: tilewise decode latents.safetensors --out image.tif --mode exact --budget 2GiB
    """
    from .pipelines import decode_file, load_pipeline

    group, rank = _ranks(nproc)
    quiet = quiet or rank != 0
    loaded = load_pipeline(model, config=config, device=device)
    plan = decode_file(
        loaded,
        str(latents),
        str(out),
        tile_size=tile,
        mode=mode.value,
        budget=budget,
        staging=staging.value,
        bits=bits,
        progress=not quiet,
        process_group=group,
    )
    if rank != 0:
        return
    typer.echo(str(plan))
    typer.echo(f"wrote {out}")
    run_dir = _run_dir(
        report, {"command": "decode", "latents": str(latents), "mode": mode.value, "output": str(out)}
    )
    _write_plan(run_dir, plan)
    _finish_report(run_dir)


@app.command()
def encode(
    image: Annotated[Path, typer.Argument(help="input image (sides multiples of 8)")],
    out: Annotated[Path, typer.Option(help="output latents .safetensors")],
    mode: Annotated[Mode, typer.Option()] = Mode.exact,
    tile: Annotated[int, typer.Option(min=1, help="VAE tile, latent px")] = 32,
    budget: Annotated[str | None, typer.Option(help="memory budget, e.g. 2GiB")] = None,
    staging: Annotated[Staging, typer.Option()] = Staging.auto,
    model: Model = None,
    config: Config = None,
    device: Device = "cpu",
    quiet: Quiet = False,
    nproc: Nproc = 1,
) -> None:
    """Encode an image tile by tile into latents (the distribution's mean, pipeline-scaled).

    Example: tilewise encode photo.png --out latents.safetensors
    """
    from .pipelines import encode_file, load_pipeline

    group, rank = _ranks(nproc)
    quiet = quiet or rank != 0
    loaded = load_pipeline(model, config=config, device=device)
    plan = encode_file(
        loaded,
        str(image),
        str(out),
        tile_size=tile,
        mode=mode.value,
        budget=budget,
        staging=staging.value,
        progress=not quiet,
        process_group=group,
    )
    if rank != 0:
        return
    typer.echo(str(plan))
    typer.echo(f"wrote {out}")


@app.command()
def analyze(
    size: Annotated[int, typer.Option(min=8, help="latent side used for the analysis and the probe")] = 32,
    model: Model = None,
    config: Config = None,
    device: Device = "cpu",
) -> None:
    """Tileability of the model: static halos and sync points of the VAE, empirical probes of VAE and UNet.

    Example: tilewise analyze --size 32
    """
    import torch

    from .locality import analyze as static
    from .locality import probe_receptive_field
    from .pipelines import load_pipeline

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


@app.command()
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
    report: Report = None,
) -> None:
    """Print the plan of a tiled VAE run before spending anything: tiles, halos, memory per stage.

    Example: tilewise plan --width 8192 --height 8192 --budget 2GiB --image plan.png --ranks 4
    """
    from .geometry import TileGrid
    from .pipelines import load_pipeline
    from .vae import TiledVAE

    if kind not in ("decode", "encode"):
        raise ValueError(f"kind must be 'decode' or 'encode', got {kind!r}")
    loaded = load_pipeline(model, config=config)
    vae = loaded.pipe.vae
    f = int(getattr(loaded.pipe, "vae_scale_factor", 8))
    if width % f or height % f:
        raise ValueError(f"width and height have to be multiples of {f} but are {width} and {height}")
    tv = TiledVAE(vae, tile_size=tile, mode=mode.value, memory_budget=budget, staging=staging.value)
    shape = (
        (1, vae.config.latent_channels, height // f, width // f)
        if kind == "decode"
        else (1, vae.config.in_channels, height, width)
    )
    p = tv.plan(shape, kind=kind)
    typer.echo(str(p))
    owner = None
    if ranks > 1:
        from .vae.plan import plan_ranks
        from .vae.sharding import RowBands

        for rp in plan_ranks(tv, shape, ranks, kind=kind, tile_size=p.tile_size):
            typer.echo(f"  {rp}")
        lat = (height // f, width // f)
        g = TileGrid(*lat, (min(p.tile_size, lat[0]), min(p.tile_size, lat[1])), order="serpentine")
        bands = RowBands.build(g, 0, ranks)
        owner = {i: r for r in range(ranks) for i in bands.tiles[r]}
    run_dir = _run_dir(report, {"command": "plan", "size": [width, height], "kind": kind})
    pictures = [q for q in (image, run_dir / "tiles.png" if run_dir else None) if q is not None]
    if pictures:
        import numpy as np

        backdrop = None
        if over is not None:
            from PIL import Image

            with Image.open(over) as im:
                backdrop = np.asarray(im.convert("RGB").resize((width, height)))
        grid = TileGrid(height // f, width // f, p.tile_size, order="serpentine")
        for q in pictures:
            grid.draw(str(q), image=backdrop, scale=f, owner=owner)
            typer.echo(f"wrote {q}")
    _write_plan(run_dir, p)
    _finish_report(run_dir)


@app.command()
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
) -> None:
    """Tiled vs untiled decode of the same latent: max/mean error, PSNR, seam score, tone drift, heatmap.

    Example: tilewise compare --size 96x64 --tile 16 --mode fast --heatmap err.png
    """
    import torch

    from .geometry import TileGrid
    from .metrics import compare as measure
    from .metrics import error_heatmap, save_heatmap_png
    from .patterns import structured_latent, white_latent
    from .pipelines import load_pipeline
    from .vae import TiledVAE

    if pattern not in ("white", "structured"):
        raise ValueError(f"pattern must be 'white' or 'structured', got {pattern!r}")
    w, h = _size(size)
    loaded = load_pipeline(model, config=config)
    vae = loaded.pipe.vae
    f = int(getattr(loaded.pipe, "vae_scale_factor", 8))
    shape = (1, vae.config.latent_channels, h, w)
    z = (white_latent if pattern == "white" else structured_latent)(shape, seed=0).to(vae.dtype)
    with torch.no_grad():
        ref = vae.decode(z).sample
        got = TiledVAE(vae, tile_size=tile, mode=mode.value, progress=not quiet).decode(z).sample
    grid = TileGrid(h * f, w * f, tile * f)
    rows = {"tilewise " + mode.value: measure(got, ref, tiles=grid, data_range=2.0)}
    if diffusers_tiling:
        import copy

        dv = copy.deepcopy(vae)
        dv.enable_tiling()
        dv.tile_latent_min_size, dv.tile_sample_min_size = tile, tile * f
        with torch.no_grad():
            rows["diffusers enable_tiling"] = measure(dv.decode(z).sample, ref, tiles=grid, data_range=2.0)
    for name, c in rows.items():
        seam = "-" if c.seam_score is None else f"{c.seam_score:.3f} (untiled {c.seam_score_reference:.3f})"
        typer.echo(
            f"{name:<26} max {c.max_abs:.3g}  mean {c.mean_abs:.3g}  PSNR {c.psnr:.1f} dB  "
            f"seam {seam}  tone drift {c.tone_drift:.3g}"
        )
    run_dir = _run_dir(report, {"command": "compare", "size": size, "pattern": pattern, "tile": tile})
    targets = [q for q in (heatmap, run_dir / "heatmap.png" if run_dir else None) if q is not None]
    for q in targets:
        save_heatmap_png(
            error_heatmap(got, ref),
            str(q),
            grid_or_boxes=grid,
            title=f"|tiled - untiled|, {mode.value}, tile {tile} latent px",
        )
        typer.echo(f"wrote {q}")
    if run_dir is not None:
        (run_dir / "errors.json").write_text(json.dumps({k: v.as_dict() for k, v in rows.items()}, indent=2))
    _finish_report(run_dir)


@app.command()
def buckets(
    request: Annotated[list[str] | None, typer.Option(help="requested WxH; repeatable")] = None,
    area: Annotated[int, typer.Option(min=64, help="pixel budget of a bucket")] = 256 * 256,
    step: Annotated[int, typer.Option(min=8, help="bucket sides are multiples of this")] = 32,
    max_aspect: Annotated[float, typer.Option(min=1.0)] = 4.0,
    policy: Annotated[Policy, typer.Option()] = Policy.pad,
    k: Annotated[int, typer.Option(min=1, help="buckets to choose by measured cost")] = 4,
    profile: Annotated[bool, typer.Option(help="time the embedded UNet at each bucket")] = True,
    repeats: Annotated[int, typer.Option(min=1)] = 3,
    plot: Annotated[Path | None, typer.Option(help="cost vs tokens plot PNG")] = None,
    report: Report = None,
) -> None:
    """Bucket set, assignments with explanations, measured profile, chosen buckets and the cost plot.

    Example: tilewise buckets --request 800x1200 --request 2048x512 --policy pad --k 3 --plot cost.png
    """
    from .buckets import BucketPlanner, choose_buckets, profile_buckets

    requests = [_size(r) for r in (request or ["800x1200", "1200x800", "2048x512", "512x512"])]
    planner = BucketPlanner(area=area, step=step, max_aspect=max_aspect)
    typer.echo(
        f"{len(planner.buckets)} buckets under {area} px (step {step}): "
        + ", ".join(f"{w}x{h}" for w, h in planner.buckets[:12])
        + (" ..." if len(planner.buckets) > 12 else "")
    )
    scaled = []
    for w, h in requests:
        s = min(1.0, (area / (w * h)) ** 0.5)
        sw, sh = max(step, int(w * s / step) * step), max(step, int(h * s / step) * step)
        scaled.append((sw, sh))
        a = planner.assign(sw, sh, policy=policy.value)
        typer.echo(f"- {w}x{h} (as {sw}x{sh}) -> bucket {a.bucket[0]}x{a.bucket[1]}: {a.explain()}")
    if not profile:
        return
    import torch

    from .pipelines import load_pipeline

    loaded = load_pipeline(None)
    unet = loaded.pipe.unet
    emb = loaded.encode("", "")["prompt_embeds"]

    def step_fn(x):
        return unet(x, 500, encoder_hidden_states=emb.expand(len(x), -1, -1)).sample

    candidates = sorted(set(planner.buckets))
    prof = profile_buckets(step_fn, candidates, guidance=5.0, repeats=repeats, dtype=torch.float32)
    typer.echo(prof.table())
    choice = choose_buckets(scaled, prof, min(k, len(candidates)), policy=policy.value)
    typer.echo(choice.table())
    run_dir = _run_dir(report, {"command": "buckets", "requests": request, "area": area, "k": k})
    for q in [p for p in (plot, run_dir / "costs.png" if run_dir else None) if p is not None]:
        prof.plot(str(q))
        typer.echo(f"wrote {q}")
    if run_dir is not None:
        (run_dir / "costs.json").write_text(
            json.dumps([{"tokens": t.tokens, "seconds": t.median} for t in prof.timings], indent=2)
        )
    _finish_report(run_dir)


@app.command()
def report(run_dir: Annotated[Path, typer.Argument(help="a run folder written with --report")]) -> None:
    """Build the self-contained HTML report of a run folder (plan, pictures, errors, cost instrument).

    Example: tilewise report runs/wide
    """
    _finish_report(run_dir)


def main() -> None:
    """Entry point: one clear line per error (traceback with --debug); Ctrl-C leaves no partial file."""
    # diffusers imports transformers' image processors, which warn about torchvision on every start
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    try:
        app(standalone_mode=False)
    except KeyboardInterrupt:
        typer.echo("interrupted: no partial output was left", err=True)
        sys.exit(130)
    except SystemExit:
        raise
    except Exception as e:  # the CLI boundary: report, never hide
        import click

        if STATE["debug"]:
            raise
        if isinstance(e, click.exceptions.Abort):
            typer.echo("aborted", err=True)
            sys.exit(1)
        if isinstance(e, click.ClickException):
            e.show()
            sys.exit(e.exit_code)
        typer.echo(f"error: {e}", err=True)
        sys.exit(2 if isinstance(e, ValueError) else 1)


if __name__ == "__main__":
    main()
