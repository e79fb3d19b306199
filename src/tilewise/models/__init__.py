"""Embedded default models: a narrow AutoencoderKL, a small UNet2DConditionModel and a word-lookup text
encoder, trained on CPU from scikit-image's bundled pictures (see MODEL_CARD.md and training/).

They run through the same diffusers code paths as Stable Diffusion: `load_default_pipeline` returns a
real `StableDiffusionPipeline`. Its `text_encoder`/`tokenizer` slots are None (diffusers' prompt path is
CLIP-specific), so prompts go in as embeddings: `pipe(**default_prompt_embeds(pipe, "grass"), ...)`.
Weights are read with safetensors (no pickle); torch, diffusers and `.words` (torch) are imported only when
called, so that `import tilewise.models` imports neither torch nor diffusers (tests/test_models.py checks it).
"""

from __future__ import annotations

import json
import logging
from functools import lru_cache
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

MODEL_DIR = Path(__file__).resolve().parent
SCHEDULERS = {
    "ddim": "DDIMScheduler",
    "ddpm": "DDPMScheduler",
    "pndm": "PNDMScheduler",
    "euler": "EulerDiscreteScheduler",
    "euler_a": "EulerAncestralDiscreteScheduler",
    "dpm": "DPMSolverMultistepScheduler",
}

__all__ = [
    "MODEL_DIR", "SCHEDULERS", "load_config", "load_default_vae", "load_default_unet",
    "load_default_text_encoder", "load_default_tokenizer", "load_default_scheduler", "encode_prompt",
    "load_default_pipeline", "default_prompt_embeds", "vocabulary", "load_default_controlnet",
]


def load_config(name: str) -> dict[str, Any]:
    """The committed JSON config of one part: 'vae', 'unet', 'text_encoder' or 'scheduler'."""
    path = MODEL_DIR / f"{name}.json"
    if not path.is_file():
        valid = sorted(p.stem for p in MODEL_DIR.glob("*.json"))
        raise ValueError(f"no embedded model config {name!r} (looked for {path}); valid: {valid}")
    return json.loads(path.read_text())


def _dtype(dtype):
    import torch

    if dtype is None:
        return torch.float32
    if isinstance(dtype, str):
        names = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16,
                 "fp16": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
        if dtype not in names:
            raise ValueError(f"dtype must be one of {sorted(names)} or a torch.dtype, got {dtype!r}")
        return names[dtype]
    return dtype


def _load_weights(module, name: str, device, dtype):
    """Load `<name>.safetensors` (strict, no pickle) into `module`; move to device/dtype; eval mode."""
    from safetensors.torch import load_file

    state = load_file(str(MODEL_DIR / f"{name}.safetensors"))
    module.load_state_dict({k: v.float() for k, v in state.items()}, strict=True)
    module = module.to(device=device or "cpu")
    dtype = _dtype(dtype)
    if dtype != next(module.parameters()).dtype:
        module = module.to(dtype=dtype)
    return module.eval().requires_grad_(False)


def load_default_vae(device=None, dtype=None):
    """The embedded AutoencoderKL (8x downsampling, 4 latent channels, scaling_factor in its config)."""
    from diffusers import AutoencoderKL

    return _load_weights(AutoencoderKL.from_config(load_config("vae")), "vae", device, dtype)


def load_default_unet(device=None, dtype=None):
    """The embedded UNet2DConditionModel (epsilon prediction, cross-attention over word embeddings)."""
    from diffusers import UNet2DConditionModel

    return _load_weights(UNet2DConditionModel.from_config(load_config("unet")), "unet", device, dtype)


def load_default_controlnet(device=None, dtype=None):
    """The embedded tile ControlNet (ControlNetModel from the UNet's encoder, conditioned on the blurred
    image in [0, 1]: what `tw.upscale(..., controlnet=...)` feeds it), trained by
    training/train_controlnet.py."""
    from diffusers import ControlNetModel

    model = ControlNetModel.from_config(load_config("controlnet_tile"))
    return _load_weights(model, "controlnet_tile", device, dtype)


def load_default_tokenizer():
    """The embedded closed-vocabulary word tokenizer."""
    from .words import WordTokenizer

    cfg = load_config("text_encoder")
    return WordTokenizer(cfg["vocab"], cfg["max_length"])


def vocabulary() -> list[str]:
    """The words the embedded model knows (without the padding token)."""
    return list(load_config("text_encoder")["vocab"][1:])


def load_default_text_encoder(device=None, dtype=None):
    """The embedded lookup text encoder: token ids (B, L) -> embeddings (B, L, cross_attention_dim)."""
    from .words import WordEncoder

    cfg = load_config("text_encoder")
    module = WordEncoder(len(cfg["vocab"]), cfg["max_length"], cfg["dim"])
    return _load_weights(module, "text_encoder", device, dtype)


@lru_cache(maxsize=4)
def _cached_text_encoder(device: str, dtype):
    return load_default_text_encoder(device, dtype)


def encode_prompt(text: str | list[str], device=None, dtype=None):
    """Prompt(s) -> prompt_embeds (B, max_length, dim); '' is the unconditional (all-padding) prompt."""
    import torch

    ids = load_default_tokenizer()(text)
    encoder = _cached_text_encoder(str(torch.device(device or "cpu")), _dtype(dtype))
    with torch.no_grad():
        return encoder(ids.to(device or "cpu"))


def load_default_scheduler(name: str = "ddim"):
    """A diffusers scheduler built from the training noise schedule (scaled-linear betas, 1000 steps)."""
    import diffusers

    if name not in SCHEDULERS:
        raise ValueError(f"scheduler must be one of {sorted(SCHEDULERS)}, got {name!r}")
    return getattr(diffusers, SCHEDULERS[name]).from_config(load_config("scheduler"))


def load_default_pipeline(scheduler: str = "ddim", device=None, dtype=None):
    """A real diffusers StableDiffusionPipeline over the embedded VAE and UNet (no text encoder slot)."""
    from diffusers import StableDiffusionPipeline

    pipe = StableDiffusionPipeline(
        vae=load_default_vae(device, dtype), text_encoder=None, tokenizer=None,
        unet=load_default_unet(device, dtype), scheduler=load_default_scheduler(scheduler),
        safety_checker=None, feature_extractor=None, requires_safety_checker=False,
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def default_prompt_embeds(pipe, prompt: str | list[str], negative: str | list[str] = "") -> dict[str, Any]:
    """Keyword arguments {prompt_embeds, negative_prompt_embeds} for `pipe(...)` on the UNet's device."""
    prompts = [prompt] if isinstance(prompt, str) else list(prompt)
    negatives = [negative] * len(prompts) if isinstance(negative, str) else list(negative)
    if len(negatives) != len(prompts):
        raise ValueError(f"got {len(prompts)} prompts but {len(negatives)} negative prompts; give one each "
                         f"or a single string")
    device, dtype = pipe.unet.device, pipe.unet.dtype
    return {"prompt_embeds": encode_prompt(prompts, device, dtype),
            "negative_prompt_embeds": encode_prompt(negatives, device, dtype)}
