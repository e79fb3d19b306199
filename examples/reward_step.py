"""One reward fine-tuning step at high resolution through a tiled denoiser (issue #30).

A differentiable image score (the colourfulness of Hasler and Suesstrunk 2003, on the decoded image) is
pushed back through the VAE decoder and a TiledDenoiser to the latent and to a LoRA on the denoiser's
attention projections, and one optimiser step updates the LoRA. The denoiser's backward holds one
tile's activations at a time (`backward="recompute"`), so the denoiser's part of the step costs one
tile's memory at any resolution; the decode is a `tw.TiledVAE`'s, whose backward is the reverse tile
program (exact, bounded: docs/gradients.md).

Runs on CPU with the embedded model (`tilewise.models`: a small SD-style UNet and VAE, no download):

    python examples/reward_step.py --size 512 --tile 32 --overlap 8
    python examples/reward_step.py --size 128 --rank 4 --lr 1e-2   # seconds

The LoRA is hand-made (no peft needed): each attention projection `to_q`, `to_k`, `to_v`, `to_out.0`
becomes `base(x) + (alpha / rank) * up(down(x))` with `up` zero at the start, as LoRA (Hu et al. 2021)
initialises it, so the first step changes the model only through the optimiser.
"""

from __future__ import annotations

import argparse
import math
import time

import torch

import tilewise as tw

PROJECTIONS = ("to_q", "to_k", "to_v", "to_out.0")


class LoRALinear(torch.nn.Module):
    """y = base(x) + (alpha / rank) * up(down(x)) (LoRA, Hu et al. 2021); base frozen, up zero at start."""

    def __init__(self, base: torch.nn.Linear, rank: int, alpha: float = 1.0) -> None:
        super().__init__()
        self.base, self.scale = base, alpha / rank
        self.down = torch.nn.Linear(base.in_features, rank, bias=False)
        self.up = torch.nn.Linear(rank, base.out_features, bias=False)
        torch.nn.init.kaiming_uniform_(self.down.weight, a=math.sqrt(5))
        torch.nn.init.zeros_(self.up.weight)
        self.to(base.weight.device, base.weight.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.scale * self.up(self.down(x))


def add_lora(unet: torch.nn.Module, rank: int = 4, alpha: float = 1.0) -> list[torch.nn.Parameter]:
    """Every attention projection of `unet` wrapped in a LoRALinear; the model frozen; the LoRA's
    parameters returned (the only ones that require grad)."""
    unet.requires_grad_(False)
    targets = [(name, m) for name, m in unet.named_modules()
               if any(name.endswith("." + p) for p in PROJECTIONS) and isinstance(m, torch.nn.Linear)]
    if not targets:
        raise ValueError(f"no attention projection ({', '.join(PROJECTIONS)}) in {type(unet).__name__}")
    params = []
    for name, module in targets:
        parent, _, child = name.rpartition(".")
        lora = LoRALinear(module, rank, alpha)
        unet.get_submodule(parent).register_module(child, lora)
        params += [lora.down.weight, lora.up.weight]
    return params


def colourfulness(image: torch.Tensor) -> torch.Tensor:
    """Hasler and Suesstrunk (2003) colourfulness M = sigma_rgyb + 0.3 mu_rgyb of (B, 3, H, W) images in
    [-1, 1], averaged over the batch: differentiable everywhere but where an opponent channel is flat."""
    r, g, b = ((image.clamp(-1, 1) + 1) * 127.5).unbind(1)
    rg, yb = r - g, 0.5 * (r + g) - b
    sigma = torch.sqrt(rg.var(dim=(-2, -1)) + yb.var(dim=(-2, -1)) + 1e-6)
    mu = torch.sqrt(rg.mean(dim=(-2, -1)) ** 2 + yb.mean(dim=(-2, -1)) ** 2 + 1e-6)
    return (sigma + 0.3 * mu).mean()


def decoder(vae, tile: int = 32):
    """The differentiable decode, exact and tiled (its backward is the reverse tile program: one tile's
    activations at a time): latents -> images in [-1, 1]."""
    tv = tw.TiledVAE(vae, tile_size=tile, progress=False)
    return lambda z: tv.decode(z / vae.config.scaling_factor).sample


def reward_step(pipe, size: int = 512, tile: int = 32, overlap: int = 8, rank: int = 4, lr: float = 1e-2,
                timestep: int = 500, prompt: str = "grass", seed: int = 0) -> dict:
    """One step of reward fine-tuning: the latent's x0 prediction through the tiled denoiser, decoded and
    scored; the score's gradient to the latent and to the LoRA; one Adam step on the LoRA."""
    from tilewise.models import default_prompt_embeds

    if size % 8:
        raise ValueError(f"size must be a multiple of the VAE's factor 8, got {size}")
    unet = pipe.unet.unet if isinstance(pipe.unet, tw.TiledDenoiser) else pipe.unet
    params = add_lora(unet, rank)
    denoiser = tw.TiledDenoiser(unet, tile_size=tile, overlap=overlap, method="mixture",
                                backward="recompute")
    decode = decoder(pipe.vae, tile)
    emb = default_prompt_embeds(pipe, prompt)["prompt_embeds"]
    g = torch.Generator().manual_seed(seed)
    x0 = torch.randn(1, 4, size // 8, size // 8, generator=g)
    noise = torch.randn(x0.shape, generator=g)
    a = pipe.scheduler.alphas_cumprod[timestep]
    z_t = (a.sqrt() * x0 + (1 - a).sqrt() * noise).requires_grad_()  # the noisy latent: a gradient too
    before = [p.detach().clone() for p in params]
    t0 = time.perf_counter()
    eps = denoiser(z_t, timestep, encoder_hidden_states=emb).sample
    x0_hat = (z_t - (1 - a).sqrt() * eps) / a.sqrt()  # DDPM's x0 from the noise prediction
    reward = colourfulness(decode(x0_hat))
    loss = -reward
    opt = torch.optim.Adam(params, lr=lr)
    opt.zero_grad()
    loss.backward()
    grad_norm = float(torch.sqrt(sum((p.grad ** 2).sum() for p in params)))
    opt.step()
    return dict(reward=float(reward.detach()), loss=float(loss.detach()),
                tiles=denoiser.count(*x0.shape[-2:]),
                latent_grad_norm=float(z_t.grad.norm()), lora_grad_norm=grad_norm,
                lora_change=max(float((p.detach() - b).abs().max()) for p, b in zip(params, before)),
                seconds=time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--size", type=int, default=512, help="image side in pixels (a multiple of 8)")
    ap.add_argument("--tile", type=int, default=32, help="denoiser tile side in latent pixels")
    ap.add_argument("--overlap", type=int, default=8, help="tile overlap in latent pixels")
    ap.add_argument("--rank", type=int, default=4, help="LoRA rank")
    ap.add_argument("--lr", type=float, default=1e-2, help="Adam learning rate")
    ap.add_argument("--timestep", type=int, default=500, help="diffusion timestep of the noisy latent")
    ap.add_argument("--prompt", default="grass", help="a word of the embedded model's vocabulary")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    from tilewise.models import load_default_pipeline

    out = reward_step(load_default_pipeline(), args.size, args.tile, args.overlap, args.rank, args.lr,
                      args.timestep, args.prompt, args.seed)
    print(", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in out.items()))
    return out


if __name__ == "__main__":
    main()
