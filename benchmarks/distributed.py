"""Benchmark tile-parallel denoising on 1, 2 and 3 ranks: per-rank peak memory, time, tiles, agreement.

Each rank is a fresh process (tilewise.distributed.spawn, start method "spawn", gloo on CPU or NCCL with one
GPU per rank) that builds the same small SD-shaped pipeline, warms up, then runs `--steps` DDIM steps
with CFG through TiledDenoiser(process_group="default"). Per rank: resident set after building
(model weights, libraries), peak resident-set growth during the timed run (VmHWM reset via clear_refs;
CUDA: max_memory_allocated growth), wall time, UNet tile evaluations; and the max abs difference of the
final latents against rank 0 and against the 1-rank run. On a 2-core machine no speed-up is expected:
the figures are memory per rank and agreement.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/distributed.py --out benchmarks/results_distributed.md
    .venv/bin/python benchmarks/distributed.py --ranks 1 2 --backend nccl --device cuda   # one GPU per rank

`--stage vae`: exact TiledVAE(process_group="default") decode of an SD-architecture VAE per rank: staged
bytes held per rank (bands of every full-size value plus halo rows), peak RSS growth, time, and the max
abs difference of the image against rank 0 and the 1-rank run.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/distributed.py --stage vae --height 48 --width 48 \
        --tile 16 --repeats 1 --out benchmarks/results_distributed_vae.md
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import torch

from tilewise import distributed as td
from tilewise.memory import MemoryMeter, current_rss, format_bytes, peak_rss


def build_pipe(device: str):
    """An SD-shaped UNet scaled down (64, 128, 128; random weights) in a StableDiffusionPipeline."""
    from diffusers import AutoencoderKL, DDIMScheduler, StableDiffusionPipeline, UNet2DConditionModel

    torch.manual_seed(0)
    unet = UNet2DConditionModel(
        block_out_channels=(64, 128, 128), layers_per_block=1, in_channels=4, out_channels=4, sample_size=32,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
        cross_attention_dim=64, attention_head_dim=8, norm_num_groups=32).eval()
    torch.manual_seed(1)
    vae = AutoencoderKL(block_out_channels=(8, 8, 8, 8), down_block_types=("DownEncoderBlock2D",) * 4,
                        up_block_types=("UpDecoderBlock2D",) * 4, latent_channels=4, norm_num_groups=4,
                        layers_per_block=1).eval()
    pipe = StableDiffusionPipeline(vae=vae, text_encoder=None, tokenizer=None, unet=unet,
                                   scheduler=DDIMScheduler(clip_sample=False, steps_offset=1),
                                   safety_checker=None, feature_extractor=None, requires_safety_checker=False)
    pipe.set_progress_bar_config(disable=True)
    return pipe.to(device)


def denoise_rank(rank: int, world: int, cfg: dict) -> dict:
    """One rank: build, warm up (1 step), then the timed, memory-metered run; figures and final latents."""
    from tilewise.diffusion import TiledDenoiser

    device = f"cuda:{torch.cuda.current_device()}" if cfg["device"] == "cuda" else "cpu"
    pipe = build_pipe(device)
    tiles = {"n": 0}

    def count(module, args, kwargs):
        tiles["n"] += (args[0] if args else kwargs["sample"]).shape[0]

    pipe.unet.register_forward_pre_hook(count, with_kwargs=True)
    pipe.unet = TiledDenoiser(pipe.unet, tile_size=cfg["tile"], overlap=cfg["overlap"], method=cfg["method"],
                              batch_size=cfg["batch"], process_group="default")
    g = torch.Generator().manual_seed(2)
    pe, ne = (torch.randn(1, 16, 64, generator=g).to(device) for _ in range(2))

    def run(steps: int) -> torch.Tensor:
        with torch.no_grad():
            return pipe(prompt_embeds=pe, negative_prompt_embeds=ne, height=cfg["height"] * 8,
                        width=cfg["width"] * 8, num_inference_steps=steps, guidance_scale=5.0,
                        output_type="latent", generator=torch.Generator().manual_seed(0)).images

    run(1)
    built = current_rss()
    tiles["n"] = 0
    td.barrier(td.resolve_group("default"))
    walls, cpus = [], []
    with MemoryMeter(device if cfg["device"] == "cuda" else None) as meter:
        for _ in range(cfg["repeats"]):
            t0, c0 = time.perf_counter(), time.process_time()
            latents = run(cfg["steps"])
            walls.append(time.perf_counter() - t0)
            cpus.append(time.process_time() - c0)
    seconds, cpu = statistics.median(walls), statistics.median(cpus)
    tiles["n"] //= cfg["repeats"]
    peak = torch.cuda.max_memory_allocated(device) if cfg["device"] == "cuda" else peak_rss() or 0
    B, C, H, W = latents.shape
    fused = (2 * B * C * H * W + H * W) * 8  # float64 value (CFG rows) + weight buffers all-reduced per call
    return {"rss_built": built, "peak_growth": meter.peak_bytes, "peak": peak, "method": meter.method,
            "seconds": seconds, "cpu": cpu, "tile_rows": tiles["n"], "fused_bytes": fused,
            "latents": latents.cpu()}


def build_vae(device: str):
    """SD-architecture AutoencoderKL (128, 256, 512, 512; layers_per_block 2; seeded random weights)."""
    from diffusers import AutoencoderKL

    torch.manual_seed(0)
    return AutoencoderKL(block_out_channels=(128, 256, 512, 512), layers_per_block=2, latent_channels=4,
                         down_block_types=("DownEncoderBlock2D",) * 4,
                         up_block_types=("UpDecoderBlock2D",) * 4).eval().to(device)


def vae_rank(rank: int, world: int, cfg: dict) -> dict:
    """One rank: exact TiledVAE decode of a seeded latent with process_group="default", memory-metered."""
    from tilewise.vae import TiledVAE

    device = f"cuda:{torch.cuda.current_device()}" if cfg["device"] == "cuda" else "cpu"
    vae = build_vae(device)
    tv = TiledVAE(vae, tile_size=cfg["tile"], staging=cfg["staging"], progress=False, process_group="default")
    z = torch.randn(1, 4, cfg["height"], cfg["width"], generator=torch.Generator().manual_seed(0)).to(device)
    built = current_rss()
    td.barrier(td.resolve_group("default"))
    walls, cpus = [], []
    with torch.no_grad(), MemoryMeter(device if cfg["device"] == "cuda" else None) as meter:
        for _ in range(cfg["repeats"]):
            t0, c0 = time.perf_counter(), time.process_time()
            image = tv.decode(z).sample
            walls.append(time.perf_counter() - t0)
            cpus.append(time.process_time() - c0)
    peak = torch.cuda.max_memory_allocated(device) if cfg["device"] == "cuda" else peak_rss() or 0
    return {"rss_built": built, "peak_growth": meter.peak_bytes, "peak": peak, "method": meter.method,
            "seconds": statistics.median(walls), "cpu": statistics.median(cpus),
            "staged": tv.last_staged_peak, "latents": image.cpu()}


STAGES = {"denoise": denoise_rank, "vae": vae_rank}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stage", choices=sorted(STAGES), default="denoise")
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--height", type=int, default=32, help="latent height (pixels / 8)")
    p.add_argument("--width", type=int, default=96, help="latent width (pixels / 8)")
    p.add_argument("--tile", type=int, default=16)
    p.add_argument("--overlap", type=int, default=4)
    p.add_argument("--method", default="mixture")
    p.add_argument("--batch", type=int, default=1, help="tiles per UNet call")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3, help="timed runs per rank (median)")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    p.add_argument("--staging", choices=("device", "host", "disk"), default="host", help="VAE stage only")
    p.add_argument("--backend", choices=td.BACKENDS, default="gloo")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--out", default=None, help="write a markdown table here")
    args = p.parse_args()
    cfg = {k: getattr(args, k) for k in ("height", "width", "tile", "overlap", "method", "batch", "steps",
                                           "device", "repeats", "staging")}
    results = {}
    for world in args.ranks:
        t0 = time.perf_counter()
        results[world] = td.spawn(STAGES[args.stage], world, args=(cfg,), backend=args.backend,
                                  threads=args.threads, timeout=600, limit=3600)
        print(f"{world} rank(s): {time.perf_counter() - t0:.1f} s with start-up", file=sys.stderr)
    text = report(args, results) if args.stage == "denoise" else report_vae(args, results)
    print(text)
    if args.out:
        from tilewise.atomic import atomic_path

        with atomic_path(args.out) as tmp, open(tmp, "w") as f:
            f.write(text + "\n")


def report(args, results: dict) -> str:
    """Markdown: one row per rank of each run."""
    one = results[min(results)][0]
    lines = [
        f"stage {args.stage}: latent {args.height}x{args.width} "
        f"(image {args.height * 8}x{args.width * 8} px), {args.method}, tile {args.tile}, "
        f"overlap {args.overlap}, batch {args.batch}, {args.steps} DDIM steps, "
        f"CFG; UNet (64, 128, 128) random weights; backend {args.backend} on {args.device}, {args.threads} "
        f"thread(s) per rank; torch {torch.__version__}, {platform.machine()}, {os.cpu_count()} cores",
        "",
        "| ranks | rank | UNet tile rows | wall s | CPU s | RSS after build | peak in run | "
        f"peak growth in run | all-reduced buffer | max abs diff vs rank 0 | vs {min(results)} rank(s) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for world, ranks in results.items():
        for r, res in enumerate(ranks):
            d0, d1 = _diffs(res, ranks[0], one)
            lines.append(f"| {world} | {r} | {res['tile_rows']} | {res['seconds']:.2f} | {res['cpu']:.2f} | "
                         f"{format_bytes(res['rss_built'])} | {format_bytes(res['peak'])} | "
                         f"{format_bytes(res['peak_growth'])} | {format_bytes(res['fused_bytes'])} | "
                         f"{d0:.1e} | {d1:.1e} |")
    method = results[min(results)][0]["method"]
    lines += ["", f"memory: {method}; tile rows = tiles x CFG rows through the UNet per run; wall and CPU "
              f"seconds: median of {args.repeats} runs (CPU = this rank's process time)",
              "", _command()]
    return "\n".join(lines)


def report_vae(args, results: dict) -> str:
    """Markdown: one row per rank of each VAE run."""
    one = results[min(results)][0]
    lines = [
        f"stage vae: exact TiledVAE decode of a {args.height}x{args.width} latent (image {args.height * 8}x"
        f"{args.width * 8} px), tile {args.tile}, staging {args.staging}; SD-architecture AutoencoderKL "
        f"(128, 256, 512, 512) random weights, fp32; backend {args.backend} on {args.device}, {args.threads} "
        f"thread(s) per rank; torch {torch.__version__}, {platform.machine()}, {os.cpu_count()} cores",
        "",
        "| ranks | rank | staged bytes held | x 1 rank | wall s | CPU s | RSS after build | "
        f"peak growth in run | x 1 rank | max abs diff vs rank 0 | vs {min(results)} rank(s) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for world, ranks in results.items():
        for r, res in enumerate(ranks):
            d0, d1 = _diffs(res, ranks[0], one)
            staged, growth = res["staged"] / one["staged"], res["peak_growth"] / one["peak_growth"]
            lines.append(f"| {world} | {r} | {format_bytes(res['staged'])} | {staged:.2f} | "
                         f"{res['seconds']:.2f} | {res['cpu']:.2f} | {format_bytes(res['rss_built'])} | "
                         f"{format_bytes(res['peak_growth'])} | {growth:.2f} | {d0:.1e} | {d1:.1e} |")
    lines += ["", f"memory: {one['method']}; staged bytes = the most full-size-value bytes (bands) the rank "
              f"held at once; wall and CPU seconds: median of {args.repeats} runs",
              "", _command()]
    return "\n".join(lines)


def _command() -> str:
    """The line that reproduces this run."""
    env = "OMP_NUM_THREADS=" + os.environ.get("OMP_NUM_THREADS", "")
    return "command: `" + " ".join([env, ".venv/bin/python", *sys.argv]) + "`"


def _diffs(res: dict, rank0: dict, one: dict) -> tuple[float, float]:
    """Max abs difference of a rank's result against rank 0 of its run and against the 1-rank run."""
    return ((res["latents"] - rank0["latents"]).abs().max().item(),
            (res["latents"] - one["latents"]).abs().max().item())


if __name__ == "__main__":
    main()
