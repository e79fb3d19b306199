"""GPU benchmark: untiled vs diffusers' tiling vs tilewise exact and fast, timed in one run (gpu.sh).

Per size (1024 / 2048 / 4096 px decode, SD-shaped AutoencoderKL with seeded random weights, float16):
- untiled: the VAE's own decode (an out-of-memory is recorded as such, not hidden);
- diffusers: enable_tiling() at its default tiles (config.sample_size px; --diffusers-tile to change);
- tilewise exact and fast: TiledVAE(memory_budget=--budget), planned for the device it runs on;
- tilewise exact within --small-budget (640 MiB): host staging with its side-stream copies and, at
  4096 px, global attention's keys and values streamed from host memory; its max abs error against the
  untiled output is the check that those copies and kernels race nothing on a real GPU.
Each variant is warmed up once, then timed --repeats times (torch.cuda.synchronize around each; the
median is reported with its ratio to the untiled time of the same run); beside it the measured
torch.cuda.max_memory_allocated growth over what was allocated before the call (weights and input
apart), the plan's estimated device peak and time, the host time of making the plan (part of every
tilewise call, timed apart here), and the max abs error against the untiled output.

Each size's rows are appended to --out as soon as they are measured, so a run stopped by its deadline
(--deadline seconds: later sizes are skipped and said so) keeps what it measured.

    benchmarks/gpu.sh                                     # on a GPU machine: the whole table, < 8 min
    python benchmarks/gpu.py --device cpu --device-kind cuda --sizes 64 --narrow --budget 2MiB \\
        --diffusers-tile 32 --repeats 1                   # CPU dry run (tests/test_gpu_benchmark.py)
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time

import torch
from counting import build_vae

import tilewise as tw

MIB = 1 << 20


def timed(fn, device: str, repeats: int):
    """(median seconds, output, peak allocated growth in bytes or None) of fn() after one warm-up."""
    cuda = device.startswith("cuda")
    out = fn()
    times, peak = [], None
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        t0 = time.perf_counter()
        out = fn()
        if cuda:
            torch.cuda.synchronize()
            peak = max(peak or 0, torch.cuda.max_memory_allocated() - base)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out, peak


def run_size(vae, px: int, args) -> list[dict]:
    """Every variant at one size."""
    g = torch.Generator().manual_seed(0)
    z = torch.randn(1, vae.config.latent_channels, px // 8, px // 8, generator=g)
    z = z.to(args.device, vae.dtype)
    rows, ref = [], None

    def decode(model):
        with torch.no_grad():
            return model.decode(z).sample

    variants = [("untiled", vae, None, None), ("diffusers tiling", vae, None, None)]
    refused = []
    tiled = [("exact", args.budget, "tilewise exact"), ("fast", args.budget, "tilewise fast")]
    if args.small_budget:  # host staging's side-stream copies and streamed attention, checked exact
        tiled.append(("exact", args.small_budget, f"tilewise exact, {args.small_budget}"))
    for mode, budget, name in tiled:
        tv = tw.TiledVAE(vae, mode=mode, memory_budget=budget, progress=False, device_kind=args.device_kind)
        t0 = time.perf_counter()
        try:
            plan = tv.plan(tuple(z.shape))
        except ValueError as err:  # (no plan fits: said in the table)
            refused.append(dict(px=px, variant=name, error=str(err).split(";")[0]))
            continue
        variants.append((name, tv, plan, time.perf_counter() - t0))
    for name, model, plan, plan_s in variants:
        if name == "diffusers tiling":
            vae.enable_tiling()
            if args.diffusers_tile:
                vae.tile_sample_min_size = args.diffusers_tile
                vae.tile_latent_min_size = args.diffusers_tile // 8
        row = dict(px=px, variant=name, plan=plan, plan_s=plan_s)
        out = None
        try:
            row["seconds"], out, row["peak"] = timed(lambda m=model: decode(m), args.device, args.repeats)
        except torch.OutOfMemoryError:
            row["error"] = "out of memory"
            out = None
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        finally:
            vae.disable_tiling()
        if name == "untiled":
            ref = out
        if out is not None and ref is not None and out.shape != ref.shape:
            row["error"] = f"output {tuple(out.shape)}, untiled {tuple(ref.shape)}"
        elif out is not None and ref is not None:
            row["max_abs"] = float((out.float() - ref.float()).abs().max())
        rows.append(row)
        del out
    rows += refused
    base = next((r["seconds"] for r in rows if r["variant"] == "untiled" and "seconds" in r), None)
    for r in rows:
        r["ratio"] = r["seconds"] / base if base and "seconds" in r else None
    return rows


COLUMNS = ["px", "variant", "time s", "x untiled", "max allocated MiB", "plan: peak MiB / est. s / shape",
           "plan s", "max abs vs untiled"]
HEAD = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]


def table(rows: list[dict]) -> list[str]:
    out = []
    for r in rows:
        if "seconds" not in r:
            out.append(f"| {r['px']} | {r['variant']} | {r['error']} | | | | | |")
            continue
        p, shape, plan_s = r["plan"], "", ""
        if p is not None:
            how = "untiled run" if p.untiled else f"tile {p.tile_size}, {p.staging}"
            how += ", streamed K/V" if p.kv_chunk else ""
            shape, plan_s = f"{p.peak / MIB:,.0f} / {p.seconds:.3f} / {how}", f"{r['plan_s']:.3f}"
        peak = "n/a" if r["peak"] is None else f"{r['peak'] / MIB:,.0f}"
        ratio = "" if r["ratio"] is None else f"{r['ratio']:.2f}"
        err = f"{r['max_abs']:.3g}" if "max_abs" in r else r.get("error", "")
        cells = [str(r["px"]), r["variant"], f"{r['seconds']:.3f}", ratio, peak, shape, plan_s, err]
        out.append("| " + " | ".join(cells) + " |")
    return out


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--device-kind", default=None, help="plan for this kind (default: the device's)")
    ap.add_argument("--sizes", default="1024,2048,4096", help="image sides in px")
    ap.add_argument("--kind", default="sd", help="VAE shape: sd, sdxl, flux (default sd)")
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--budget", default="16GiB", help="tilewise memory_budget (default 16GiB)")
    ap.add_argument("--small-budget", default="640MiB",
                    help="an exact run within this budget too: host staging, streamed attention ('': none)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--diffusers-tile", type=int, default=None, help="diffusers' tile, px (default: its own)")
    ap.add_argument("--narrow", action="store_true", help="a narrow VAE (16, 32, 32, 32): dry runs")
    ap.add_argument("--deadline", type=float, default=None, help="skip sizes not started by then (seconds)")
    ap.add_argument("--out", default=None, help="append the markdown table to this file, size by size")
    return ap.parse_args(argv)


def main(argv=None) -> list[dict]:
    args = parse(argv)
    start = time.perf_counter()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("no CUDA device here: run with --device cpu --device-kind cuda for a dry run")
    shape = dict(blocks=(16, 32, 32, 32), groups=8) if args.narrow else {}
    vae = build_vae(args.kind, getattr(torch, args.dtype), args.device, **shape)
    name = torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor() or "cpu"
    head = (f"{args.kind.upper()}-shaped AutoencoderKL, seeded random weights, {args.dtype}, {name}, "
            f"torch {torch.__version__}; tilewise memory_budget {args.budget}; median of {args.repeats}.\n"
            f"Command: python benchmarks/gpu.py {' '.join(argv if argv is not None else sys.argv[1:])}\n")
    print(head, flush=True)
    _write(args.out, "\n" + head + "\n" + "\n".join(HEAD))
    rows = []
    for px in (int(s) for s in args.sizes.split(",")):
        if args.deadline is not None and time.perf_counter() - start > args.deadline:
            line = f"| {px} | (skipped: the run passed its {args.deadline:.0f} s deadline) | | | | | | |"
            print(line, flush=True)
            _write(args.out, line)
            continue
        part = run_size(vae, px, args)
        rows += part
        print("\n".join(HEAD + table(part)), flush=True)
        _write(args.out, "\n".join(table(part)))
    print(f"total {time.perf_counter() - start:.0f} s", flush=True)
    return rows


def _write(path: str | None, text: str) -> None:
    if path:
        with open(path, "a") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
