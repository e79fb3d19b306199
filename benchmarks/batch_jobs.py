"""Benchmark (issue #32): 1,000 images of mixed sizes bucketed and cached, in one process and on 2 Ray
workers; padding and cropping of tilewise's policies against kohya's fixed grid and recipe, side by side.

The dataset: scikit-image's photos cut and resized to 1,000 sizes (aspect 1:3 .. 3:1, sides 48 .. 400 px),
PNG and JPEG in nested folders, 3 corrupt files among them. Everything is scaled down 8x per side from
SDXL so the encode runs on 2 CPU cores in minutes: the SDXL bucket grid (area 1024^2, step 64, sides
512 .. 2048, the kohya / SimpleTuner default) becomes area 128^2, step 8, sides 64 .. 256; the VAE is
tilewise's embedded one (latent factor 8).

Figures:
  1. bucketing (header reads, one process): images / s;
  2. the latent cache (decode, transform, encode, write shards): images / s in one process, and on a
     local Ray cluster of 2 workers (ray.init(num_cpus=2); the wall time includes starting the workers and
     their model loads, Ray's own start is given apart), the two caches compared row by row;
  3. padding and cut on the same 1,000 sizes, at the benchmark's scale and at SDXL's (sizes x 8): kohya's
     recipe (nearest-aspect bucket of the grid, resize to cover, centre crop), and tilewise's pad /
     resize / auto on the same grid.

    .venv/bin/python benchmarks/batch_jobs.py --out benchmarks/results_datasets.md

(Not named datasets.py: tests put benchmarks/ on sys.path, where a datasets.py shadows the `datasets`
package.)
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))  # the synthetic dataset of the tests

AREA, STEP, MIN_SIDE, MAX_SIDE = 128 * 128, 8, 64, 256  # SDXL's grid / 8 per side


def make_dataset(root: Path, n: int) -> Path:
    from jobs_support import make_images, write_folder

    return write_folder(root, make_images(n, seed=32, low=48, high=400))


def padding_table(sizes: list[tuple[int, int]], scale: int) -> list[str]:
    """kohya's recipe against tilewise's policies on one grid: padded / bucket px, cut / image px, buckets."""
    from tilewise.buckets import BucketPlanner
    from tilewise.jobs.manifest import scaled_request

    area, step, lo, hi = AREA * scale * scale, STEP * scale, MIN_SIDE * scale, MAX_SIDE * scale
    planner = BucketPlanner(area=area, step=step, min_side=lo, max_side=hi, max_aspect=4.0,
                            max_aspect_error=1e9)
    rows = [f"| grid ({'SDXL' if scale > 1 else 'benchmark'}: area {int(math.isqrt(area))}^2, step {step}) "
            "| recipe | padded / bucket px | cut / image px | buckets used | skipped |",
            "|---|---|---|---|---|---|"]
    recipes = [("kohya: nearest aspect, resize to cover, centre crop", "kohya"),
               ("tilewise pad (scaled to fit, padded)", "pad"), ("tilewise resize (cover + crop)", "resize"),
               ("tilewise auto (pad <= 25% else resize)", "auto")]
    for label, policy in recipes:
        padded = pixels = cut = image = 0
        used, skipped = set(), 0
        for w, h in sizes:
            w, h = w * scale, h * scale
            try:
                if policy == "kohya":
                    a = planner.assign(w, h, policy="resize", bucket=_kohya_bucket(planner.buckets, w, h))
                    req = (w, h)
                else:
                    req = scaled_request(planner, policy, w, h)
                    a = planner.assign(*req, policy=policy, max_aspect_error=0.25)
            except ValueError:
                skipped += 1
                continue
            used.add(a.bucket)
            padded += a.padded_pixels
            pixels += a.bucket[0] * a.bucket[1]
            cut += a.cut_fraction * req[0] * req[1]
            image += req[0] * req[1]
        rows.append(f"| | {label} | {padded / pixels:.1%} | {cut / image:.1%} | {len(used)} | {skipped} |")
    return rows


def _kohya_bucket(buckets, w: int, h: int):
    """kohya's select_bucket: the bucket whose aspect ratio (w / h) is nearest the image's."""
    return min(buckets, key=lambda b: abs(b[0] / b[1] - w / h))


def run(n: int, workers: int) -> list[str]:
    import ray
    import torch

    from tilewise.jobs import LatentDataset, RayRunner, bucket_dataset, encode_dataset
    from tilewise.jobs.readers import open_dataset

    tmp = Path(tempfile.mkdtemp(prefix="tw-datasets-"))
    try:
        t0 = time.perf_counter()
        root = make_dataset(tmp / "photos", n)
        made = time.perf_counter() - t0
        t0 = time.perf_counter()
        res = bucket_dataset(root, tmp / "m.jsonl", area=AREA, step=STEP, policy="pad", progress=False)
        bucketed = time.perf_counter() - t0
        rows = len(res.manifest.rows)
        threads = torch.get_num_threads()
        t0 = time.perf_counter()
        one = encode_dataset(tmp / "m.jsonl", tmp / "one", shard_size=64, progress=False)
        t_one = time.perf_counter() - t0
        torch.set_num_threads(1)  # as a Ray task of 1 CPU runs
        t0 = time.perf_counter()
        single = encode_dataset(tmp / "m.jsonl", tmp / "one1", shard_size=64, progress=False)
        t_single = time.perf_counter() - t0
        torch.set_num_threads(threads)
        t0 = time.perf_counter()
        ray.init(num_cpus=workers, include_dashboard=False, logging_level="WARNING",
                 runtime_env={"env_vars": {"PYTHONPATH": str(HERE.parent / "src")}})
        ray.data.DataContext.get_current().enable_progress_bars = False
        t_init = time.perf_counter() - t0
        t0 = time.perf_counter()
        many = encode_dataset(tmp / "m.jsonl", tmp / "ray", shard_size=64, progress=False,
                              ray=RayRunner("local", workers=workers))
        t_ray = time.perf_counter() - t0
        ray.shutdown()
        a, b = LatentDataset(tmp / "one"), LatentDataset(tmp / "ray")
        same_keys = [r.key for r in a.manifest.rows] == [r.key for r in b.manifest.rows]
        err = max((a[i]["latents"] - b[i]["latents"]).abs().max().item() for i in range(len(a)))
        sizes = [open_dataset(root).size(r.key) for r in res.manifest.rows]
        lines = [
            f"Machine: {platform.machine()}, {os.cpu_count()} CPU cores, torch {torch.__version__} "
            f"({threads} threads in the one process unless said), ray {ray.__version__}; dataset of {n} "
            f"images + 3 corrupt files made in {made:.1f}s.",
            "",
            "| step | where | images | seconds | images / s |",
            "|---|---|---|---|---|",
            f"| bucket (headers only) | 1 process | {rows} (+{len(res.manifest.skipped)} skipped) | "
            f"{bucketed:.2f} | {rows / bucketed:.0f} |",
            f"| latent cache (decode, bucket, encode, write) | 1 process | {one.rows} | {t_one:.1f} | "
            f"{one.rows / t_one:.1f} |",
            f"| latent cache | 1 process, 1 thread | {single.rows} | {t_single:.1f} | "
            f"{single.rows / t_single:.1f} |",
            f"| latent cache | Ray, {workers} workers (1 CPU each) | {many.rows} | {t_ray:.1f} | "
            f"{many.rows / t_ray:.1f} |",
            "",
            f"Ray's own start (ray.init): {t_init:.1f}s, not counted above; the Ray wall time includes the "
            f"workers' start and model loads. The two caches: same rows in the same shards: {same_keys}; "
            f"max |one process - Ray| over every latent: {err:.1e} (float summation order: a Ray task of 1 "
            "CPU runs torch on one thread).",
            "",
        ]
        for scale in (1, 8):
            lines += padding_table(sizes, scale) + [""]
        return lines
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=1000)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    text = "\n".join(run(args.n, args.workers))
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
