"""Train the embedded tile ControlNet: the embedded UNet's encoder copied into a ControlNet (`from_unet`),
conditioned on a blurred (2x down, Lanczos up) version of the image, as the tile ControlNets of SD 1.5
upscaling are.

Data: random 128-256 px crops resized to 128 px (random horizontal flips) of the training part of each
scikit-image picture, encoded once by the embedded VAE (mean x scaling_factor: 16x16 latents); the
control image of a crop is the crop area-downsampled to 64 px and Lanczos-resized back to 128 px, in
[0, 1] (what `tw.upscale(..., controlnet=...)` feeds each tile: the Lanczos-resized input). The UNet and
the text encoder are frozen; the ControlNet learns the DDPM epsilon objective (MSE) through the UNet's
residual inputs, on the same schedule, prompts and classifier-free dropout as train_unet.py.

    python training/train_controlnet.py     # run train_vae.py and train_unet.py first
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path

import common
import numpy as np
import torch
from common import MODELS_DIR, RUNS_DIR, clipped_step, load_weights
from data import load_images
from train_unet import SCHEDULER_CONFIG, json_load, latent_bank, noised_batch
from train_vae import lr_at

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from tilewise.diffusion.upscale import lanczos_resize  # noqa: E402
from tilewise.models.words import WordEncoder, WordTokenizer  # noqa: E402

logger = logging.getLogger("train_controlnet")
EMBEDDING_CHANNELS = (16, 16, 32, 32)  # the control image's 8x downsampling embedding (small)


def degrade(x: torch.Tensor) -> torch.Tensor:
    """[-1, 1] crops (N, 3, s, s) -> control images in [0, 1]: area-downsampled 2x, Lanczos-resized back."""
    s = x.shape[-1]
    low = torch.nn.functional.interpolate((x + 1) / 2, size=(s // 2, s // 2), mode="area")
    return lanczos_resize(low, (s, s))


@torch.no_grad()
def bank(vae, images, rng, n: int, size: int = 128):
    """n random training crops: (latents (n, 4, size/8, size/8), control images (n, 3, size, size),
    labels), the crops drawn as train_unet.py draws them."""
    z, labels, x = latent_bank(vae, images, rng, n, size, keep_crops=True)
    return z, degrade(x), labels


def main() -> None:
    args = common.denoiser_args(__doc__, steps=2000, batch=8, bank=1600, uncond=0.3,
                                uncond_help="empty-prompt probability (tile ControlNets get weak prompts)")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    from diffusers import AutoencoderKL, ControlNetModel, DDPMScheduler, UNet2DConditionModel

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rng = common.seed_everything(args.seed, args.threads)
    images = load_images()
    names = list(images)
    vae = load_weights(AutoencoderKL.from_config(json_load(MODELS_DIR / "vae.json")),
                       MODELS_DIR / "vae.safetensors").eval()
    unet = load_weights(UNet2DConditionModel.from_config(json_load(MODELS_DIR / "unet.json")),
                        MODELS_DIR / "unet.safetensors").eval().requires_grad_(False)
    cfg = json_load(MODELS_DIR / "text_encoder.json")
    tokenizer = WordTokenizer(cfg["vocab"], cfg["max_length"])
    encoder = load_weights(WordEncoder(len(cfg["vocab"]), cfg["max_length"], cfg["dim"]),
                           MODELS_DIR / "text_encoder.safetensors").eval().requires_grad_(False)
    t0 = time.time()
    z_bank, c_bank, labels = bank(vae, images, rng, args.bank)
    bank_s = time.time() - t0
    logger.info("encoded %d crops in %.0f s", len(z_bank), bank_s)

    controlnet = ControlNetModel.from_unet(unet, conditioning_embedding_out_channels=EMBEDDING_CHANNELS)
    controlnet.train()
    sched = DDPMScheduler.from_config(SCHEDULER_CONFIG)
    params = list(controlnet.parameters())
    opt = torch.optim.Adam(params, lr=args.lr)
    t0, log = time.time(), []
    for step in range(args.steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, args.steps, args.lr)
        idx, zt, t, eps, prompts = noised_batch(z_bank, labels, names, rng, args.batch, args.uncond, sched)
        control = c_bank[idx]
        emb = encoder(tokenizer(prompts))
        down, mid = controlnet(zt, t, encoder_hidden_states=emb, controlnet_cond=control, return_dict=False)
        pred = unet(zt, t, encoder_hidden_states=emb, down_block_additional_residuals=down,
                    mid_block_additional_residual=mid).sample
        loss = ((pred - eps) ** 2).mean()
        clipped_step(opt, loss, params)
        if step % 50 == 0 or step == args.steps - 1:
            log.append({"step": step, "loss": loss.item(), "seconds": time.time() - t0})
            logger.info("step %d loss %.4f (%.0f s)", step, loss.item(), time.time() - t0)
    train_s = time.time() - t0
    controlnet.eval()
    common.save_json(common.public_config(controlnet.config), out / "controlnet_tile.json")
    common.save_weights(controlnet, out / "controlnet_tile.safetensors")
    tail = [e["loss"] for e in log[-5:]]
    metrics = {
        "steps": args.steps, "batch": args.batch, "bank": args.bank, "uncond": args.uncond, "lr": args.lr,
        "control": "crop area-downsampled 2x, Lanczos-resized back, [0, 1]", "seed": args.seed,
        "threads": args.threads, "bank_seconds": round(bank_s, 1), "train_seconds": round(train_s, 1),
        "controlnet_params": sum(p.numel() for p in controlnet.parameters()),
        "final_loss_mean_last5_logs": float(np.mean(tail)), "log": log,
    }
    common.save_json(metrics, (RUNS_DIR if out == MODELS_DIR else out) / "controlnet_tile_metrics.json")
    logger.info("done: %.0f s, final loss %.4f", train_s, metrics["final_loss_mean_last5_logs"])


if __name__ == "__main__":
    main()
