"""Pictures and figures for MODEL_CARD.md, made through the shipped loaders (tilewise.models):

- samples.png: one 128 px image per class word, StableDiffusionPipeline + DDIM, 30 steps, CFG 4, seed 0;
- reconstructions.png: held-out crops (top) and their VAE reconstructions (bottom);
- runs/eval_metrics.json: held-out PSNR of the shipped VAE, per picture and overall.

    python training/samples.py
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

import numpy as np
import torch
from common import MODELS_DIR, RUNS_DIR, save_json, seed_everything
from data import IMAGES, heldout_crops, load_images, psnr

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from tilewise import models  # noqa: E402

logger = logging.getLogger("samples")


def to_uint8(x: torch.Tensor) -> np.ndarray:
    """(3, H, W) in [-1, 1] -> (H, W, 3) uint8."""
    return ((x.clamp(-1, 1) + 1) * 127.5).round().byte().permute(1, 2, 0).numpy()


def save_png(rows: list[list[np.ndarray]], path: Path) -> None:
    """Tile equally sized uint8 images into a grid PNG with 2 px white gaps; write atomically."""
    from PIL import Image

    h, w = rows[0][0].shape[:2]
    g = 2
    canvas = np.full((len(rows) * (h + g) - g, max(map(len, rows)) * (w + g) - g, 3), 255, np.uint8)
    for r, row in enumerate(rows):
        for c, im in enumerate(row):
            canvas[r * (h + g):r * (h + g) + h, c * (w + g):c * (w + g) + w] = im
    tmp = path.with_name(path.name + ".tmp.png")
    Image.fromarray(canvas).save(tmp, optimize=True)
    tmp.replace(path)


@torch.no_grad()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", type=int, default=128)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--guidance", type=float, default=4.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    seed_everything(args.seed, args.threads)

    images = load_images()
    crops = heldout_crops(images)
    vae = models.load_default_vae()
    rec = torch.cat([vae.decode(vae.encode(c[None]).latent_dist.mode()).sample for c in crops])
    per = {name: round(psnr(rec[4 * i:4 * i + 4], crops[4 * i:4 * i + 4]), 2)
           for i, name in enumerate(images)}
    metrics = {"heldout_psnr_db": round(psnr(rec, crops), 3), "per_picture_db": per,
               "crops": "4 per picture, 64 px, evenly spaced down the held-out right 20% strip"}
    logger.info("held-out PSNR %.2f dB %s", metrics["heldout_psnr_db"], per)
    pick = list(range(0, len(crops), 4))
    save_png([[to_uint8(crops[i]) for i in pick], [to_uint8(rec[i]) for i in pick]],
             MODELS_DIR / "reconstructions.png")

    pipe = models.load_default_pipeline("ddim")
    words = [v[0] for v in IMAGES.values()]
    t0 = time.time()
    out = []
    for w in words:
        g = torch.Generator().manual_seed(args.seed)
        im = pipe(**models.default_prompt_embeds(pipe, w), height=args.size, width=args.size,
                  num_inference_steps=args.steps, guidance_scale=args.guidance, generator=g,
                  output_type="pt").images[0]
        out.append(to_uint8(im * 2 - 1))
    metrics["sample_seconds_per_image"] = round((time.time() - t0) / len(words), 2)
    metrics["sample_words"] = words
    metrics["sample_settings"] = {"size": args.size, "steps": args.steps, "guidance": args.guidance,
                                  "scheduler": "ddim", "seed": args.seed}
    save_png([out[:5], out[5:]], MODELS_DIR / "samples.png")
    save_json(metrics, RUNS_DIR / "eval_metrics.json")
    logger.info("samples: %.1f s per image", metrics["sample_seconds_per_image"])


if __name__ == "__main__":
    main()
