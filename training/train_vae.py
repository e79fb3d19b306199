"""Train the embedded default VAE: a narrow AutoencoderKL (SD layout, 8x downsampling, 4 latent channels).

Objective: L1 + L2 reconstruction + a small KL term (weight --kl), Adam with warm-up and cosine decay,
on random 64-128 px crops (resized to 64 px, random horizontal flips) of the training part of each
scikit-image picture. Evaluation: PSNR on fixed crops of the held-out strips (see data.py).

    python training/train_vae.py            # ~10 minutes on one CPU core
"""

from __future__ import annotations

import argparse
import logging
import math
import time

import torch
from common import MODELS_DIR, RUNS_DIR, load_weights, public_config, save_json, save_weights, seed_everything
from data import heldout_crops, load_images, psnr, random_crop, split

logger = logging.getLogger("train_vae")

VAE_CONFIG = dict(
    in_channels=3, out_channels=3, latent_channels=4,
    down_block_types=["DownEncoderBlock2D"] * 4, up_block_types=["UpDecoderBlock2D"] * 4,
    block_out_channels=[32, 64, 64, 64], layers_per_block=1, norm_num_groups=16, act_fn="silu",
    sample_size=64,
)


def lr_at(step: int, steps: int, lr: float, warmup: int = 50) -> float:
    """Linear warm-up then cosine decay to lr / 20."""
    if step < warmup:
        return lr * (step + 1) / warmup
    p = (step - warmup) / max(1, steps - warmup)
    return lr / 20 + (lr - lr / 20) * 0.5 * (1 + math.cos(math.pi * p))


@torch.no_grad()
def evaluate(vae, crops: torch.Tensor) -> float:
    """PSNR (dB) of encode(mean) -> decode on the held-out crops."""
    vae.eval()
    rec = torch.cat([vae.decode(vae.encode(c[None]).latent_dist.mode()).sample for c in crops])
    vae.train()
    return psnr(rec, crops)


@torch.no_grad()
def latent_std(vae, images, rng, n: int = 256) -> float:
    """Standard deviation of latent means over random training crops (sets scaling_factor = 1 / std)."""
    vae.eval()
    parts = [split(im)[0] for im in images.values()]
    x = torch.stack([random_crop(parts[i % len(parts)], rng) for i in range(n)])
    z = torch.cat([vae.encode(b).latent_dist.mode() for b in x.split(32)])
    return float(z.std())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=1200)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--kl", type=float, default=1e-6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=str(MODELS_DIR))
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    from pathlib import Path

    from diffusers import AutoencoderKL

    rng = seed_everything(args.seed, args.threads)
    images = load_images()
    parts = [split(im)[0] for im in images.values()]
    crops = heldout_crops(images)
    vae = AutoencoderKL(**VAE_CONFIG)
    opt = torch.optim.Adam(vae.parameters(), lr=args.lr)
    t0, log = time.time(), []
    for step in range(args.steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, args.steps, args.lr)
        x = torch.stack([random_crop(parts[int(rng.integers(len(parts)))], rng) for _ in range(args.batch)])
        post = vae.encode(x).latent_dist
        y = vae.decode(post.sample()).sample
        rec = (y - x).abs().mean() + ((y - x) ** 2).mean()
        loss = rec + args.kl * post.kl().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % 100 == 0 or step == args.steps - 1:
            log.append({"step": step, "loss": loss.item(), "rec": rec.item(), "seconds": time.time() - t0})
            logger.info("step %d loss %.4f rec %.4f (%.0f s)", step, loss.item(), rec.item(),
                        time.time() - t0)
    train_s = time.time() - t0
    out = Path(args.out)
    std = latent_std(vae, images, rng)
    config = public_config(vae.config) | {"scaling_factor": round(1.0 / std, 5)}
    save_json(config, out / "vae.json")
    save_weights(vae, out / "vae.safetensors")
    # evaluate the weights exactly as shipped (float16 storage, loaded back into float32)
    shipped = load_weights(AutoencoderKL(**config), out / "vae.safetensors")
    metrics = {
        "steps": args.steps, "batch": args.batch, "crop": "64-128 px resized to 64, h-flips",
        "seed": args.seed, "threads": args.threads, "train_seconds": round(train_s, 1),
        "params": sum(p.numel() for p in vae.parameters()), "latent_std": std,
        "heldout_crops": int(crops.shape[0]), "heldout_psnr_db": round(evaluate(shipped, crops), 3),
        "train_fraction_columns": 0.8, "log": log,
    }
    save_json(metrics, (RUNS_DIR if out == MODELS_DIR else out) / "vae_metrics.json")
    logger.info("held-out PSNR %.2f dB, scaling_factor %.4f, %.0f s", metrics["heldout_psnr_db"],
                config["scaling_factor"], train_s)


if __name__ == "__main__":
    main()
