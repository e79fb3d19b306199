"""Train the embedded default denoiser: a small UNet2DConditionModel plus its word-lookup text encoder.

Data: latents (VAE mean x scaling_factor) of random 128-256 px crops resized to 128 px (random
horizontal flips) of the training part of each scikit-image picture, encoded once by the trained VAE
(run train_vae.py first). Prompt: a random template around a word naming the picture; with probability
--uncond the prompt is '' (classifier-free guidance dropout). Objective: DDPM epsilon prediction, MSE,
on SD's scaled-linear schedule (1000 steps). Adam with warm-up and cosine decay.

    python training/train_unet.py           # ~12 minutes on one CPU core
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path

import torch
from common import (
    MODELS_DIR,
    RUNS_DIR,
    clipped_step,
    denoiser_args,
    load_weights,
    public_config,
    save_json,
    save_weights,
    seed_everything,
)
from data import IMAGES, TEMPLATES, load_images, random_crop, split
from train_vae import lr_at

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from tilewise.models.words import PAD, WordEncoder, WordTokenizer  # noqa: E402

logger = logging.getLogger("train_unet")

FILLER = ("a", "of", "photo", "texture", "and")
VOCAB = [PAD, *FILLER, *dict.fromkeys(w for words in IMAGES.values() for w in words)]
MAX_TOKENS = 8
DIM = 64
UNET_CONFIG = dict(
    sample_size=16, in_channels=4, out_channels=4, layers_per_block=1,
    block_out_channels=[32, 64], norm_num_groups=16,
    down_block_types=["CrossAttnDownBlock2D", "CrossAttnDownBlock2D"],
    up_block_types=["CrossAttnUpBlock2D", "CrossAttnUpBlock2D"],
    cross_attention_dim=DIM, attention_head_dim=8,
)
SCHEDULER_CONFIG = dict(
    num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
    prediction_type="epsilon", steps_offset=1, clip_sample=False, set_alpha_to_one=False,
    timestep_spacing="leading",
)


@torch.no_grad()
def latent_bank(vae, images, rng, n: int, size: int = 128, keep_crops: bool = False):
    """Encode n random training crops once: (latents (n, 4, size/8, size/8), class index per latent[, the
    crops (n, 3, size, size) in [-1, 1]])."""
    names = list(images)
    parts = [split(images[k])[0] for k in names]
    labels = torch.tensor([i % len(names) for i in range(n)])
    x = torch.stack([random_crop(parts[int(i)], rng, out=size, lo=size, hi=2 * size) for i in labels])
    sf = vae.config.scaling_factor
    z = torch.cat([vae.encode(b).latent_dist.mode() * sf for b in x.split(32)])
    return (z, labels, x) if keep_crops else (z, labels)


def random_prompt(name: str, rng) -> str:
    """A training prompt for picture `name`: one of its words in one of the templates."""
    words = IMAGES[name]
    return TEMPLATES[int(rng.integers(len(TEMPLATES)))].format(w=words[int(rng.integers(len(words)))])


def noised_batch(bank, labels, names, rng, batch: int, uncond: float, sched):
    """A batch of the DDPM objective: (indices into the bank, z_t, t, eps, prompts)."""
    idx = torch.from_numpy(rng.integers(0, len(bank), batch))
    z0 = bank[idx]
    prompts = ["" if rng.random() < uncond else random_prompt(names[int(labels[i])], rng) for i in idx]
    eps = torch.randn_like(z0)
    t = torch.randint(0, SCHEDULER_CONFIG["num_train_timesteps"], (batch,))
    return idx, sched.add_noise(z0, eps, t), t, eps, prompts


def main() -> None:
    args = denoiser_args(__doc__, steps=1600, batch=16, bank=1600, uncond=0.1,
                         uncond_help="classifier-free dropout probability")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    from diffusers import AutoencoderKL, DDPMScheduler, UNet2DConditionModel

    out = Path(args.out)
    rng = seed_everything(args.seed, args.threads)
    images = load_images()
    names = list(images)
    vae = load_weights(AutoencoderKL.from_config(json_load(out / "vae.json")), out / "vae.safetensors").eval()
    t0 = time.time()
    bank, labels = latent_bank(vae, images, rng, args.bank)
    bank_s = time.time() - t0
    logger.info("encoded %d crops in %.0f s, latent std %.3f", len(bank), bank_s, float(bank.std()))

    tokenizer = WordTokenizer(VOCAB, MAX_TOKENS)
    encoder = WordEncoder(len(VOCAB), MAX_TOKENS, DIM)
    unet = UNet2DConditionModel(**UNET_CONFIG)
    sched = DDPMScheduler.from_config(SCHEDULER_CONFIG)
    params = list(unet.parameters()) + list(encoder.parameters())
    opt = torch.optim.Adam(params, lr=args.lr)
    t0, log = time.time(), []
    for step in range(args.steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, args.steps, args.lr)
        _, zt, t, eps, prompts = noised_batch(bank, labels, names, rng, args.batch, args.uncond, sched)
        pred = unet(zt, t, encoder_hidden_states=encoder(tokenizer(prompts))).sample
        loss = ((pred - eps) ** 2).mean()
        clipped_step(opt, loss, params)
        if step % 100 == 0 or step == args.steps - 1:
            log.append({"step": step, "loss": loss.item(), "seconds": time.time() - t0})
            logger.info("step %d loss %.4f (%.0f s)", step, loss.item(), time.time() - t0)
    train_s = time.time() - t0
    save_json(public_config(unet.config), out / "unet.json")
    save_json({"vocab": VOCAB, "max_length": MAX_TOKENS, "dim": DIM}, out / "text_encoder.json")
    save_json(SCHEDULER_CONFIG | {"_class_name": "DDPMScheduler"}, out / "scheduler.json")
    save_weights(unet, out / "unet.safetensors")
    save_weights(encoder, out / "text_encoder.safetensors")
    tail = [e["loss"] for e in log[-5:]]
    metrics = {
        "steps": args.steps, "batch": args.batch, "bank": args.bank, "uncond": args.uncond,
        "crop": "128-256 px resized to 128 (16x16 latents), h-flips", "seed": args.seed,
        "threads": args.threads, "bank_seconds": round(bank_s, 1), "train_seconds": round(train_s, 1),
        "unet_params": sum(p.numel() for p in unet.parameters()),
        "text_encoder_params": sum(p.numel() for p in encoder.parameters()),
        "final_loss_mean_last5_logs": sum(tail) / len(tail), "log": log,
    }
    save_json(metrics, (RUNS_DIR if out == MODELS_DIR else out) / "unet_metrics.json")
    logger.info("done: %.0f s, final loss %.4f", train_s, metrics["final_loss_mean_last5_logs"])


def json_load(path: Path) -> dict:
    import json

    return json.loads(path.read_text())


if __name__ == "__main__":
    main()
