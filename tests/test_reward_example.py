"""examples/reward_step.py, tiny: one reward fine-tuning step through a TiledDenoiser changes the LoRA."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "reward_step.py"


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("reward_step", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_one_reward_step_moves_the_lora_and_reaches_the_latent(example):
    from tilewise.models import load_default_pipeline

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        pipe = load_default_pipeline()
        out = example.reward_step(pipe, size=64, tile=4, overlap=2, rank=2, lr=1e-2)
    finally:
        torch.set_num_threads(n)
    assert out["tiles"] == 9  # 8 x 8 latent, 4 x 4 tiles overlapping by 2
    assert torch.isfinite(torch.tensor(out["loss"])) and out["reward"] > 0
    assert 0 < out["latent_grad_norm"] < float("inf") and out["lora_grad_norm"] > 0
    assert out["lora_change"] > 1e-4  # Adam's first step moves a parameter with a gradient by ~lr
    lora = [m for m in pipe.unet.modules() if isinstance(m, example.LoRALinear)]
    attn = [m for m in pipe.unet.modules() if type(m).__name__ == "Attention"]
    assert len(lora) == 4 * len(attn) > 0  # to_q, to_k, to_v, to_out.0 of every attention
    assert all(not p.requires_grad for n, p in pipe.unet.named_parameters() if ".base." in n)


def test_the_lora_starts_as_the_model(example):
    """up = 0: the LoRA-wrapped UNet predicts what the UNet did (then only the optimiser changes it)."""
    from tilewise.models import load_default_unet

    unet = load_default_unet()
    x, emb = torch.randn(1, 4, 8, 8), torch.randn(1, 4, unet.config.cross_attention_dim)
    with torch.no_grad():
        want = unet(x, 10, encoder_hidden_states=emb).sample
        example.add_lora(unet, rank=2)
        got = unet(x, 10, encoder_hidden_states=emb).sample
    assert torch.equal(got, want)


def test_bad_sizes_are_refused(example):
    with pytest.raises(ValueError, match="size must be a multiple of the VAE's factor 8, got 60"):
        example.reward_step(None, size=60)
