"""Benchmark: decode backward (issue #30) of an SD-architecture VAE, side by side in one run: tilewise's
reverse tile program, the untiled backward, and the untiled backward with diffusers' gradient
checkpointing (`vae.enable_gradient_checkpointing()`).

The seeded SD-architecture AutoencoderKL of `benchmarks/vae.py` (block_out_channels 128, 256, 512, 512,
2 resnets a block, fp32), the decoder training (a fine-tuned decoder: its parameters and the latent
require grad); loss = sum(decode(z) * g) for a seeded g. tilewise stages its values on the device
(`tilewise`) or on disk (`tilewise-disk`: the staged values live in the page cache). Every variant runs
in its own subprocess: time of forward + backward, peak memory growth (CPU: resident set high-water
mark; CUDA: max allocated), and the gradients' error against the untiled backward's (the latent's and
the decoder's parameters', max abs over the gradient's max abs).

    python benchmarks/vae_backward.py --latent 32 --tile 16 --out benchmarks/results_vae_backward.md
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

VARIANTS = ("untiled", "checkpointing", "tilewise", "tilewise-disk")


def one(variant: str, latent: int, tile: int, device: str, grads_path: str) -> dict:
    """Run one variant in this process: its time, peak and gradients (saved to grads_path)."""
    import torch
    from vae import build_vae

    import tilewise as tw
    from tilewise.memory import MemoryMeter

    vae = build_vae(device)
    vae.train()
    vae.encoder.requires_grad_(False)
    g = torch.Generator().manual_seed(0)
    z = torch.randn(1, 4, latent, latent, generator=g).to(device).requires_grad_(True)
    w = torch.randn(1, 3, 8 * latent, 8 * latent, generator=g).to(device)
    if variant == "checkpointing":
        vae.enable_gradient_checkpointing()
    tiled = variant.startswith("tilewise")
    staging = "disk" if variant.endswith("disk") else "device"
    model = tw.TiledVAE(vae, tile_size=tile, staging=staging, progress=False) if tiled else vae
    params = [q for q in vae.decoder.parameters()] + [q for q in vae.post_quant_conv.parameters()]
    extra = {}
    if tiled:
        plan = model.plan(tuple(z.shape), backward=True)
        extra = dict(planned_forward_mib=plan.peak / 2**20, planned_backward_mib=plan.backward.peak / 2**20,
                     staged_mib=plan.backward.staged / 2**20, tiles=f"{plan.grid[0]}x{plan.grid[1]}")
    with MemoryMeter(device if device != "cpu" else None) as meter:
        t0 = time.perf_counter()
        y = model.decode(z).sample
        gs = torch.autograd.grad((y * w).sum(), [z, *params])
        if device != "cpu":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
    torch.save([t.detach().cpu() for t in gs], grads_path)
    return dict(variant=variant, seconds=seconds, peak_mib=meter.peak_bytes / 2**20, **extra)


def errors(mine: str, ref: str) -> tuple[float, float]:
    """(latent gradient's error, worst parameter gradient's error), each max abs over the reference's
    max abs (a parameter's scale floored at 1e-3 of the largest parameter gradient's)."""
    import torch

    a, b = torch.load(mine), torch.load(ref)
    rel = [float((x - y).abs().max() / y.abs().max()) for x, y in zip(a[:1], b[:1], strict=True)]
    floor = 1e-3 * max(float(y.abs().max()) for y in b[1:])
    worst = max(float((x - y).abs().max()) / max(float(y.abs().max()), floor)
                for x, y in zip(a[1:], b[1:], strict=True))
    return rel[0], worst


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--latent", type=int, default=128, help="latent side (image side = 8x); default 128 "
                    "(1024 px)")
    ap.add_argument("--tile", type=int, default=32, help="tilewise tile in latent px (default 32)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads in each subprocess (0: default)")
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"comma list of {VARIANTS}")
    ap.add_argument("--out", default="", help="append the markdown table to this file")
    ap.add_argument("--one", default="", help=argparse.SUPPRESS)
    ap.add_argument("--grads", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        if args.threads:
            import torch

            torch.set_num_threads(args.threads)
        print(json.dumps(one(args.one, args.latent, args.tile, args.device, args.grads)))
        return
    rows, tmp = [], tempfile.mkdtemp(prefix="tilewise-bwd-")
    for v in args.variants.split(","):
        path = os.path.join(tmp, f"{v}.pt")
        cmd = [sys.executable, __file__, "--one", v, "--grads", path, "--latent", str(args.latent),
               "--tile", str(args.tile), "--device", args.device, "--threads", str(args.threads)]
        done = subprocess.run(cmd, capture_output=True, text=True, cwd=os.path.dirname(__file__))
        if done.returncode:
            print(done.stderr[-3000:], file=sys.stderr)
            rows.append(dict(variant=v, failed=done.stderr.strip().splitlines()[-1][:120]))
            continue
        row = json.loads(done.stdout.strip().splitlines()[-1])
        row["grads"] = path
        rows.append(row)
        print(row, flush=True)
    ref = next((r["grads"] for r in rows if r["variant"] == "untiled" and "grads" in r), None)
    side = 8 * args.latent
    head = f"decode backward, {side}x{side} px (latent {args.latent}), {args.device}, tile {args.tile}:"
    lines = [head, "",
             "| variant | time s | peak MiB | planned bwd MiB | dz error | worst param error |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        if "failed" in r:
            lines.append(f"| {r['variant']} | failed: {r['failed']} | | | | |")
            continue
        ez, ep = errors(r["grads"], ref) if ref else (float("nan"), float("nan"))
        plan = f"{r['planned_backward_mib']:.0f}" if "planned_backward_mib" in r else ""
        lines.append(f"| {r['variant']} | {r['seconds']:.1f} | {r['peak_mib']:.0f} | {plan} | {ez:.2e} | "
                     f"{ep:.2e} |")
    table = "\n".join(lines)
    print(table)
    if args.out:
        with open(args.out, "a") as f:
            f.write(table + "\n\n")


if __name__ == "__main__":
    main()
