"""Loading a pipeline: the embedded default, a local diffusers folder, or one checkpoint file; `Loaded`."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .single_file import load_single_file

DTYPES = ("float32", "float16", "bfloat16")


@dataclass
class Loaded:
    """A pipeline and how to turn text into its conditioning."""

    pipe: Any
    source: str
    embedded: bool
    sdxl: bool

    def encode(self, prompt: str, negative: str = "") -> dict[str, Any]:
        """{prompt_embeds, negative_prompt_embeds[, pooled_prompt_embeds, negative_pooled_prompt_embeds]}."""
        if self.embedded:
            from ..models import default_prompt_embeds

            return default_prompt_embeds(self.pipe, prompt, negative)
        device = self.pipe.unet.device
        if self.sdxl:
            pe, npe, ppe, nppe = self.pipe.encode_prompt(
                prompt,
                device=device,
                num_images_per_prompt=1,
                do_classifier_free_guidance=True,
                negative_prompt=negative,
            )
            return {
                "prompt_embeds": pe,
                "negative_prompt_embeds": npe,
                "pooled_prompt_embeds": ppe,
                "negative_pooled_prompt_embeds": nppe,
            }
        pe, npe = self.pipe.encode_prompt(prompt, device, 1, True, negative_prompt=negative)
        return {"prompt_embeds": pe, "negative_prompt_embeds": npe}


def _torch_dtype(name: str):
    import torch

    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {name!r}")
    return getattr(torch, name)


def load_pipeline(
    model: str | os.PathLike | None = None,
    *,
    config: str | os.PathLike | None = None,
    scheduler: str = "ddim",
    device: str = "cpu",
    dtype: str = "float32",
    local_files_only: bool = True,
) -> Loaded:
    """The embedded default pipeline (model=None), a diffusers pipeline folder, or one .safetensors file.

    A single file takes its architecture from `config`, a local diffusers pipeline folder of the same
    model family (diffusers' from_single_file(config=...)); offline, a single file needs one.
    """

    torch_dtype = _torch_dtype(dtype)
    if model is None:
        if config is not None:
            raise ValueError(f"--config {str(config)!r} needs a single-file --model checkpoint to apply to")
        from ..models import load_default_pipeline

        pipe = load_default_pipeline(scheduler=scheduler, device=device, dtype=torch_dtype)
        return Loaded(pipe, "embedded default (tilewise/models)", embedded=True, sdxl=False)
    path = Path(model)
    if not path.exists():
        raise ValueError(
            f"--model {str(model)!r} does not exist: give a diffusers pipeline folder (with "
            "model_index.json) or a single .safetensors checkpoint"
        )
    if path.is_dir():
        if config is not None:
            raise ValueError(
                f"--config {str(config)!r} applies to a single-file --model only, but --model "
                f"{str(path)!r} is a folder (it carries its own configs)"
            )
        if not (path / "model_index.json").is_file():
            raise ValueError(f"{str(path)!r} is a folder without model_index.json: not a diffusers pipeline")
        from diffusers import DiffusionPipeline

        pipe = DiffusionPipeline.from_pretrained(path, local_files_only=local_files_only)
    elif path.suffix in (".safetensors", ".ckpt"):
        pipe = load_single_file(path, config, local_files_only)
    else:
        raise ValueError(f"--model {str(model)!r}: expected a folder or a .safetensors/.ckpt file")
    if not hasattr(pipe, "unet") or not hasattr(pipe, "vae"):
        raise ValueError(
            f"{type(pipe).__name__} from {str(path)!r} has no unet/vae: tilewise needs an SD-family "
            "UNet pipeline"
        )
    if scheduler != "ddim":
        import diffusers

        from ..models import SCHEDULERS

        if scheduler not in SCHEDULERS:
            raise ValueError(f"scheduler must be one of {sorted(SCHEDULERS)}, got {scheduler!r}")
        pipe.scheduler = getattr(diffusers, SCHEDULERS[scheduler]).from_config(pipe.scheduler.config)
    pipe.to(device, torch_dtype)
    sdxl = "XL" in type(pipe).__name__
    return Loaded(pipe, str(path), embedded=False, sdxl=sdxl)


VAE_CLASSES = ("AutoencoderKL", "AutoencoderTiny", "AutoencoderKLQwenImage", "AutoencoderKLWan",
               "AutoencoderKLLTXVideo")


def vae_class(model: str | os.PathLike | None) -> str | None:
    """The VAE class a --model folder names (a VAE folder's config.json, or a pipeline's model_index.json),
    read from its JSON without loading anything; None for the embedded model, a file, or no VAE entry."""
    import json

    if model is None or not Path(model).is_dir():
        return None
    path = Path(model)
    if (path / "config.json").is_file() and not (path / "model_index.json").is_file():
        return json.loads((path / "config.json").read_text()).get("_class_name")
    if (path / "model_index.json").is_file():
        entry = json.loads((path / "model_index.json").read_text()).get("vae")
        return entry[1] if isinstance(entry, list) and len(entry) == 2 else None
    return None


def load_vae(
    model: str | os.PathLike | None = None,
    *,
    config: str | os.PathLike | None = None,
    device: str = "cpu",
    dtype: str = "float32",
    local_files_only: bool = True,
):
    """The VAE of --model for decode / encode: a VAE folder (config.json of a diffusers VAE class) loaded
    alone; a pipeline folder whose VAE is a 3-D VAE (Qwen-Image, Wan, LTX-Video): its vae/ folder alone
    (no transformer or text encoder); anything else as `load_pipeline` loads it (its .vae)."""
    import diffusers

    torch_dtype = _torch_dtype(dtype)
    name = vae_class(model)
    path = None if model is None else Path(model)
    if path is not None and path.is_dir() and not (path / "model_index.json").is_file() and name is not None:
        if name not in VAE_CLASSES:
            raise ValueError(f"{str(path)!r} holds a {name}, not a VAE tilewise tiles: one of {VAE_CLASSES}")
        if config is not None:
            raise ValueError(f"--config {str(config)!r} applies to a single-file --model only, but --model "
                             f"{str(path)!r} is a VAE folder (it carries its own config)")
        vae = getattr(diffusers, name).from_pretrained(path, local_files_only=local_files_only)
    elif name in VAE_CLASSES[2:] and config is None:
        vae = getattr(diffusers, name).from_pretrained(path, subfolder="vae",
                                                       local_files_only=local_files_only)
    else:
        return load_pipeline(model, config=config, device=device, dtype=dtype,
                             local_files_only=local_files_only).pipe.vae
    return vae.to(device, torch_dtype).eval()
