"""Benchmark tiled diffusion against the untiled pipeline at the same output size (CPU, small random UNet).

For each method and overlap (0, 1/8 and 1/4 of the tile): UNet calls and tile evaluations per step, the ideal
cost ratio (sum of tile areas / image area), the measured evaluated-positions ratio (from a forward hook
on the real UNet), and the wall-time ratio against the untiled pipeline; then batch_size 1 vs 4 throughput.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/diffusion.py --out benchmarks/results_diffusion.md
    .venv/bin/python benchmarks/diffusion.py --height 32 --width 128 --tile 16 --steps 3 --repeats 3
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import torch
from diffusers import AutoencoderKL, DDIMScheduler, StableDiffusionPipeline, UNet2DConditionModel

from tilewise.diffusion import TiledDenoiser


def small_unet(seed: int = 0) -> UNet2DConditionModel:
    """An SD-shaped UNet, scaled down: 3 levels (64, 128, 128), cross-attention in the lower two."""
    torch.manual_seed(seed)
    return UNet2DConditionModel(
        block_out_channels=(64, 128, 128), layers_per_block=1, in_channels=4, out_channels=4, sample_size=32,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
        cross_attention_dim=64, attention_head_dim=8, norm_num_groups=32).eval()


def tiny_vae() -> AutoencoderKL:
    torch.manual_seed(1)
    return AutoencoderKL(block_out_channels=(8, 8, 8, 8), down_block_types=("DownEncoderBlock2D",) * 4,
                         up_block_types=("UpDecoderBlock2D",) * 4, latent_channels=4, norm_num_groups=4,
                         layers_per_block=1).eval()


class Counter:
    """Forward pre-hook on the real UNet: calls and evaluated positions (batch rows x h x w)."""

    def __init__(self, unet: torch.nn.Module):
        self.calls = self.positions = 0
        unet.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs):
        x = args[0] if args else kwargs["sample"]
        self.calls += 1
        self.positions += x.shape[0] * x.shape[-2] * x.shape[-1]

    def reset(self) -> None:
        self.calls = self.positions = 0


def run(pipe, args, embeds) -> float:
    """Wall seconds of one pipeline call (latents out, no decode)."""
    pe, ne = embeds
    t0 = time.perf_counter()
    with torch.no_grad():
        pipe(prompt_embeds=pe, negative_prompt_embeds=ne, height=args.height * 8, width=args.width * 8,
             num_inference_steps=args.steps, guidance_scale=5.0, output_type="latent",
             generator=torch.Generator().manual_seed(0))
    return time.perf_counter() - t0


def timed(pipe, args, embeds, counter) -> tuple[float, int, int]:
    """Median wall time over repeats, and the UNet calls / positions of one run."""
    times = []
    for _ in range(args.repeats):
        counter.reset()
        times.append(run(pipe, args, embeds))
    return statistics.median(times), counter.calls, counter.positions


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--height", type=int, default=32, help="latent height (pixels / 8)")
    p.add_argument("--width", type=int, default=128, help="latent width (pixels / 8)")
    p.add_argument("--tile", type=int, default=16, help="tile size in latent pixels")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=None, help="write a markdown table here")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    unet = small_unet()
    counter = Counter(unet)
    pipe = StableDiffusionPipeline(vae=tiny_vae(), text_encoder=None, tokenizer=None, unet=unet,
                                   scheduler=DDIMScheduler(clip_sample=False, steps_offset=1),
                                   safety_checker=None, feature_extractor=None, requires_safety_checker=False)
    pipe.set_progress_bar_config(disable=True)
    g = torch.Generator().manual_seed(2)
    embeds = torch.randn(1, 16, 64, generator=g), torch.randn(1, 16, 64, generator=g)
    H, W, T, S = args.height, args.width, args.tile, args.steps
    run(pipe, args, embeds)  # warm-up
    base_t, base_calls, base_pos = timed(pipe, args, embeds, counter)
    rows = [("untiled", "-", 1, base_calls / S, "1.00", f"{base_pos / base_pos:.2f}", base_t / S, 1.0)]
    configs = [(m, o, 1) for m in ("multidiffusion", "mixture") for o in (0, T // 8, T // 4)]
    configs += [("spot", 0, 1), ("halo", 0, 1), ("mixture", T // 4, 4)]
    for method, overlap, bs in configs:
        td = TiledDenoiser(unet, tile_size=T, overlap=overlap, method=method, batch_size=bs, halo=T // 8)
        pipe.unet = td
        t, calls, pos = timed(pipe, args, embeds, counter)
        # ideal: positions the plans read, averaged over the steps run (spot's partition moves per step)
        plans = [td.plan(H, W, ts) for ts in pipe.scheduler.timesteps]
        ideal = statistics.mean(sum((q.read[1] - q.read[0]) * (q.read[3] - q.read[2]) for q in pl)
                                for pl in plans) / (H * W)
        plain = f"{overlap} ({overlap / T:.3g}T)"
        label = {"spot": "0, shifted", "halo": f"halo {T // 8}"}.get(method, plain)
        rows.append((method, label, bs, calls / S, f"{ideal:.2f}", f"{pos / base_pos:.2f}", t / S,
                     t / base_t))
        pipe.unet = unet
    lines = [
        f"latent {H}x{W} (image {H * 8}x{W * 8} px), tile {T}, {S} DDIM steps, CFG (2 rows per call), "
        f"UNet blocks (64, 128, 128) random weights, torch {torch.__version__}, {args.threads} thread(s), "
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, median of {args.repeats}",
        "",
        "| method | overlap | batch | UNet calls / step | ideal ratio (sum tile area / image) | "
        "measured positions ratio | s / step | time ratio vs untiled |",
        "|---|---|---|---|---|---|---|---|",
    ]
    lines += [f"| {m} | {o} | {b} | {c:.0f} | {i} | {q} | {t:.3f} | {r:.2f} |"
              for m, o, b, c, i, q, t, r in rows]
    bs1 = next(r for r in rows if r[0] == "mixture" and r[2] == 1 and r[1].startswith(str(T // 4)))
    bs4, tiles = rows[-1], bs1[3]  # batch 1: one tile per call
    lines += ["", f"batch_size 1 vs 4 (mixture, overlap {T // 4}, {tiles:.0f} tiles / step): "
              f"{tiles / bs1[6]:.1f} vs {tiles / bs4[6]:.1f} tiles / s (x{bs1[6] / bs4[6]:.2f} throughput)",
              "", "command: `" + " ".join(["OMP_NUM_THREADS=" + os.environ.get("OMP_NUM_THREADS", ""),
                                            ".venv/bin/python", *sys.argv]) + "`"]
    text = "\n".join(lines)
    print(text)
    if args.out:
        from tilewise.atomic import atomic_path

        with atomic_path(args.out) as tmp, open(tmp, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
