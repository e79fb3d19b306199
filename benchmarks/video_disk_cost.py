"""What disk staging costs a 3-D VAE decode in time: the same tile and order staged in host memory and in
disk files (`staging="disk"`), runs alternated, the fastest of each.

Usage: python benchmarks/video_disk_cost.py FAMILY LATENT FRAMES TILE [REPEATS]
(FAMILY as `vae3d_models.build_vae` takes it, at base width 32; a (1, C, FRAMES, LATENT, LATENT) latent;
TILE: tile_size in latent px; REPEATS: runs of each staging, default 2). The files go to the system's
temporary folder."""

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from vae3d_models import build_vae, call, make_input, plan_shape  # noqa: E402

import tilewise as tw  # noqa: E402

torch.set_num_threads(2)
fam, n, frames, tile = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
repeats = int(sys.argv[5]) if len(sys.argv) > 5 else 2
vae = build_vae(fam, 32)
x = make_input(fam, "decode", n, frames)
seconds, outs = {"host": [], "disk": []}, {}
for _ in range(repeats):
    for staging in seconds:
        tv = tw.TiledVAE(vae, tile_size=tile, staging=staging, progress=False)
        t0 = time.perf_counter()
        with torch.no_grad():
            outs[staging] = call(tv, fam, "decode", x)
        seconds[staging].append(time.perf_counter() - t0)
plan = tw.TiledVAE(vae, tile_size=tile, staging="disk", progress=False).plan(plan_shape(fam, "decode", x))
host, disk = min(seconds["host"]), min(seconds["disk"])
runs = {k: ", ".join(f"{s:.1f}" for s in v) for k, v in seconds.items()}
print(f"{fam} {tuple(x.shape)} tile {tile} order {plan.order}, {plan.disk_bytes / 2**20:.0f} MiB in files: "
      f"host {host:.1f} s, disk {disk:.1f} s (x{disk / host:.2f}; all runs: host {runs['host']}, disk "
      f"{runs['disk']});"
      f" max abs disk - host {(outs['disk'] - outs['host']).abs().max().item():.3g}")
