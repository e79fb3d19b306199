"""Tiny stock pipelines (no download) for every denoiser family TiledDenoiser tiles, images and video.

Real diffusers classes from tiny configs with seeded random weights; no text encoders (the pipelines take
prompt embeddings), the smallest VAEs each pipeline accepts. `CASES[name]` is a `Case`: `build()` ->
(pipe, call kwargs), the pipeline's denoiser attribute, the latent size the call makes, and how the
pipeline's output is read (`latent(out)`). Families whose pipeline needs a text encoder that cannot be
built small are called as their pipeline calls the denoiser (`Case.direct`: (model, inputs)). No tests.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

D = 16  # text embedding width


def g(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def rand(*shape, seed: int = 7) -> torch.Tensor:
    return torch.randn(*shape, generator=g(seed))


@dataclass
class Case:
    """One family's stock pipeline call (or direct call, `direct=True`), and where its denoiser sits."""

    build: Callable
    slot: str = "transformer"
    video: bool = True
    direct: bool = False
    steps: int = 1
    positions: bool = True  # the denoiser has positional inputs (test_each_tile_gets_the_positions...)
    tile_frames: int | None = 2  # frame windows in the positions test (video)
    extra: dict = field(default_factory=dict)  # keyword arguments of the pipeline call beyond build's


def seeded(cls, seed: int = 0, **config):
    torch.manual_seed(seed)
    return cls(**config).eval()


def flow():
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler()


# ---- video transformers -----------------------------------------------------------------------------------
def wan_vae():
    from video_vae_support import video_vae

    return video_vae("wan2.1")


def wan_transformer(cls_name: str = "WanTransformer3DModel", **extra):
    import diffusers

    return seeded(getattr(diffusers, cls_name), patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8,
                  in_channels=4, out_channels=4, text_dim=D, freq_dim=16, ffn_dim=32, num_layers=1,
                  rope_max_seq_len=32, **extra)


def wan():
    from diffusers import WanPipeline

    pipe = WanPipeline(tokenizer=None, text_encoder=None, vae=wan_vae(), transformer=wan_transformer(),
                       scheduler=flow())
    return pipe, dict(prompt_embeds=rand(1, 5, D), negative_prompt_embeds=rand(1, 5, D, seed=8),
                      guidance_scale=2.0, height=48, width=80, num_frames=9)


CASES: dict[str, Case] = {
    "wan": Case(wan),
}
