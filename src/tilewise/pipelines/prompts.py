"""Text to a pipeline's conditioning: the keyword arguments its `__call__` takes for a prompt.

Regions need embeddings (`tilewise.Region(prompt_embeds=..., pooled_prompt_embeds=...)`) in the
denoiser's own format, so the families whose prompt encoders we call by name are encoded here: SD 1.x /
2.x, SDXL (CLIP), SD3 (two CLIPs and T5, which may be absent), Flux (CLIP pooled, T5). Any other pipeline
gets the prompt as text (`prompt`, and `negative_prompt` where its call takes one) and no regions.
"""

from __future__ import annotations

import inspect
from typing import Any


def family(pipe) -> str:
    """'sd', 'sdxl', 'sd3', 'flux' or 'other', from the pipeline class."""
    name = type(pipe).__name__
    if name.startswith("StableDiffusion3"):
        return "sd3"
    if name.startswith("Flux") and not name.startswith("Flux2"):
        return "flux"
    if "XL" in name:
        return "sdxl"
    return "sd" if getattr(pipe, "unet", None) is not None else "other"


def encode(pipe, prompt: str, negative: str = "") -> dict[str, Any]:
    """{prompt_embeds, ...} for `pipe(**encode(...))` (or the text, for pipelines of other families)."""
    kind = family(pipe)
    denoiser = pipe.unet if getattr(pipe, "unet", None) is not None else pipe.transformer
    device = denoiser.device
    if kind == "sd":
        pe, npe = pipe.encode_prompt(prompt, device, 1, True, negative_prompt=negative)
        return {"prompt_embeds": pe, "negative_prompt_embeds": npe}
    if kind in ("sdxl", "sd3"):
        extra = {"prompt_3": None} if kind == "sd3" else {}
        pe, npe, ppe, nppe = pipe.encode_prompt(prompt=prompt, prompt_2=None, device=device,
                                                num_images_per_prompt=1, do_classifier_free_guidance=True,
                                                negative_prompt=negative, **extra)
        return {"prompt_embeds": pe, "negative_prompt_embeds": npe, "pooled_prompt_embeds": ppe,
                "negative_pooled_prompt_embeds": nppe}
    if kind == "flux":  # guidance-distilled: no negative prompt unless true CFG is asked for
        pe, ppe, _ = pipe.encode_prompt(prompt=prompt, prompt_2=None, device=device, num_images_per_prompt=1)
        return {"prompt_embeds": pe, "pooled_prompt_embeds": ppe}
    out: dict[str, Any] = {"prompt": prompt}
    if negative and "negative_prompt" in inspect.signature(pipe.__call__).parameters:
        out["negative_prompt"] = negative
    return out


def embeds_for_regions(pipe, prompt: str, negative: str = "") -> dict[str, Any]:
    """A region's embeddings; ValueError for a pipeline whose prompt encoder tilewise does not call."""
    cond = encode(pipe, prompt, negative)
    if "prompt_embeds" not in cond:
        raise ValueError(f"--region needs prompt embeddings, and tilewise encodes prompts for SD 1.x / 2.x, "
                         f"SDXL, SD3 and Flux pipelines, not {type(pipe).__name__}; give one prompt for the "
                         "whole image or use the Python API (tilewise.Region(prompt_embeds=...))")
    return cond
