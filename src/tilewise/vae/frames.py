"""An image VAE in a video's layout (Qwen-Image 2.1's AutoencoderKLQwenImage21, `Family(frame=True)`):
its calls take and return (B, C, 1, H, W) as the wrapped class's do; its 2-D programs run the one frame
as (B, C, H, W) (traced with the frame axis added and dropped around the class's own calls,
`locality.trace.frames`)."""

from __future__ import annotations

import torch

from .settings import Job, Kind


def one_frame(job: Job, t) -> torch.Tensor:
    """The (B, C, H, W) image or latent of a (B, C, 1, H, W) call (ValueError naming the shape and what
    is valid otherwise)."""
    what = "latent z" if job.kind is Kind.DECODE else "image x"
    if not isinstance(t, torch.Tensor) or t.ndim != 5:
        shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{what} of {job.model} must be a (B, C, 1, H, W) tensor (an image in a video's "
                         f"layout, as the VAE takes it), got {shape}")
    if t.shape[2] != 1:
        raise ValueError(f"{what} of {job.model} has T={t.shape[2]} frames (shape {tuple(t.shape)}); the "
                         "VAE codes one image, T must be 1 (its own decode fails on more frames, its encode "
                         "keeps only the first of up to 4): call it once per frame with (B, C, 1, H, W)")
    return t[:, :, 0]


def image_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """A (B, C, 1, H, W) shape planned as the (B, C, H, W) its program runs ((B, C, H, W) as it is)."""
    shape = tuple(shape)
    if len(shape) == 5 and shape[2] == 1:
        return shape[:2] + shape[3:]
    if len(shape) == 4:
        return shape
    raise ValueError(f"this VAE plans (B, C, 1, H, W) shapes (one image in a video's layout), got {shape}")
