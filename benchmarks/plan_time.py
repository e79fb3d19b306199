"""Plan time (issue #31): CPU seconds (process time) of `TiledVAE.plan` for the slow GPU plans, with a digest
of each plan so that plans made before and after a change compare exactly.

SD- and SDXL-architecture VAEs on fake tensors (benchmarks/counting.py: nothing allocated), float16, planned
for devices.CUDA with a fixed 64 GiB host (as benchmarks/counts.py: the machine's available memory would
otherwise take part in the plan). The digest is a hash of the plan's repr, sets sorted (choices, passes,
stages, counts, estimated seconds, peaks); `--show` prints that text.

    PYTHONPATH=src .venv/bin/python benchmarks/plan_time.py
    PYTHONPATH=src .venv/bin/python benchmarks/plan_time.py --cases sd-fast-539 --profile 30
    PYTHONPATH=src .venv/bin/python benchmarks/plan_time.py --sweep   # 80 more plans' digests, no times
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import hashlib
import itertools
import pstats
import time

import torch
from counting import build_vae, fake

import tilewise as tw
from tilewise.vae.devices import CPU, CUDA

GIB = 1 << 30
MIB = 1 << 20
GPU = CUDA.replace(host_memory=64 * GIB)
CASES = {  # name: (VAE, mode, image px, budget)
    "sd-fast-539": ("sd", "fast", 4096, 539 * MIB),
    "sd-fast-4g": ("sd", "fast", 4096, 4 * GIB),
    "sd-exact-539": ("sd", "exact", 4096, 539 * MIB),
    "sd-exact-4g": ("sd", "exact", 4096, 4 * GIB),
    "sdxl-fast-1686": ("sdxl", "fast", 4096, 1686 * MIB),
}


def plan_once(vae, mode: str, px: int, budget: int):
    """(plan or error text, CPU seconds) of one decode plan of a fresh TiledVAE."""
    tv = tw.TiledVAE(vae, mode=mode, memory_budget=budget, progress=False, device_kind=GPU)
    shape = (1, vae.config.latent_channels, px // 8, px // 8)
    t0 = time.process_time()
    try:
        plan = tv.plan(shape, kind="decode")
    except ValueError as err:
        plan = f"no plan: {err}"
    return plan, time.process_time() - t0


def canonical(x) -> str:
    """repr of x with its sets (a plan's on-device values, its readers) in sorted order, which Python's
    string hashing leaves free."""
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        fields = (f"{f.name}={canonical(getattr(x, f.name))}" for f in dataclasses.fields(x))
        return f"{type(x).__name__}({', '.join(fields)})"
    if isinstance(x, (set, frozenset)):
        return "{" + ", ".join(sorted(canonical(v) for v in x)) + "}"
    if isinstance(x, dict):
        return "{" + ", ".join(f"{canonical(k)}: {canonical(v)}" for k, v in x.items()) + "}"
    if isinstance(x, (list, tuple)):
        return "(" + ", ".join(canonical(v) for v in x) + ")"
    return repr(x)


def digest(plan) -> str:
    """A short hash of everything the plan records (`canonical`)."""
    return hashlib.sha256(canonical(plan).encode()).hexdigest()[:16]


def sweep():
    """The digests of a wider set of plans (no times): SD and Flux shapes, decode and encode at 1024 and
    2048 px, exact and fast, GPU plans within 300 MiB, 1 GiB, 4 GiB and no budget, CPU plans within 1 GiB."""
    cpu = CPU.replace(host_memory=64 * GIB)
    with fake():
        for kind in ("sd", "flux"):
            vae = build_vae(kind, torch.float16, "meta")
            for task, px, mode in itertools.product(("decode", "encode"), (1024, 2048), ("exact", "fast")):
                c = vae.config.latent_channels
                shape = (1, c, px // 8, px // 8) if task == "decode" else (1, 3, px, px)
                for device, budget in [(GPU, b) for b in (300 * MIB, GIB, 4 * GIB, None)] + [(cpu, GIB)]:
                    tv = tw.TiledVAE(vae, mode=mode, memory_budget=budget, progress=False, device_kind=device)
                    try:
                        got = digest(tv.plan(shape, kind=task))
                    except ValueError as err:
                        got = f"no plan {digest(str(err))}"
                    print(kind, task, px, mode, device.kind, budget, got, flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default=",".join(CASES), help="comma-separated, of: " + ", ".join(CASES))
    ap.add_argument("--repeat", type=int, default=1, help="plans of each case, the least time printed")
    ap.add_argument("--profile", type=int, default=0, help="cProfile each case, print its N top functions")
    ap.add_argument("--show", action="store_true", help="print each plan (the digest's text)")
    ap.add_argument("--sweep", action="store_true", help="only the digests of a wider set of plans (`sweep`)")
    a = ap.parse_args()
    if a.sweep:
        return sweep()
    vaes = {}
    with fake():
        for name in a.cases.split(","):
            kind, mode, px, budget = CASES[name]
            if kind not in vaes:
                vaes[kind] = build_vae(kind, torch.float16, "meta")
            if a.profile:
                prof = cProfile.Profile()
                prof.runcall(plan_once, vaes[kind], mode, px, budget)
                pstats.Stats(prof).sort_stats("cumulative").print_stats(a.profile)
            runs = [plan_once(vaes[kind], mode, px, budget) for _ in range(a.repeat)]
            plan, seconds = runs[0][0], min(s for _, s in runs)
            print(f"{name}: {seconds:.2f} s  digest {digest(plan)}", flush=True)
            if a.show:
                print(canonical(plan))


if __name__ == "__main__":
    main()
