"""Counted tables: what decode and encode dispatch at 1024 / 2048 / 4096 px on a GPU, by counting.

Every run is counted on fake tensors on the meta device (benchmarks/counting.py: nothing is allocated, the
same operators are dispatched as on a CPU or GPU; tests/test_counting.py checks fake-meta counts equal CPU
counts), so untiled runs of any size are counted too. Per VAE shape (SD, SDXL: 128, 256, 512, 512; Flux: 16
latent channels), task and size, in float16: the untiled forward, diffusers' enable_tiling at its default
tiles (config.sample_size), tilewise exact and fast planned for CUDA (devices.CUDA, host staging up to 64
GiB) at 4 GiB and 16 GiB budgets, and exact and fast with diffusers' counted peak as their budget (where no
plan of the mode fits in it: the smallest multiple of it, SMALLEST, that one does). Columns: kernel launches
(operators that write memory), per tile and without the statistics' own (GroupNorm moments, their merge, the
GroupNorm affine, finite checks), GFLOP and the ratio to untiled, device peak of live tensors, host<->device
bytes, modelled ms (devices.CUDA's time model applied to the counted FLOPs, launches and host<->device
bytes, with no copy overlapped: the same model for every row, untiled and diffusers' tiling included), and
the plan's own figures beside them: its launches, device peak and estimated time (the same constants, less
the side-stream copies it overlaps with compute).

    .venv/bin/python benchmarks/counts.py --out benchmarks/results_counts.md
    .venv/bin/python benchmarks/counts.py --kinds sd --sizes 1024 --tasks decode   # one table
    .venv/bin/python benchmarks/counts.py --kinds sd --sizes 4096 --tasks decode --modes exact --budgets 4GiB
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time

import torch
from counting import Counter, build_vae, count, fake

import tilewise as tw
from tilewise.vae.devices import CUDA

GIB = 1 << 30
MIB = 1 << 20
# Planned for devices.CUDA with a fixed host: what host staging may fill would otherwise be this machine's
# available memory at the moment, and a busy machine would plan disk staging (which fake tensors cannot
# write) where an idle one plans host staging; 64 GiB is half the host of a one-GPU cloud machine.
GPU = CUDA.replace(host_memory=64 * GIB)
SMALLEST = (1.25, 1.5, 2, 2.5, 3, 4, 6, 8)  # budgets tried, x diffusers' peak, where it fits no exact plan


@contextlib.contextmanager
def statistics_section(counter: Counter):
    """Launches inside the statistics' own code (GroupNorm moments and their merge, the GroupNorm affine,
    finite checks) counted apart, in counts.stats."""
    from tilewise.vae.run import executor, stats

    wrapped = [(stats.GroupStats, "add"), (stats.GroupStats, "_merge"), (executor.FiniteChecks, "add"),
               (executor.FiniteChecks, "finish"), (executor.ExecContext, "group_affine")]
    saved = [(cls, name, getattr(cls, name)) for cls, name in wrapped]

    def tag(fn):
        def run(*args, **kwargs):
            outer, counter.in_stats = counter.in_stats, True
            try:
                return fn(*args, **kwargs)
            finally:
                counter.in_stats = outer
        return run

    for cls, name, fn in saved:
        setattr(cls, name, tag(fn))
    try:
        yield
    finally:
        for cls, name, fn in saved:
            setattr(cls, name, fn)


def measure(run, *args):
    """Counts of run(*args) on the meta device, with the statistics' launches apart."""
    with count("meta") as c, statistics_section(c.counter):
        run(*args)
    return c


def rows_for(kind: str, task: str, px: int, budgets: list[int], modes=("exact", "fast")) -> list[dict]:
    """Every variant of one (VAE, task, size) in `modes`, counted."""
    with fake():
        vae = build_vae(kind, torch.float16, "meta")
        c = vae.config.latent_channels
        t = torch.randn(1, c, px // 8, px // 8) if task == "decode" else torch.randn(1, 3, px, px)
        t = t.to("meta", torch.float16)

        def forward(model):
            return model.decode(t).sample if task == "decode" else model.encode(t).latent_dist.mean

        rows = []
        untiled = measure(forward, vae)
        rows.append(dict(variant="untiled", counts=untiled, tiles=1))
        vae.enable_tiling()
        n = _diffusers_tiles(vae, task, px)
        diffusers = measure(forward, vae)
        vae.disable_tiling()
        rows.append(dict(variant=f"diffusers tiling ({vae.tile_sample_min_size} px)", counts=diffusers,
                         tiles=n))
        peak = diffusers.device_peak("meta")
        variants = [("exact", b, f"{b // GIB} GiB") for b in budgets]
        variants += [("exact", peak, "diffusers' peak")] + [("fast", b, f"{b // GIB} GiB") for b in budgets]
        variants += [("fast", peak, "diffusers' peak")]
        for mode, budget, label in [v for v in variants if v[0] in modes]:
            tv = tw.TiledVAE(vae, mode=mode, memory_budget=budget, progress=False, device_kind=GPU)
            try:
                plan = tv.plan(tuple(t.shape), kind=task)
            except ValueError as err:
                rows.append(dict(variant=f"tilewise {mode}, {label}", error=str(err)))
                if label != "diffusers' peak":
                    continue
                # the smallest multiple of diffusers' peak an exact plan fits in, counted instead
                for m in SMALLEST:
                    tv = tw.TiledVAE(vae, mode=mode, memory_budget=int(m * peak), progress=False,
                                     device_kind=GPU)
                    with contextlib.suppress(ValueError):
                        plan = tv.plan(tuple(t.shape), kind=task)
                        budget, label = int(m * peak), f"{m:g}x diffusers' peak"
                        break
                else:
                    continue
            got = measure(forward, tv)
            rows.append(dict(variant=f"tilewise {mode}, {label}", counts=got, plan=plan, budget=budget,
                             tiles=plan.grid[0] * plan.grid[1]))
        for r in rows:
            r.update(kind=kind, task=task, px=px, untiled=untiled)
        return rows


def _diffusers_tiles(vae, task: str, px: int) -> int:
    """Tiles diffusers' tiled decode / encode runs at its current tile size (1 below it)."""
    if px <= vae.tile_sample_min_size:
        return 1
    if task == "decode":
        step, side = int(vae.tile_latent_min_size * (1 - vae.tile_overlap_factor)), px // 8
    else:
        step, side = int(vae.tile_sample_min_size * (1 - vae.tile_overlap_factor)), px
    return len(range(0, side, step)) ** 2


def modelled_ms(c) -> float:
    """The time model over what a run dispatched (float16): FLOPs / throughput + launches x launch cost +
    host<->device bytes / link bandwidth, no copy overlapped."""
    return GPU.seconds(c.flops, c.launches, c.h2d + c.d2h, half=True) * 1e3


def table(rows: list[dict]) -> list[str]:
    head = ["VAE", "task", "px", "variant", "tiles", "launches", "of them statistics", "per tile (no stats)",
            "views", "GFLOP", "x untiled", "device peak MiB", "host<->device GiB", "modelled ms",
            "plan: launches / GFLOP / peak MiB / host<->device GiB / est. ms", "plan"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        head = f"| {r['kind']} | {r['task']} | {r['px']} | {r['variant']} |"
        if "error" in r:
            out.append(f"{head} | no plan: {r['error']} | | | | | | | | | | |")
            continue
        c, u = r["counts"], r["untiled"]
        per = (c.launches - c.stats) / r["tiles"]
        cells = [str(r["tiles"]), f"{c.launches:,}", f"{c.stats:,}", f"{per:,.0f}", f"{c.views:,}",
                 f"{c.flops / 1e9:,.0f}", f"{c.flops / u.flops:.3f}", f"{c.device_peak('meta') / MIB:,.0f}",
                 f"{(c.h2d + c.d2h) / GIB:.2f}", f"{modelled_ms(c):,.0f}"]
        p = r.get("plan")
        if p is None:
            cells += ["", ""]
        else:
            batch = f", batches of <= {p.tile_batch}" if p.tile_batch > 1 else ""
            how = "untiled run" if p.untiled else (f"tile {p.tile_size}, {p.staging}"
                                                   + (", bands" if p.band_bytes else "") + batch
                                                   + (f", {len(p.fast_cuts) + 1} pieces" if p.fast_cuts
                                                      else "")
                                                   + (", low pass in 1 tile" if p.low_tile else "")
                                                   + _sampled(p))
            cells += [f"{p.launches:,} / {p.flops / 1e9:,.0f} / {p.peak / MIB:,.0f} / "
                      f"{(p.h2d + p.d2h) / GIB:.2f} / {p.seconds * 1e3:,.0f}", how]
        out.append(head + " " + " | ".join(cells) + " |")
    return out


def _sampled(p) -> str:
    """How a fast plan's sampled tiles run: at most so many rows and columns of them, staged; and how many
    staged values (the sampled tiles' and the exact pass's) its readers recompute instead."""
    ch = p.choices
    return (f", sampled <= {ch.fast_most} rows / cols" if ch.fast_most else "") + (
        ", sampled tiles staged" if ch.staged_estimate else "") + (
        f", {len(ch.recompute) + len(ch.low_recompute)} values recomputed" if ch.recompute or ch.low_recompute
        else "")


def targets(rows: list[dict]) -> list[str]:
    """The issue's targets for the CUDA-shaped plans, checked on the counted rows (sizes >= 2048 px):
    exact FLOPs <= 1.03x untiled; exact launches per tile (statistics apart) <= 2x the untiled run's;
    exact and fast within diffusers' peak: launches <= half of diffusers' tiling with a device peak no
    larger; fast at the other budgets: launches <= half of diffusers'; counted device peak <= the budget;
    fast FLOPs <= 1.25x and host<->device <= 1 GiB; modelled time
    (`modelled_ms`) against diffusers' tiling's: fast within 4 GiB <= 0.6x, fast otherwise <= 1x, exact
    <= 2x; exact host<->device <= 1.1x the staging floor its plan prints (issue #31)."""
    out = ["| VAE | task | px | variant | target | counted | met |", "|---|---|---|---|---|---|---|"]

    def line(r, target, figure, ok):
        out.append(f"| {r['kind']} | {r['task']} | {r['px']} | {r['variant']} | {target} | {figure} | "
                   f"{'yes' if ok else '**no**'} |")

    for r in rows:
        if r["px"] < 2048 or "error" in r or "plan" not in r:
            continue
        c, u = r["counts"], r["untiled"]
        ratio, peak = c.flops / u.flops, c.device_peak("meta")
        if r["variant"].startswith("tilewise exact"):
            line(r, "FLOPs <= 1.03x untiled", f"{ratio:.3f}x", ratio <= 1.03)
            per, cap = (c.launches - c.stats) / r["tiles"], 2 * u.launches
            line(r, f"launches a tile (no stats) <= 2x untiled = {cap:,}", f"{per:,.0f}", per <= cap)
        else:
            line(r, "FLOPs <= 1.25x untiled", f"{ratio:.3f}x", ratio <= 1.25)
            moved = c.h2d + c.d2h
            line(r, "host<->device <= 1 GiB", f"{moved / GIB:,.2f} GiB", moved <= GIB)
        line(r, f"device peak <= budget {r['budget'] / MIB:,.0f} MiB", f"{peak / MIB:,.0f} MiB",
             peak <= r["budget"])
        d = next(q for q in rows if q["px"] == r["px"] and q["task"] == r["task"]
                 and q["variant"].startswith("diffusers"))["counts"]
        mine, theirs = modelled_ms(c), modelled_ms(d)
        cap = 0.6 if r["variant"] == "tilewise fast, 4 GiB" else 1.0 if r["variant"].startswith(
            "tilewise fast") else 2.0
        line(r, f"modelled ms <= {cap:g}x diffusers' tiling's {theirs:,.0f}",
             f"{mine:,.0f} ({mine / theirs:.2f}x)", mine <= cap * theirs)
        floor = r["plan"].staging_floor
        if floor:  # (exact plans whose staged values cannot all stay on the device)
            moved = c.h2d + c.d2h
            line(r, f"host<->device <= 1.1x the plan's staging floor {floor / GIB:,.2f} GiB",
                 f"{moved / GIB:,.2f} GiB ({moved / floor:.2f}x)", moved <= 1.1 * floor)
        if "diffusers' peak" not in r["variant"] and r["variant"].startswith("tilewise fast"):
            line(r, f"launches <= half of diffusers' {d.launches:,}", f"{c.launches:,} "
                    f"({c.launches / d.launches:.2f}x)", c.launches <= d.launches / 2)
        if "diffusers' peak" in r["variant"]:
            line(r, f"launches <= half of diffusers' {d.launches:,}, peak <= its "
                    f"{d.device_peak('meta') / MIB:,.0f} MiB",
                 f"{c.launches:,} ({c.launches / d.launches:.2f}x), {peak / MIB:,.0f} MiB",
                 c.launches <= d.launches / 2 and peak <= d.device_peak("meta"))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kinds", default="sd,sdxl,flux")
    ap.add_argument("--tasks", default="decode,encode")
    ap.add_argument("--sizes", default="1024,2048,4096")
    ap.add_argument("--budgets", default="4GiB,16GiB")
    ap.add_argument("--modes", default="exact,fast", help="the tilewise modes counted (exact, fast)")
    ap.add_argument("--out", default=None, help="write the markdown tables to this file")
    args = ap.parse_args()
    from tilewise.memory import parse_bytes

    budgets = [parse_bytes(b) for b in args.budgets.split(",")]
    lines = [f"Command: python benchmarks/counts.py {' '.join(sys.argv[1:])}", ""]
    for kind in args.kinds.split(","):
        rows = []
        for task in args.tasks.split(","):
            for px in (int(s) for s in args.sizes.split(",")):
                t0 = time.perf_counter()
                part = rows_for(kind, task, px, budgets, args.modes.split(","))
                rows += part
                print("\n".join(table(part)[2:]), f"({time.perf_counter() - t0:.0f} s)", flush=True)
        lines += [f"#### {kind.upper()}-shaped VAE, float16", ""] + table(rows) + [""]
        lines += [f"#### {kind.upper()}-shaped VAE: the issue's targets (2048 and 4096 px)", ""]
        lines += targets(rows) + [""]
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
