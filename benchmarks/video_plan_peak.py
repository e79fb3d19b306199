"""The 3-D VAE plan's peak against the live tensor bytes of the run (`measure_live_peak`), one decode.

Usage: python benchmarks/video_plan_peak.py FAMILY LATENT BUDGET [tile_size=N] [order=frames|tiles]
(FAMILY as `vae3d.build_vae` takes it at a third of the width: ltx, wan, qwen; a (1, C, 3, LATENT, LATENT)
latent; BUDGET: memory_budget, as "150MiB")."""

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from vae3d import build_vae, make_input  # noqa: E402

import tilewise as tw  # noqa: E402
from tilewise.memory import measure_live_peak  # noqa: E402

torch.set_num_threads(2)
fam, n, budget = sys.argv[1], int(sys.argv[2]), sys.argv[3]
kw = {k: int(v) if v.isdigit() else v for k, v in (a.split("=") for a in sys.argv[4:])}
x = make_input(fam, "decode", n, 3)
tv = tw.TiledVAE(build_vae(fam, 32), memory_budget=budget, progress=False, **kw)
plan = tv.plan(tuple(x.shape), "decode")
t0 = time.time()
with torch.no_grad():
    _, live = measure_live_peak(lambda: tv.decode(x).sample)
print(f"{fam} {tuple(x.shape)} {budget} {kw} tile {plan.tile_size} order {plan.order}: plan "
      f"{plan.peak / 2**20:.1f} MiB (working {plan.working / 2**20:.1f}) live {live / 2**20:.1f} MiB, "
      f"x{plan.peak / live:.2f} ({time.time() - t0:.0f} s)")
