"""Benchmark: the 3-D fast mode's error on trained statistics (#28), on panning videos of photographs.

The VAE: the embedded trained 2-D VAE inflated into AutoencoderKLHunyuanVideo (`video_fast_models`), with
the 2-D VAE's zero padding at the border (`--pad constant`, the default: then each decoded frame is the
trained 2-D decoder's, up to GroupNorm statistics pooled over the frames) or HunyuanVideo's own edge
replication (`--pad replicate`). The videos: a size x size window sliding `--step` px a frame to the right
across each of scikit-image's astronaut, coffee, chelsea and rocket, pixels in [-1, 1]; their latents
are the untiled encode's posterior mode. Side by side in one run, per photograph, against the untiled
decode / encode (fp32, CPU): tilewise exact, tilewise fast per (`fast_sample`: the default and 0.25;
`fast_low`: `--lows`, the low pass's reduction, 0 none), and
diffusers' own tiling (`vae.enable_tiling`, tiles of the given pixel sizes, stride 3/4 of a tile): max abs
error and PSNR of the pixels in [0, 1], wall time, the plan's estimated peak; for encode the latent's max
abs error and relative rms. Beside them the 2-D fast mode on the same latent frames and tile (the
embedded 2-D VAE, each frame alone), and per GroupNorm of the estimated part how far the estimate is from
the exact statistics (|mean error| / exact std, |std ratio - 1|, worst group).

    python benchmarks/video_fast.py --out benchmarks/results_video_fast.md
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from video_fast_models import inflated_hunyuan  # noqa: E402

PHOTOS = ("astronaut", "coffee", "chelsea", "rocket")


def panning(name: str, size: int, frames: int, step: int) -> torch.Tensor:
    """(1, 3, frames, size, size) in [-1, 1]: a window of the photograph moving `step` px a frame right."""
    import skimage.data

    im = np.asarray(getattr(skimage.data, name)())
    im = np.repeat(im[..., None], 3, axis=2) if im.ndim == 2 else im[..., :3]
    h, w = im.shape[:2]
    span = size + step * (frames - 1)
    if h < size or w < span:
        raise ValueError(f"{name} is {h}x{w}: too small for {frames} frames of {size} px moving {step} px")
    y0, x0 = (h - size) // 2, (w - span) // 2
    video = np.stack([im[y0:y0 + size, x0 + k * step:x0 + k * step + size] for k in range(frames)])
    x = torch.from_numpy(video).permute(3, 0, 1, 2).float()[None] / 255
    return x * 2 - 1


def pixel_errors(y: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """Max abs error and PSNR (dB) of the pixels mapped from [-1, 1] to [0, 1] (clamped)."""
    a, b = (((t.double() + 1) / 2).clamp(0, 1) for t in (y, ref))
    d = a - b
    mse = float(d.pow(2).mean())
    return float(d.abs().max()), float("inf") if mse == 0 else 10 * np.log10(1 / mse)


def latent_errors(z: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """Max abs error and relative rms error of a latent."""
    d = (z - ref).double()
    return float(d.abs().max()), float(d.pow(2).mean().sqrt() / ref.double().pow(2).mean().sqrt())


def timed(fn, *args):
    """(fn(*args), wall seconds) under no_grad."""
    t0 = time.perf_counter()
    with torch.no_grad():
        out = fn(*args)
    return out, time.perf_counter() - t0


def mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.1f}"


def static_check(vae2d, size: int) -> list[str]:
    """Decode a latent video constant in time (the 2-D encode of the astronaut, 3 latent frames): every
    output frame against the 2-D decode of that latent, for both border paddings."""
    x = panning("astronaut", size, 1, 0)[:, :, 0]
    with torch.no_grad():
        z = vae2d.encode(x).latent_dist.mode()
        y2 = vae2d.decode(z).sample
    lines = ["Static check: a latent video constant in time (3 frames of the astronaut's 2-D latent) "
             "decoded by the inflated 3-D VAE, against the 2-D VAE's decode of that latent, max abs over "
             "every output frame (raw output):", ""]
    for pad in ("constant", "replicate"):
        vae3d, names = inflated_hunyuan(vae2d, pad)
        with torch.no_grad():
            y3 = vae3d.decode(z[:, :, None].expand(-1, -1, 3, -1, -1).contiguous()).sample
        err = [float((y3[:, :, t] - y2).abs().max()) for t in range(y3.shape[2])]
        inner = float((y3[..., 32:-32, 32:-32] - y2[:, :, None, 32:-32, 32:-32]).abs().max())
        lines.append(f"- pad {pad}: {len(names)} of {len(vae2d.state_dict())} keys mapped, {y3.shape[2]} "
                     f"frames, max abs {max(err):.2e} (32 px in from the border: {inner:.2e})")
    return lines + [""]


def decode_rows(vae3d, z, tile: int, samples, lows, diffusers_tiles) -> tuple[list, torch.Tensor]:
    """Decode rows (variant, tiles, s, plan peak, max abs, PSNR) and the untiled reference."""
    import tilewise as tw

    ref, t_ref = timed(lambda: vae3d.decode(z).sample)
    rows = [("untiled", "1", t_ref, None, 0.0, float("inf"))]
    for mode, frac, low in [("exact", None, 4)] + [("fast", f, k) for f in samples for k in lows]:
        tv = tw.TiledVAE(vae3d, tile_size=tile, mode=mode, fast_sample=frac, fast_low=low, progress=False)
        plan = tv.plan(tuple(z.shape))
        y, s = timed(lambda v: v.decode(z).sample, tv)
        name = mode if mode == "exact" else f"fast, sample {frac or 'default'}, low {low}"
        grid = f"{plan.grid[0]}x{plan.grid[1]} of {tile}"
        rows.append((name, grid, s, plan.peak, *pixel_errors(y, ref)))
    for px in diffusers_tiles:
        vae3d.enable_tiling(tile_sample_min_height=px, tile_sample_min_width=px,
                            tile_sample_stride_height=px * 3 // 4, tile_sample_stride_width=px * 3 // 4)
        y, s = timed(lambda: vae3d.decode(z).sample)
        vae3d.disable_tiling()
        rows.append((f"diffusers tiling {px} px", f"stride {px * 3 // 4} px", s, None, *pixel_errors(y, ref)))
    return rows, ref


def encode_rows(vae3d, x, tile: int, samples, lows) -> tuple[list, torch.Tensor]:
    """Encode rows (variant, tiles, s, plan peak, latent max abs, relative rms) and the untiled mode."""
    import tilewise as tw

    ref, t_ref = timed(lambda: vae3d.encode(x).latent_dist.mode())
    rows = [("untiled", "1", t_ref, None, 0.0, 0.0)]
    for mode, frac, low in [("exact", None, 4)] + [("fast", f, k) for f in samples for k in lows]:
        tv = tw.TiledVAE(vae3d, tile_size=tile, mode=mode, fast_sample=frac, fast_low=low, progress=False)
        plan = tv.plan(tuple(x.shape), kind="encode")
        z, s = timed(lambda v: v.encode(x).latent_dist.mode(), tv)
        name = mode if mode == "exact" else f"fast, sample {frac or 'default'}, low {low}"
        rows.append((name, f"{plan.grid[0]}x{plan.grid[1]} of {tile}", s, plan.peak, *latent_errors(z, ref)))
    return rows, ref


def fast_2d(vae2d, z, tile: int, low: int) -> tuple[float, float]:
    """The 2-D fast mode (default sample, a `low` times smaller low pass correcting the sample's
    statistics; 0: none, the 3-D estimator's way) on each latent frame alone, against the 2-D untiled
    decode: the max abs error and the PSNR over the frames ([0, 1] pixels)."""
    import tilewise as tw

    tv = tw.TiledVAE(vae2d, tile_size=tile, mode="fast", fast_low=low, progress=False)
    frames = z.unbind(2)
    with torch.no_grad():
        y = torch.stack([tv.decode(f).sample for f in frames], 2)
        ref = torch.stack([vae2d.decode(f).sample for f in frames], 2)
    return pixel_errors(y, ref)


def diffusers_2d(vae2d, z, px: int) -> tuple[float, float]:
    """The stock 2-D VAE's own tiling (`enable_tiling`, tiles of px, overlap 1/4) on each latent frame
    alone, against its untiled decode: is diffusers' error the inflation's or its tiling's?"""
    frames = z.unbind(2)
    with torch.no_grad():
        ref = torch.stack([vae2d.decode(f).sample for f in frames], 2)
        vae2d.enable_tiling()
        vae2d.tile_sample_min_size = px
        vae2d.tile_latent_min_size = px // 2 ** (len(vae2d.config.block_out_channels) - 1)
        y = torch.stack([vae2d.decode(f).sample for f in frames], 2)
        vae2d.disable_tiling()
    return pixel_errors(y, ref)


def norm_errors(vae3d, z, tile: int, low: int) -> dict[str, tuple[float, float]]:
    """Per GroupNorm of fast mode's estimated part (default sample, `fast_low` low): (|mean error| /
    exact std, |estimated std / exact std - 1|), the worst (batch, group) over every causal step."""
    import tilewise as tw
    from tilewise.vae.video.executor import VideoExecutor
    from tilewise.vae.video.fast import fast_split, fast_stats

    tv = tw.TiledVAE(vae3d, tile_size=tile, mode="fast", fast_low=low, progress=False)
    job = tv.job("decode")
    split = fast_split(tv.settings, job, tuple(z.shape))
    assert not isinstance(split, str) and split is not None, split

    def executor(program, ref, stats=None, probes=None):
        return VideoExecutor(program, tile, ref, progress=False, fixed_stats=stats, probes=probes)

    with torch.no_grad():
        est, _ = fast_stats(tv.settings, job, split, z, tile, executor)
        exact = executor(job.program, job.ref).run(z).stats
    out = {}
    for op in split.part.ops:
        if id(op) not in split.fixed:
            continue
        dm = ds = 0.0
        for (i, k), (m, v) in est.items():
            if i == id(op):
                m0, v0 = exact[i, k]
                dm = max(dm, float(((m - m0).abs() / v0.sqrt()).max()))
                ds = max(ds, float(((v / v0).sqrt() - 1).abs().max()))
        out[op.name] = (dm, ds)
    return out


def table(head: list[str], rows: list) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + [
        "| " + " | ".join(r) + " |" for r in rows]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--photos", default=",".join(PHOTOS),
                    help="scikit-image photographs (default: %(default)s)")
    ap.add_argument("--size", type=int, default=256, help="frame side in px (default: %(default)s)")
    ap.add_argument("--frames", type=int, default=9, help="frames, 1 + 4k (default: %(default)s)")
    ap.add_argument("--step", type=int, default=4, help="px the window moves a frame (default: %(default)s)")
    ap.add_argument("--tile", type=int, default=8, help="tilewise tile, latent px (default: %(default)s)")
    ap.add_argument("--samples", default="default,0.25", help="fast_sample values (default: %(default)s)")
    ap.add_argument("--lows", default="4", help="fast_low values, 0: no low pass (default: %(default)s)")
    ap.add_argument("--diffusers-tiles", default="64,128", help="diffusers' tile px (default: %(default)s)")
    ap.add_argument("--pad", choices=("constant", "replicate"), default="constant",
                    help="the causal convs' border padding (default: %(default)s, the 2-D VAE's)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads (default: %(default)s)")
    ap.add_argument("--out", default=None, help="write the markdown here too")
    args = ap.parse_args()
    if (args.frames - 1) % 4:
        ap.error(f"--frames must be 1 + 4k (the VAE's 4x temporal compression), got {args.frames}")
    torch.set_num_threads(args.threads)
    from tilewise.models import load_default_vae

    vae2d = load_default_vae().eval()
    vae3d, _ = inflated_hunyuan(vae2d, args.pad)
    samples = [None if s == "default" else float(s) for s in args.samples.split(",")]
    lows = [int(k) for k in args.lows.split(",")]
    px = [int(p) for p in args.diffusers_tiles.split(",") if p]
    started = time.perf_counter()
    lines = ["# 3-D fast mode on trained statistics (#28)", "",
             "    python benchmarks/video_fast.py " + " ".join(sys.argv[1:]), "",
             f"Inflated HunyuanVideo VAE (embedded 2-D VAE's weights, pad {args.pad}), fp32, CPU, "
             f"{torch.get_num_threads()} threads; {args.frames} frames of {args.size} px moving "
             f"{args.step} px a frame; tilewise tile {args.tile} latent px; errors against the untiled run, "
             "pixels in [0, 1].", ""]
    lines += static_check(vae2d, args.size)
    dec, enc, norms, flat = [], [], {}, []
    for name in args.photos.split(","):
        x = panning(name, args.size, args.frames, args.step)
        rows, z = encode_rows(vae3d, x, args.tile, samples, lows)
        enc += [(name, *r) for r in rows]
        rows, _ = decode_rows(vae3d, z, args.tile, samples, lows, px)
        dec += [(name, *r) for r in rows]
        flat.append((name, *fast_2d(vae2d, z, args.tile, 4), *fast_2d(vae2d, z, args.tile, 0),
                     *diffusers_2d(vae2d, z, px[-1] if px else 128)))
        norms[name] = norm_errors(vae3d, z, args.tile, lows[0])
        print(f"{name}: done at {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
    lines += ["## Decode", ""] + table(
        ["photo", "variant", "tiles", "s", "plan peak MiB", "max abs", "PSNR dB"],
        [(n, v, g, f"{s:.1f}", mib(p), f"{e:.4f}", f"{q:.1f}") for n, v, g, s, p, e, q in dec]) + [""]
    lines += ["## Encode (latent: the posterior mode)", ""] + table(
        ["photo", "variant", "tiles", "s", "plan peak MiB", "max abs", "rel rms"],
        [(n, v, g, f"{s:.1f}", mib(p), f"{e:.4f}", f"{r:.2e}") for n, v, g, s, p, e, r in enc]) + [""]
    lines += [f"## 2-D fast mode on the same latent frames (embedded 2-D VAE, tile {args.tile}, default "
              "sample, each frame alone): with its low pass (fast_low=4, the default) and without "
              "(fast_low=0, as the 3-D estimator)", ""] + table(
        ["photo", "max abs, low pass", "PSNR dB, low pass", "max abs, none", "PSNR dB, none",
         f"2-D diffusers tiling {px[-1] if px else 128} px: max abs", "PSNR dB"],
        [(n, *(f"{v:.4f}" if i % 2 == 0 else f"{v:.1f}" for i, v in enumerate(r))) for n, *r in flat]) + [""]
    names = list(next(iter(norms.values())))
    lines += ["## Estimated GroupNorm statistics against the exact ones (decode, default sample, "
              f"fast_low {lows[0]})", "",
              "|mean error| / exact std ; |estimated std / exact std - 1|, the worst group:", ""] + table(
        ["GroupNorm"] + list(norms), [(g, *(f"{norms[n][g][0]:.4f} ; {norms[n][g][1]:.4f}" for n in norms))
                                      for g in names]) + [""]
    lines.append(f"Total {time.perf_counter() - started:.0f} s.")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
