"""Backward through a tiled denoiser: peak live bytes and time, untiled vs TiledDenoiser keep vs recompute.

One differentiable call of the embedded UNet (`tilewise.models`: 32 / 64 channels, self- and cross-
attention at both levels) on a side x side latent, loss = <prediction, probe>, gradients to the latent
and to every UNet parameter. Peak live bytes (`tilewise.memory.measure_live_peak`: the tensor storages
the call creates alive at once, backward included, the same on any machine) in one run, time (forward,
backward, best of `--repeat`) in another without the counting mode. The tiled rows' gradients are
compared with each other (recompute must equal keep); the untiled row is the stock UNet (a different
function where tiles overlap, so its gradient is not compared).

    python benchmarks/denoiser_backward.py --side 96 --tile 32 --overlap 8
"""

from __future__ import annotations

import argparse
import time

import torch

from tilewise.diffusion import TiledDenoiser
from tilewise.memory import format_bytes, measure_live_peak
from tilewise.models import encode_prompt, load_default_unet


def step(model, x, emb, probe):
    """(forward s, backward s, gradients) of one call with gradients to x and the parameters."""
    params = [p for p in model.parameters() if p.requires_grad]
    xg = x.clone().requires_grad_()
    t0 = time.perf_counter()
    out = model(xg, 500, encoder_hidden_states=emb).sample
    t1 = time.perf_counter()
    grads = torch.autograd.grad((out * probe).sum(), [xg, *params])
    return t1 - t0, time.perf_counter() - t1, grads


def row(name: str, model, x, emb, probe, repeat: int) -> dict:
    (_, _, grads), peak = measure_live_peak(step, model, x, emb, probe)
    times = [step(model, x, emb, probe)[:2] for _ in range(repeat)]
    fwd, bwd = min(t[0] for t in times), min(t[1] for t in times)
    return dict(name=name, peak=peak, forward=fwd, backward=bwd, grads=grads)


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--side", type=int, default=96, help="latent side (latent pixels)")
    ap.add_argument("--tile", type=int, default=32, help="tile side (latent pixels)")
    ap.add_argument("--overlap", type=int, default=8, help="tile overlap (latent pixels)")
    ap.add_argument("--repeat", type=int, default=2, help="timed runs per row (best kept)")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    unet = load_default_unet().requires_grad_(True)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 4, args.side, args.side, generator=g)
    probe = torch.randn(x.shape, generator=g)
    emb = encode_prompt("grass")
    tiled = {b: TiledDenoiser(unet, args.tile, args.overlap, method="mixture", backward=b)
             for b in ("keep", "recompute")}
    n = tiled["keep"].count(args.side, args.side)
    rows = [row("untiled", unet, x, emb, probe, args.repeat)]
    rows += [row(f"tiled {b}", td, x, emb, probe, args.repeat) for b, td in tiled.items()]
    diff = max(float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))
               for a, b in zip(rows[2]["grads"], rows[1]["grads"], strict=True))
    print(f"latent {args.side}x{args.side}, tile {args.tile}, overlap {args.overlap}: {n} tiles; "
          f"{sum(p.numel() for p in unet.parameters())} UNet parameters; recompute vs keep gradients: "
          f"max relative difference {diff:.1e}")
    print("| run | peak live bytes | vs untiled | forward s | backward s | forward + backward s |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['name']} | {format_bytes(r['peak'])} | {r['peak'] / rows[0]['peak']:.2f} | "
              f"{r['forward']:.2f} | {r['backward']:.2f} | {r['forward'] + r['backward']:.2f} |")
    return rows


if __name__ == "__main__":
    main()
