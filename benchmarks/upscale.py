"""Upscale x2 on real photographs: plain re-noising vs tiled DDIM noise inversion vs the tile ControlNet.

Data: crops of the held-out strips (the right-most 20 % of the columns, which no training crop touched)
of scikit-image's bundled photographs; each crop (the ground truth) is area-downsampled 2x to give the
input, and `tw.upscale(..., scale=2)` brings it back with the embedded model (VAE, UNet, tile ControlNet),
all variants at the same strength, steps, prompt (the picture's word), seed and tiles:

- lanczos: the Lanczos-resized input alone (what every variant starts from);
- vae round trip: that image encoded and decoded by the embedded VAE, no denoising (the ceiling every
  diffusion variant is under: the small VAE's own reconstruction error);
- re-noise: stock img2img, fresh noise at `strength`;
- inversion: the encoded input DDIM-inverted (as many steps as the denoising runs) instead of noise;
- controlnet: re-noise with the embedded tile ControlNet fed each tile's crop of the resized input;
- controlnet+inversion: both.

PSNR (dB, [0, 1] range) and SSIM (scikit-image, data_range 1) against the Lanczos-resized input (fidelity
to the input) and against the ground-truth crop, and seconds per upscale, side by side in one run.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/upscale.py --out benchmarks/results_upscale.md
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import numpy as np
import torch

import tilewise as tw
from tilewise.diffusion.upscale import lanczos_resize
from tilewise.models import default_prompt_embeds, load_default_controlnet, load_default_pipeline

PHOTOS = {"astronaut": "astronaut", "coffee": "coffee", "chelsea": "cat", "rocket": "rocket",
          "brick": "brick"}  # skimage.data loader -> the word the embedded model knows it by
VARIANTS = ("lanczos", "vae round trip", "re-noise", "inversion", "controlnet", "controlnet+inversion")


def crops(name: str, size: int, per_photo: int) -> list[torch.Tensor]:
    """Evenly spaced size x size crops of the picture's held-out strip, (3, size, size) in [0, 1]."""
    import skimage.data

    im = np.asarray(getattr(skimage.data, name)())
    im = np.repeat(im[..., None], 3, axis=2) if im.ndim == 2 else im[..., :3]
    strip = im[:, int(round(im.shape[1] * 0.8)):]
    x0 = (strip.shape[1] - size) // 2
    out = []
    for y in np.linspace(0, strip.shape[0] - size, per_photo).astype(int):
        out.append(torch.from_numpy(strip[y:y + size, x0:x0 + size].copy()).permute(2, 0, 1).float() / 255)
    return out


def scores(img: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    from skimage.metrics import structural_similarity

    a, b = img.squeeze(0).permute(1, 2, 0).numpy(), ref.squeeze(0).permute(1, 2, 0).numpy()
    mse = float(((a - b) ** 2).mean())
    psnr = 10 * np.log10(1.0 / mse) if mse > 0 else float("inf")
    return psnr, float(structural_similarity(a, b, channel_axis=2, data_range=1.0))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", type=int, default=80, help="ground-truth crop side, px (input: half)")
    ap.add_argument("--per-photo", type=int, default=2)
    ap.add_argument("--strength", type=float, nargs="+", default=[0.3, 0.5])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--tile", type=int, default=8)
    ap.add_argument("--overlap", type=int, default=4)
    ap.add_argument("--guidance", type=float, default=4.0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    pipe = load_default_pipeline()
    controlnet = load_default_controlnet()
    data = [(word, gt) for name, word in PHOTOS.items() for gt in crops(name, args.size, args.per_photo)]
    rows = []
    for strength in args.strength:
        k = int(args.steps * strength)
        results = {v: {"in": [], "gt": [], "s": []} for v in VARIANTS}
        for word, gt in data:
            small = torch.nn.functional.interpolate(gt[None], scale_factor=0.5, mode="area")[0]
            resized = lanczos_resize(small[None], tuple(gt.shape[-2:]))
            kw = dict(scale=2, strength=strength, tile_size=args.tile, overlap=args.overlap, method="mixture",
                      num_inference_steps=args.steps, guidance_scale=args.guidance, disable=True, seed=0,
                      **default_prompt_embeds(pipe, word))
            for v in VARIANTS:
                t0 = time.perf_counter()
                if v == "lanczos":
                    out = resized
                elif v == "vae round trip":
                    with torch.no_grad():
                        z = pipe.vae.encode(resized * 2 - 1).latent_dist.mode()
                        out = (pipe.vae.decode(z).sample / 2 + 0.5).clamp(0, 1)
                else:
                    extra = {}
                    if "controlnet" in v:
                        extra["controlnet"] = controlnet
                    if "inversion" in v:
                        extra["inversion_steps"] = k
                    out = tw.upscale(pipe, small, **kw, **extra)
                results[v]["s"].append(time.perf_counter() - t0)
                for key, ref in (("in", resized), ("gt", gt[None])):
                    results[v][key].append(scores(out, ref))
        for v in VARIANTS:
            r = results[v]
            means = [statistics.mean(p[i] for p in r[key]) for key in ("in", "gt") for i in (0, 1)]
            rows.append((strength, v, *means, statistics.median(r["s"])))
        print(f"strength {strength} done", file=sys.stderr)
    lines = [
        f"{len(data)} held-out crops ({args.size}x{args.size} px ground truth, input {args.size // 2} px, "
        f"{', '.join(PHOTOS)}), upscale x2, {args.steps} DDIM steps x strength, tile {args.tile} overlap "
        f"{args.overlap} (latent px, mixture), guidance {args.guidance}, seed 0, embedded model + tile "
        f"ControlNet, torch {torch.__version__}, {os.environ.get('OMP_NUM_THREADS', 'all')} thread(s), "
        f"{platform.machine()}",
        "",
        "| strength | variant | PSNR vs Lanczos input (dB) | SSIM vs Lanczos input "
        "| PSNR vs ground truth (dB) | SSIM vs ground truth | s / upscale (median) |",
        "|---|---|---|---|---|---|---|",
    ]
    for s, v, p_in, s_in, p_gt, s_gt, sec in rows:
        lines.append(f"| {s} | {v} | {p_in:.2f} | {s_in:.3f} | {p_gt:.2f} | {s_gt:.3f} | {sec:.2f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
