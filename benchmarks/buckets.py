"""Benchmark: a kohya-style fixed bucket grid vs buckets chosen by measured cost, on a small real UNet (CPU).

Everything is scaled down 4x per side from SDXL so the run takes a couple of minutes on one CPU core:
the kohya SDXL grid (area 1024^2, step 64, sides 256..2048) becomes area 256^2, step 16, sides 64..512;
latents are 1/8 of that (up to 32x32 = 1024 tokens). The UNet is a diffusers UNet2DConditionModel built
from a small config with seeded random weights (no downloads); one call = one denoising step with CFG.

Strategies, all on the same synthetic request mix (common aspects plus extreme ones, 1:5 .. 5:1):
  (a1) kohya grid, kohya's recipe: every request resized to the nearest-aspect bucket and centre-cropped;
  (a2) kohya grid, padding where a bucket holds the request, kohya's recipe otherwise;
  (b)  choose_buckets with the same k over a wider candidate set, policy "pad" (no content change);
  (b8) choose_buckets with k=8 (fewer compiled shapes).
For each: total cost predicted from the per-shape profile, total cost measured by executing every batch,
padding fraction, fraction of requested pixels cut, and the number of distinct compiled shapes.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/buckets.py --out benchmarks/results_buckets.md
"""

from __future__ import annotations

import argparse
import math
import platform
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from tilewise.buckets import BucketPlanner, batch_by_bucket, choose_buckets, grid_buckets, profile_buckets

AREA, STEP, MIN_SIDE, MAX_SIDE = 256 * 256, 16, 64, 512  # kohya SDXL grid / 4 per side
ASPECTS = [1, 4 / 3, 3 / 4, 3 / 2, 2 / 3, 16 / 9, 9 / 16]  # width / height, common
EXTREME = [1 / 5, 1 / 4, 1 / 3, 3, 4, 5]


def requests(n: int, seed: int) -> list[tuple[int, int]]:
    """Synthetic mix: 70% common aspects, 30% extreme; area 35-100% of the budget; sides multiples of 8."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        ar = rng.choice(EXTREME) if rng.random() < 0.3 else rng.choice(ASPECTS)
        area = AREA * rng.uniform(0.35, 1.0)
        w, h = math.sqrt(area * ar), math.sqrt(area / ar)
        out.append((max(8, int(w) // 8 * 8), max(8, int(h) // 8 * 8)))
    return out


def candidates(grid: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The grid plus every 32-aligned bucket up to 1.25x the area budget and aspect 6."""
    sides = range(MIN_SIDE, 3 * MAX_SIDE // 2 + 1, 32)
    extra = {(w, h) for w in sides for h in sides if w * h <= 1.25 * AREA and max(w, h) / min(w, h) <= 6}
    return sorted(set(grid) | extra)


def tiny_unet() -> tuple[torch.nn.Module, torch.Tensor]:
    """A small real UNet2DConditionModel (seeded random weights) and a text embedding."""
    from diffusers import UNet2DConditionModel

    torch.manual_seed(0)
    unet = UNet2DConditionModel(
        sample_size=32,
        in_channels=4,
        out_channels=4,
        block_out_channels=(32, 64),
        layers_per_block=1,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        cross_attention_dim=32,
        attention_head_dim=8,
        norm_num_groups=8,
    ).eval()
    return unet, torch.randn(1, 8, 32, generator=torch.Generator().manual_seed(1))


def assign_all(planner: BucketPlanner, reqs, recipe: str):
    """Assignments under a recipe: 'resize' (kohya), 'pad-else-resize', or 'pad'."""
    out = []
    for w, h in reqs:
        if recipe in ("pad", "pad-else-resize"):
            try:
                out.append(planner.assign(w, h, "pad"))
                continue
            except ValueError:
                if recipe == "pad":
                    raise
        out.append(planner.assign(w, h, "resize", max_aspect_error=math.inf))
    return out


def execute(plans, step, guidance: float, rounds: int, statistic: str) -> list[float]:
    """Run one CFG step per batch of every plan, rounds interleaved across plans (so background load hits
    all plans alike); per plan, the sum over batches of the per-batch median/min."""
    cfg = 2 if guidance > 1 else 1
    pick = min if statistic == "min" else statistics.median
    g = torch.Generator().manual_seed(2)
    inputs = [
        [torch.randn(len(b) * cfg, 4, b.bucket[1] // 8, b.bucket[0] // 8, generator=g) for b in p]
        for p in plans
    ]
    times = [[[] for _ in p] for p in plans]
    with torch.inference_mode():
        for _ in range(rounds):
            for p_i, xs in enumerate(inputs):
                for b_i, x in enumerate(xs):
                    t0 = time.perf_counter()
                    step(x)
                    times[p_i][b_i].append(time.perf_counter() - t0)
    return [sum(pick(t) for t in per_plan) for per_plan in times]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=96, help="number of synthetic requests (default 96)")
    ap.add_argument("--batch-size", type=int, default=2, help="requests per batch (default 2)")
    ap.add_argument(
        "--guidance", type=float, default=5.0, help="CFG scale; > 1 doubles the batch (default 5)"
    )
    ap.add_argument("--repeats", type=int, default=5, help="timed calls per shape and per batch (default 5)")
    ap.add_argument(
        "--statistic",
        choices=["median", "min"],
        default="min",
        help="per-shape cost statistic; min resists other jobs' load on a shared CPU (default min)",
    )
    ap.add_argument("--seed", type=int, default=0, help="request-mix seed (default 0)")
    ap.add_argument("--out", type=Path, default=None, help="write the markdown results here")
    ap.add_argument("--png", type=Path, default=None, help="write the cost-vs-tokens plot here")
    args = ap.parse_args()
    torch.set_num_threads(1)

    unet, emb = tiny_unet()

    def step(x):
        return unet(x, 500, encoder_hidden_states=emb.expand(len(x), -1, -1)).sample

    reqs = requests(args.requests, args.seed)
    grid = grid_buckets(AREA, STEP, MIN_SIDE, MAX_SIDE, 4.0)
    cands = candidates(grid)
    t0 = time.perf_counter()
    prof = profile_buckets(
        step, cands, batch_size=args.batch_size, guidance=args.guidance, repeats=args.repeats, warmup=1
    )
    t_prof = time.perf_counter() - t0
    costs = prof.costs(args.statistic)
    k = len(grid)
    kohya = BucketPlanner(buckets=grid, step=STEP, costs={b: costs[b] for b in grid}, max_aspect=6)
    choice = choose_buckets(reqs, costs, k, "pad", batch_size=args.batch_size)
    choice8 = choose_buckets(reqs, costs, 8, "pad", batch_size=args.batch_size)
    rows = []
    for name, planner, recipe in [
        (f"(a1) kohya grid, resize+crop, k={k}", kohya, "resize"),
        (f"(a2) kohya grid, pad else resize+crop, k={k}", kohya, "pad-else-resize"),
        (f"(b) choose_buckets pad, k={k}", choice.planner(step=STEP, max_aspect=6), "pad"),
        ("(b8) choose_buckets pad, k=8", choice8.planner(step=STEP, max_aspect=6), "pad"),
    ]:
        assigned = assign_all(planner, reqs, recipe)
        plan = batch_by_bucket(assigned, planner, args.batch_size, guidance=args.guidance)
        predicted = sum(args.batch_size * costs[b.bucket] for b in plan)  # short batches charged in full
        resized = sum(a.policy == "resize" for a in assigned)
        rows.append([name, predicted, None, plan, resized, len({a.bucket for a in assigned})])
    for row, measured in zip(
        rows, execute([r[3] for r in rows], step, args.guidance, args.repeats, args.statistic), strict=True
    ):
        row[2] = measured
    report(args, prof, t_prof, rows, choice, reqs, cands)
    if args.png:
        prof.plot(args.png, args.statistic)


def report(args, prof, t_prof, rows, choice, reqs, cands) -> None:
    """Print (and optionally write) the markdown results."""
    (c1, r1), (c2, r2) = prof.fit(1, args.statistic), prof.fit(2, args.statistic)
    ext = sum(max(w, h) / min(w, h) >= 3 for w, h in reqs)
    lines = [
        "## Resolution buckets: fixed kohya grid vs buckets chosen by measured cost",
        "",
        "Command: `"
        + " ".join(["OMP_NUM_THREADS=1", ".venv/bin/python", "benchmarks/buckets.py"] + sys.argv[1:])
        + "`",
        "",
        f"Machine: {platform.processor() or platform.machine()}, torch {torch.__version__}, 1 thread, CPU, "
        "shared with other jobs (timings are noisy; spreads are in the profile). "
        "Scale: SDXL sizes / 4 per side "
        f"(grid area 256^2, step 16, sides 64..512); tiny seeded UNet2DConditionModel; one CFG step "
        f"(guidance {args.guidance}) per batch of {args.batch_size}; fp32. "
        f"Costs are the {args.statistic} over "
        f"{args.repeats} timed calls in a row per shape after one warm-up call. "
        f"'predicted' sums the profiled costs that also drove the choice, "
        "a short batch charged as a full one (optimistic for the chosen set: it picks buckets that happened "
        "to time fast); 'measured' "
        "re-times every batch of every plan, short batches included, independently of the profile, with "
        "the rounds interleaved across strategies.",
        "",
        f"Requests: {len(reqs)} (seed {args.seed}), {ext} with aspect >= 3:1. "
        f"Profiled {len(cands)} candidate buckets x {args.repeats} repeats in {t_prof:.0f} s. "
        f"Least-squares fit of the per-call {args.statistic} vs latent tokens x: linear "
        f"{c1[0] * 1e3:.2f} + {c1[1] * 1e3:.4f} x ms (RMS {r1 * 1e3:.2f} ms); quadratic {c2[0] * 1e3:.2f} + "
        f"{c2[1] * 1e3:.4f} x + {c2[2] * 1e6:.3f}e-3 x^2 ms (RMS {r2 * 1e3:.2f} ms).",
        "",
        "| strategy | buckets used | compiled shapes | padding | pixels cut | resized | predicted s "
        "| measured s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, predicted, measured, plan, resized, used in rows:
        lines.append(
            f"| {name} | {used} | {plan.num_shapes} | {plan.padding_fraction:.1%} | "
            f"{plan.cut_fraction:.1%} | {resized} | {predicted:.2f} | {measured:.2f} |"
        )
    lines += [
        "",
        f"choose_buckets (k={len(choice.buckets)}, {choice.method}): logical work beside measured cost",
        "",
        choice.table(),
        "",
    ]
    text = "\n".join(lines)
    print(text)
    if args.out:
        from tilewise.atomic import atomic_path

        with atomic_path(args.out) as tmp, open(tmp, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
