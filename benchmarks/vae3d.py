"""Benchmark: exact tiled decode / encode of a 3-D causal VAE against untiled and diffusers' enable_tiling.

--family: the seeded VAEs of `benchmarks/vae3d_models.py` (Wan, Qwen-Image, LTX-Video, LTX-2, HunyuanVideo
1.0 / 1.5, Mochi, Cosmos, Magvit, CogVideoX, SVD's temporal decoder, KVAE video, Kandinsky 6 SR,
Allegro; fp32, widths scaled by --base-dim).
Every variant runs in its own subprocess (fresh peak RSS); errors are against the untiled output.
Variants:

- untiled: vae.decode / vae.encode;
- diffusers: vae.enable_tiling() with tiles of the same size in pixels (stride 3/4 of a tile in whole
  latent px, blended; in time the family's defaults: `vae3d_models.own_tiling`);
- tilewise: TiledVAE(vae, tile_size=--tile).decode / .encode (the plan picks the order: tile-major), or
  with --budget B: TiledVAE(vae, memory_budget=B) (the plan picks the tile);
- tilewise-sink-frames: decode_to a float32 .npy per frame (frames in order: frame-major run, streamed);
- tilewise-sink-tiles: decode_to a float32 (T, H, W, C) .npy stack (random access: tile-major, streamed);
- tilewise-disk: as tilewise with staging="disk" (every step's staged values in files in the run's temporary
  folder, read back box by box: not in memory; the plan column adds the plan's disk bytes).

--big runs a second size without the untiled variant (memory only; the untiled figure there is its
measured growth at the first size scaled by the pixel count, marked as a projection). --budget-fraction F
gives tilewise there a memory_budget of F x the untiled peak projected there (the smaller of the RSS
growth and, with --live, the live tensor peak): F = 0.25 makes the untiled decode need at least 4x the
budget. --live also measures the live tensor peak (tilewise.memory.measure_live_peak: the storages alive at
once, the GPU-relevant figure) of untiled and tilewise, each in a run of its own (the tracking slows it).

    python benchmarks/vae3d.py --latent 32 --frames 3 --tile 16 --big 64 --out benchmarks/results_vae3d.md
    python benchmarks/vae3d.py --family ltx --latent 8 --frames 3 --tile 4 --big 16 --budget 400MiB
    python benchmarks/vae3d.py --family hunyuan --latent 16 --frames 3 --tile 8 --big 32 --tasks decode \
        --variants untiled,diffusers,tilewise --budget-fraction 0.25 --live

The timed runs (both tasks at --latent) come first, the memory-only ones (--big) after them.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from vae import errors
from vae3d_models import (
    FAMILIES,
    NO_OWN_TILING,
    build_vae,
    call,
    make_input,
    own_tiling,
    plan_shape,
    video_frames,
)

VARIANTS = ("untiled", "diffusers", "tilewise", "tilewise-sink-frames", "tilewise-sink-tiles",
            "tilewise-disk")


def worker(args) -> None:
    """Run one variant once; write its output (.npy) and figures (.json). With --live: the live tensor
    peak (tilewise.memory.measure_live_peak) instead of the timed run's figures."""
    import numpy as np
    import torch

    import tilewise as tw
    from tilewise.memory import current_rss, measure_live_peak, peak_rss, reset_peak_rss

    torch.set_num_threads(args.threads)
    vae = build_vae(args.family, args.base_dim)
    x = make_input(args.family, args.task, args.size, args.frames)
    v = args.variant
    out = {"variant": v}
    if args.family == "hunyuan" and v == "untiled":  # one pass (its stock decode goes framewise past 4
        vae.use_framewise_decoding = vae.use_framewise_encoding = False  # latent frames): what tilewise is
    if v == "diffusers":  # spatial tiles; time: the family's own defaults
        sc = FAMILIES[args.family][3]
        own_tiling(vae, args.family, args.tile, (video_frames(args.family, args.frames), sc * args.size))
    model = vae
    if v.startswith("tilewise"):
        size = dict(memory_budget=args.budget) if args.budget else dict(tile_size=args.tile)
        if v == "tilewise-disk":  # staged values in files beside the run's results
            size.update(staging="disk", stage_dir=os.path.dirname(args.result))
        model = tw.TiledVAE(vae, progress=False, **size)
        sink = v.startswith("tilewise-sink")  # what decode_to plans: streamed, frames in order or not
        plan = model.plan(plan_shape(args.family, args.task, x), args.task, streamed=sink,
                          sequential=v.endswith("frames"))
        out.update(plan_peak=plan.peak, macs=plan.macs, macs_untiled=plan.macs_untiled, order=plan.order,
                   tile=plan.tile_size, disk_bytes=plan.disk_bytes)
        if args.budget:
            out["budget"] = tw.parse_bytes(args.budget)

    def run():
        with torch.no_grad():
            if v.startswith("tilewise-sink"):
                with tw.open_video_sink(path, t, h, w, c, bits=32) as sink:
                    model.decode_to(x, sink)
                return None
            return call(model, args.family, args.task, x)

    if v.startswith("tilewise-sink"):
        _, c, t, h, w = plan.output_shape
        path = args.result + ("-{:03d}.npy" if v.endswith("frames") else "-stack.npy")
    if args.live:
        _, out["live_peak"] = measure_live_peak(run)
        with open(args.result + ".json", "w") as f:
            json.dump(out, f)
        return
    base = current_rss()
    reset_peak_rss()
    t0 = time.perf_counter()
    y = run()
    dt = time.perf_counter() - t0
    out.update(seconds=dt, rss_growth=(peak_rss() or current_rss()) - base)
    if v.startswith("tilewise-sink"):  # (T, H, W, C) frames back to (1, C, T, H, W)
        frames = [np.load(path.format(i)) for i in range(t)] if v.endswith("frames") else np.load(path)
        y = np.stack(frames).transpose(3, 0, 1, 2)[None]
    np.save(args.result + ".npy", y if isinstance(y, np.ndarray) else y.float().cpu().numpy())
    with open(args.result + ".json", "w") as f:
        json.dump(out, f)


def run_variant(args, variant: str, task: str, size: int, tmp: str, budget: str | None = None,
                live: bool = False) -> dict:
    """One variant in a fresh subprocess (tilewise within `budget` where given, else --budget)."""
    res = os.path.join(tmp, f"{task}-{size}-{variant}" + ("-live" if live else ""))
    cmd = [sys.executable, __file__, "--worker", "--variant", variant, "--task", task, "--size", str(size),
           "--frames", str(args.frames), "--tile", str(args.tile), "--threads", str(args.threads),
           "--base-dim", str(args.base_dim), "--family", args.family, "--result", res]
    budget = budget or args.budget
    if budget:
        cmd += ["--budget", budget]
    if live:
        cmd += ["--live"]
    subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": str(args.threads)})
    with open(res + ".json") as f:
        out = json.load(f)
    out["path"] = res + ".npy"
    return out


def table(rows: list[dict]) -> list[str]:
    lines = ["| task | size | variant | order | time s | x untiled | budget MiB | peak RSS growth MiB "
             "| plan peak MiB | live peak MiB | conv MACs x untiled | max abs | mean abs |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def mib(r, key):
        return f"{r[key] / 2**20:.0f}" if r.get(key) is not None else ""

    for r in rows:
        proj = " (projected)" if r.get("projected") else ""
        macs = f"{r['macs'] / r['macs_untiled']:.2f}" if "macs" in r else ""
        ratio = f"{r['ratio']:.2f}" if r.get("ratio") is not None else ""
        err = (f"{r['max_abs']:.3g} | {r['mean_abs']:.3g}" if "max_abs" in r else " | ")
        secs = "" if r.get("projected") else f"{r['seconds']:.1f}"
        live = mib(r, "live_peak") + (proj if r.get("live_peak") is not None else "")
        order = r.get("order", "") + (f", tile {r['tile']}" if "tile" in r else "")
        disk = f" (+{mib(r, 'disk_bytes')} disk)" if r.get("disk_bytes") else ""
        lines.append(f"| {r['task']} | {r['size']} | {r['variant']} | {order} | {secs} | {ratio} | "
                     f"{mib(r, 'budget')} | {mib(r, 'rss_growth')}{proj} | {mib(r, 'plan_peak')}{disk} | "
                     f"{live} | {macs} | {err} |")
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--latent", type=int, default=24, help="latent side of the size untiled fits (default 24)")
    p.add_argument("--big", type=int, default=0, help="latent side of the memory-only size (0 skips)")
    p.add_argument("--frames", type=int, default=5, help="latent frames (default 5: 17 video frames)")
    p.add_argument("--tile", type=int, default=8, help="tile side in latent px, both tilers (default 8)")
    p.add_argument("--family", choices=sorted(FAMILIES), default="wan", help="the VAE (default wan)")
    p.add_argument("--base-dim", type=int, default=32, help="VAE base width (Wan 2.1: 96; default 32)")
    p.add_argument("--budget", default=None, help="tilewise's memory_budget (the plan picks the tile; "
                   "default: none, tiles of --tile)")
    p.add_argument("--budget-fraction", type=float, default=0.0,
                   help="at --big: tilewise's memory_budget = this fraction of the untiled run's projected "
                   "peak there (its measure at --latent scaled by the pixel count; see --budget-basis); "
                   "0: --budget")
    p.add_argument("--budget-basis", choices=("smaller", "rss"), default="smaller",
                   help="the untiled peak --budget-fraction is a fraction of: the smaller of its projected "
                   "RSS growth and (with --live) live tensor peak (default), or the RSS growth")
    p.add_argument("--live", action="store_true", help="also the live tensor peak "
                   "(tilewise.memory.measure_live_peak) of untiled and tilewise, each in a separate run")
    p.add_argument("--threads", type=int, default=2, help="torch threads per variant (default 2)")
    p.add_argument("--tasks", default="decode,encode")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma list from {VARIANTS}")
    p.add_argument("--out", default=None, help="append the markdown table to this file")
    for hidden in ("--variant", "--task", "--result"):
        p.add_argument(hidden, help=argparse.SUPPRESS)
    p.add_argument("--size", type=int, help=argparse.SUPPRESS)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    import numpy as np

    variants = [v for v in args.variants.split(",") if v]
    if args.family in NO_OWN_TILING and "diffusers" in variants:
        variants.remove("diffusers")
        print(f"{FAMILIES[args.family][0]} has no spatial tiling of its own in diffusers: no 'diffusers' row")
    rows, big_rows, notes = [], [], []
    tasks = args.tasks.split(",")
    load0, t0 = os.getloadavg(), time.strftime("%H:%M", time.gmtime())
    with tempfile.TemporaryDirectory() as tmp:
        # every timed run first (both tasks at the size untiled fits), then the memory-only size: a run
        # whose timed part was kept quiet gives ratios to trust; the live-peak runs (slowed by their
        # tracking) after the timed ones of their size
        untiled = {}
        for task in tasks:
            order = _order(task, variants)
            results = {v: run_variant(args, v, task, args.latent, tmp) for v in order}
            ref = np.load(results["untiled"]["path"])
            untiled[task] = results["untiled"]
            for v in order:
                if args.live and (v == "untiled" or v.startswith("tilewise")):
                    results[v]["live_peak"] = _live(args, v, task, args.latent, tmp, None)
                r = results[v]
                size = _size(args.family, task, args.latent, args.frames)
                r.update(errors(np.load(r["path"]), ref), task=task, size=size,
                         ratio=r["seconds"] / results["untiled"]["seconds"])
                rows.append(r)
                print(table([r])[-1], flush=True)
        for task in tasks if args.big else []:
            scale = (args.big / args.latent) ** 2
            size = _size(args.family, task, args.big, args.frames)
            projected = untiled[task]["rss_growth"] * scale
            live = untiled[task].get("live_peak")
            big_rows.append(dict(variant="untiled", task=task, size=size, rss_growth=projected,
                                 projected=True, live_peak=live * scale if live is not None else None))
            budget = None
            if args.budget_fraction:  # a fraction of the smaller projection (RSS growth, live tensors)
                need = _need(args, projected, live, scale)
                budget = f"{int(args.budget_fraction * need)}B"
                live_note = f", live peak {live * scale / 2**20:.0f} MiB" if live is not None else ""
                basis = "smaller projection" if args.budget_basis == "smaller" else "projected RSS growth"
                notes.append(f"{task} at {size}: tilewise's memory_budget = {args.budget_fraction:g} x the "
                             f"{basis} of the untiled peak (RSS growth {projected / 2**20:.0f} MiB"
                             f"{live_note}) = {args.budget_fraction * need / 2**20:.0f} MiB")
                print(notes[-1], flush=True)
            for v in _order(task, variants)[1:]:
                r = run_variant(args, v, task, args.big, tmp, budget if v.startswith("tilewise") else None)
                if args.live and v.startswith("tilewise"):
                    r["live_peak"] = _live(args, v, task, args.big, tmp, budget)
                r.update(task=task, size=size)
                if "budget" in r:
                    need = _need(args, projected, live, scale)
                    got = f", live peak {r['live_peak'] / need:.2f}" if "live_peak" in r else ""
                    grown = r["rss_growth"] / projected
                    notes.append(f"{task} at {size}, {v}: peak RSS growth {grown:.2f} x the projected "
                                 f"untiled growth; plan peak {r['plan_peak'] / need:.2f}{got} x the "
                                 "projection the budget is a fraction of")
                big_rows.append(r)
                print(table([r])[-1], flush=True)
    rows += big_rows
    sc = FAMILIES[args.family][3]
    budgeted = args.budget or args.budget_fraction
    tiles = (f"diffusers' tiles of {args.tile} latent px ({sc * args.tile} px, stride {args.tile * 3 // 4}), "
             "tilewise's "
             f"within memory_budget={args.budget or 'of the notes'}" if budgeted else
             f"tiles of {args.tile} latent px ({sc * args.tile} px) for both tilers")
    if args.budget_fraction and not args.budget:
        tiles += f" at --big, tiles of {args.tile} latent px at --latent"
    hunyuan = {"hunyuan": " Untiled is the one-pass decode / encode (use_framewise_decoding / _encoding = "
                          "False; the stock default goes framewise past 4 latent / 16 video frames).",
               "allegro": " Untiled is the one pass its own tiling approximates (its decode / encode run "
                          "only through its cubes); diffusers' cubes span every frame."}.get(args.family, "")
    load1 = os.getloadavg()
    head = (f"{FAMILIES[args.family][0]} ({args.family}) at base width {args.base_dim}, seeded random "
            f"weights, fp32, CPU, {args.threads} thread(s); {tiles}.{hunyuan}\n"
            f"Run {t0}-{time.strftime('%H:%M', time.gmtime())} UTC, load average (1, 5, 15 min) "
            f"{', '.join(f'{x:.1f}' for x in load0)} at start, {', '.join(f'{x:.1f}' for x in load1)} at end "
            f"(time ratios from this one run).\n"
            f"Command: python benchmarks/vae3d.py {' '.join(sys.argv[1:])}\n"
            + "".join(f"- {n}\n" for n in notes))
    text = head + "\n" + "\n".join(table(rows)) + "\n"
    print(text)
    if args.out:
        with open(args.out, "a") as f:
            f.write("\n" + text)


def _need(args, projected: float, live: float | None, scale: float) -> float:
    """The untiled peak at --big that --budget-fraction is a fraction of (--budget-basis)."""
    return min(projected, live * scale) if live is not None and args.budget_basis == "smaller" else projected


def _live(args, variant: str, task: str, size: int, tmp: str, budget: str | None) -> int:
    """The live tensor peak of a variant, in a run of its own (the tracking slows it)."""
    return run_variant(args, variant, task, size, tmp, budget, live=True)["live_peak"]


def _order(task: str, variants: list[str]) -> list[str]:
    """The variants of a task, untiled first (the sink variants decode only)."""
    return [v for v in dict.fromkeys(["untiled", *variants]) if task == "decode" or "sink" not in v]


def _size(family: str, task: str, side: int, frames: int) -> str:
    """The video size of a run: frames x height x width in pixels."""
    sc = FAMILIES[family][3]
    t = video_frames(family, frames)
    return f"{t}x{sc * side}x{sc * side}" + (" (latent in)" if task == "decode" else "")


if __name__ == "__main__":
    main()
