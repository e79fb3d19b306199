"""Benchmark: decode backward (issue #30) of a Wan 2.1-layout video VAE, side by side in one run: tilewise's
causal steps recomputed last to first (tiled), the untiled backward, and the untiled backward with
diffusers' gradient checkpointing flags set.

The seeded AutoencoderKLWan of `benchmarks/vae3d.py` (Wan 2.1's layout at base width --base-dim, fp32),
the decoder training: its parameters and the latent require grad; loss = sum(decode(z) * g) for a
seeded g. AutoencoderKLWan says `_supports_gradient_checkpointing = False` (enable_gradient_checkpointing
refuses it), so "checkpointing" sets its blocks' flags directly (`_set_gradient_checkpointing`), which
is all diffusers offers for it. Every variant runs in its own subprocess: time of forward + backward,
peak memory growth (CPU: resident set high-water mark; CUDA: max allocated), and the gradients' errors
against the untiled backward's (`vae_backward.errors`).

    python benchmarks/video_vae_backward.py --base-dim 16 --latent 16 --frames 3 --tile 8
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from vae_backward import errors

VARIANTS = ("untiled", "checkpointing", "tilewise")


def one(variant: str, args, grads_path: str) -> dict:
    """Run one variant in this process: its time, peak and gradients (saved to grads_path)."""
    import torch
    from vae3d import build_vae

    import tilewise as tw
    from tilewise.memory import MemoryMeter, measure_live_peak

    vae = build_vae("wan", args.base_dim).to(args.device).train()  # (Wan 2.1's layout)
    vae.encoder.requires_grad_(False)
    vae.quant_conv.requires_grad_(False)
    g = torch.Generator().manual_seed(0)
    n, s = args.frames, args.latent
    z = torch.randn(1, 16, n, s, s, generator=g).to(args.device).requires_grad_(True)
    w = torch.randn(1, 3, 1 + 4 * (n - 1), 8 * s, 8 * s, generator=g).to(args.device)
    if variant == "checkpointing":
        vae._set_gradient_checkpointing(True)
    tiled = variant == "tilewise"
    model = tw.TiledVAE(vae, tile_size=args.tile, progress=False) if tiled else vae
    params = [*vae.decoder.parameters(), *vae.post_quant_conv.parameters()]
    extra = {}
    if tiled:
        plan = model.plan(tuple(z.shape))
        back = model.plan(tuple(z.shape), backward=True).backward
        extra = dict(tiles=f"{plan.grid[0]}x{plan.grid[1]}", steps=len(plan.steps),
                     planned_mib=back.peak / 2**20)
    with MemoryMeter(args.device if args.device != "cpu" else None) as meter:
        t0 = time.perf_counter()
        y = model.decode(z).sample
        gs = torch.autograd.grad((y * w).sum(), [z, *params])
        if args.device != "cpu":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
    torch.save([t.detach().cpu() for t in gs], grads_path)
    del y, gs
    if args.device == "cpu":  # (the storages born in a second run alive at once: no allocator in the count)
        _, live = measure_live_peak(lambda: torch.autograd.grad((model.decode(z).sample * w).sum(),
                                                                [z, *params]))
        extra["live_mib"] = live / 2**20
    return dict(variant=variant, seconds=seconds, peak_mib=meter.peak_bytes / 2**20, **extra)


def table(rows: list[dict], args) -> str:
    """The markdown table of the rows, errors against the untiled variant's gradients."""
    ref = next((r["grads"] for r in rows if r["variant"] == "untiled" and "grads" in r), None)
    side, t = 8 * args.latent, 1 + 4 * (args.frames - 1)
    lines = [f"Wan 2.1-layout decode backward (base_dim {args.base_dim}), {t} frames of {side}x{side} px "
             f"(latent {args.frames}x{args.latent}x{args.latent}), {args.device}, tile {args.tile}:", "",
             "| variant | time s | peak MiB | live MiB | planned MiB | dz error | worst param error |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        if "failed" in r:
            lines.append(f"| {r['variant']} | failed: {r['failed']} | | | | | |")
            continue
        ez, ep = errors(r["grads"], ref) if ref else (float("nan"), float("nan"))
        name = r["variant"] + (f" ({r['tiles']} tiles, {r['steps']} steps)" if "tiles" in r else "")
        live = f"{r['live_mib']:.0f}" if "live_mib" in r else ""
        planned = f"{r['planned_mib']:.0f}" if "planned_mib" in r else ""
        lines.append(f"| {name} | {r['seconds']:.1f} | {r['peak_mib']:.0f} | {live} | {planned} | {ez:.2e} | "
                     f"{ep:.2e} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-dim", type=int, default=16, help="Wan base width (96 is Wan 2.1's; default 16)")
    ap.add_argument("--latent", type=int, default=16, help="latent side (frame side = 8x); default 16")
    ap.add_argument("--frames", type=int, default=3, help="latent frames (video: 1 + 4 (n - 1)); default 3")
    ap.add_argument("--tile", type=int, default=8, help="tilewise tile in latent px (default 8)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"comma list of {VARIANTS}")
    ap.add_argument("--out", default="", help="append the markdown table to this file")
    ap.add_argument("--one", default="", help=argparse.SUPPRESS)
    ap.add_argument("--grads", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(args.one, args, args.grads)))
        return
    rows, tmp = [], tempfile.mkdtemp(prefix="tilewise-vbwd-")
    for v in args.variants.split(","):
        path = os.path.join(tmp, f"{v}.pt")
        cmd = [sys.executable, __file__, "--one", v, "--grads", path, "--base-dim", str(args.base_dim),
               "--latent", str(args.latent), "--frames", str(args.frames), "--tile", str(args.tile),
               "--device", args.device]
        done = subprocess.run(cmd, capture_output=True, text=True, cwd=os.path.dirname(__file__))
        if done.returncode:
            print(done.stderr[-3000:], file=sys.stderr)
            rows.append(dict(variant=v, failed=done.stderr.strip().splitlines()[-1][:120]))
            continue
        rows.append({**json.loads(done.stdout.strip().splitlines()[-1]), "grads": path})
        print(rows[-1], flush=True)
    out = table(rows, args)
    print(out)
    if args.out:
        with open(args.out, "a") as f:
            f.write(out + "\n\n")


if __name__ == "__main__":
    main()
