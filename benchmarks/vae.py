"""Benchmark: exact and fast tiled VAE decode/encode against untiled and diffusers' enable_tiling.

SD-architecture AutoencoderKL (block_out_channels 128, 256, 512, 512, layers_per_block 2, seeded random
weights, fp32, CPU). Every variant runs in its own subprocess (fresh peak RSS); errors are measured
against the untiled output of the same process-independent seeded model and input.

    python benchmarks/vae.py --latent 64 --encode-size 512 --threads 1 --out benchmarks/results_vae.md
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

VARIANTS = ("untiled", "diffusers", "exact-host", "exact-disk", "fast", "fast-disk")


def build_vae(device: str = "cpu", dtype: str = "float32"):
    """The seeded SD-architecture AutoencoderKL."""
    import torch
    from diffusers import AutoencoderKL

    torch.manual_seed(0)
    blocks = (128, 256, 512, 512)
    down, up = ("DownEncoderBlock2D",) * 4, ("UpDecoderBlock2D",) * 4
    vae = AutoencoderKL(block_out_channels=blocks, layers_per_block=2, latent_channels=4, norm_num_groups=32,
                        down_block_types=down, up_block_types=up, sample_size=512)
    return vae.eval().to(device=device, dtype=getattr(torch, dtype))


def make_input(task: str, pattern: str, size: int):
    """White: seeded randn. Structured: 0.5 randn + 2 x upsampled 4x4 randn + horizontal ramp -2..2."""
    import torch
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(1234)
    c, n = (4, size) if task == "decode" else (3, size)
    white = torch.randn(1, c, n, n, generator=g)
    if pattern == "white":
        x = white
    else:
        coarse = F.interpolate(torch.randn(1, c, 4, 4, generator=g), size=(n, n), mode="bilinear")
        x = 0.5 * white + 2 * coarse + torch.linspace(-2, 2, n).view(1, 1, 1, n)
    return x.clamp(-1, 1) if task == "encode" else x


def worker(args) -> None:
    """Run one variant once and write its output (.npy) and timing/memory (.json)."""
    import numpy as np
    import torch

    from tilewise.memory import current_rss, peak_rss, reset_peak_rss

    torch.set_num_threads(args.threads)
    vae = build_vae(args.device, args.dtype)
    x = make_input(args.task, args.pattern, args.size).to(args.device, getattr(torch, args.dtype))
    v = args.variant
    if v == "diffusers":
        vae.enable_tiling()  # 256 px sample tiles, 32 latent tiles, 25% overlap blend
        vae.tile_sample_min_size, vae.tile_latent_min_size = 8 * args.tile, args.tile
    if v.startswith(("exact", "fast")):
        import tilewise as tw

        staging = "disk" if v.endswith("-disk") else "host"
        model = tw.TiledVAE(vae, tile_size=args.tile, mode="fast" if v.startswith("fast") else "exact",
                            fast_sample=args.fast_sample,
                            staging=staging, progress=False)
    else:
        model = vae
    base = current_rss()
    cuda = args.device.startswith("cuda")
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base_cuda = torch.cuda.memory_allocated()
    reset_peak_rss()
    t0 = time.perf_counter()
    with torch.no_grad():
        y = model.decode(x).sample if args.task == "decode" else model.encode(x).latent_dist.mean
    if cuda:
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    peak = (peak_rss() or current_rss()) - base
    out = {"variant": v, "seconds": dt, "rss_growth": peak}
    if cuda:
        out["cuda_peak"] = torch.cuda.max_memory_allocated() - base_cuda
        out["gpu"] = torch.cuda.get_device_name()
    np.save(args.result + ".npy", y.float().cpu().numpy())
    with open(args.result + ".json", "w") as f:
        json.dump(out, f)


def run_variant(args, variant: str, task: str, pattern: str, size: int, tmp: str) -> dict:
    """One variant in a fresh subprocess."""
    res = os.path.join(tmp, f"{task}-{pattern}-{variant}")
    cmd = [sys.executable, __file__, "--worker", "--variant", variant, "--task", task, "--pattern", pattern,
           "--size", str(size), "--tile", str(args.tile), "--threads", str(args.threads), "--result", res,
           "--device", args.device, "--dtype", args.dtype]
    if args.fast_sample is not None:
        cmd += ["--fast-sample", str(args.fast_sample)]
    subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": str(args.threads)})
    with open(res + ".json") as f:
        out = json.load(f)
    out["path"] = res + ".npy"
    return out


def errors(y, ref) -> dict:
    """Max / mean abs error and PSNR (peak-to-peak range of the reference)."""
    import numpy as np

    d = np.abs(y.astype(np.float64) - ref.astype(np.float64))
    mse = float((d**2).mean())
    peak = float(ref.max() - ref.min())
    psnr = float("inf") if mse == 0 else 10 * np.log10(peak**2 / mse)
    return {"max_abs": float(d.max()), "mean_abs": float(d.mean()), "psnr": psnr}


def table(rows: list[dict]) -> list[str]:
    lines = ["| task | input | variant | time s | x untiled | peak RSS growth MiB | max abs | mean abs "
             "| PSNR dB |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['task']} | {r['pattern']} | {r['variant']} | {r['seconds']:.1f} | "
                     f"{r['ratio']:.2f} | {r['rss_growth'] / 2**20:.0f} | {r['max_abs']:.3g} | "
                     f"{r['mean_abs']:.3g} | {r['psnr']:.1f} |")
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--latent", type=int, default=128, help="decode latent side, 0 skips (default 128)")
    p.add_argument("--encode-size", type=int, default=1024, help="encode image side, 0 skips (default 1024)")
    p.add_argument("--tile", type=int, default=32, help="tilewise tile size in latent px (default 32)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per variant (default 1)")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma list from {VARIANTS}")
    p.add_argument("--patterns", default="white,structured")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--fast-sample", type=float, default=None,
                   help="TiledVAE fast_sample (default: the estimator's, 0.5 of the tiles for decode)")
    p.add_argument("--out", default=None, help="append the markdown table to this file")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--variant", help=argparse.SUPPRESS)
    p.add_argument("--task", help=argparse.SUPPRESS)
    p.add_argument("--pattern", help=argparse.SUPPRESS)
    p.add_argument("--size", type=int, help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    import numpy as np

    variants = [v for v in args.variants.split(",") if v]
    jobs = [(task, size) for task, size in (("decode", args.latent), ("encode", args.encode_size)) if size]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for task, size in jobs:
            for pattern in args.patterns.split(","):
                order = list(dict.fromkeys(["untiled", *variants]))
                results = {v: run_variant(args, v, task, pattern, size, tmp) for v in order}
                ref = np.load(results["untiled"]["path"])
                for v in order:
                    r = results[v]
                    r.update(errors(np.load(r["path"]), ref), task=task, pattern=pattern,
                             ratio=r["seconds"] / results["untiled"]["seconds"])
                    rows.append(r)
                    print(table([r])[-1], flush=True)
    head = (f"SD-architecture AutoencoderKL (128,256,512,512), seeded random weights, {args.dtype}, "
            f"{args.device}, {args.threads} thread(s); decode latent {args.latent}x{args.latent}, encode "
            f"{args.encode_size}x{args.encode_size}; tilewise tile {args.tile} latent px.\n"
            f"Command: python benchmarks/vae.py {' '.join(sys.argv[1:])}\n")
    text = head + "\n" + "\n".join(table(rows)) + "\n"
    print(text)
    if args.out:
        with open(args.out, "a") as f:
            f.write("\n" + text)


if __name__ == "__main__":
    main()
