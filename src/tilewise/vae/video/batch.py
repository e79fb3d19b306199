"""Stable Video Diffusion's temporal decoder (AutoencoderKLTemporalDecoder, `Family(batched=True)`):
`decode(z, num_frames)` takes the frames of each video of the batch in its rows, (B T, C, H, W), and
returns (B T, C, H, W), as the wrapped class does; the frames of one call mix (its temporal convolutions
and GroupNorms over frames x space), so its program is a one-step video program run on the (B, C, T, H,
W) video they are (`locality.trace.video_batch`), with the call's image_only_indicator bound (zeros of
(B, T), as the wrapped decode makes it: the weights of its AlphaBlenders, `trace.percall`). Its encode
is the 2-D encoder's, each frame an image."""

from __future__ import annotations

import torch

from ..settings import Job


def as_video(job: Job, z, num_frames) -> torch.Tensor:
    """The (B, C, T, H, W) video of a (B T, C, H, W) call with num_frames = T (a view); ValueError naming
    the shape and the frame count where they do not make whole videos."""
    if not isinstance(z, torch.Tensor) or z.ndim != 4:
        shape = tuple(z.shape) if isinstance(z, torch.Tensor) else type(z).__name__
        raise ValueError(f"latent z of {job.model} must be a (B T, C, H, W) tensor (the frames of each video "
                         f"in the batch, as decode(z, num_frames) takes them), got {shape}")
    if isinstance(num_frames, bool) or not isinstance(num_frames, int) or num_frames < 1:
        raise ValueError(f"num_frames must be a positive int (the frames of each video), got {num_frames!r}")
    if z.shape[0] % num_frames:
        raise ValueError(f"latent z has {z.shape[0]} rows, not a whole number of videos of num_frames="
                         f"{num_frames} (shape {tuple(z.shape)}): its rows are B x num_frames")
    return z.unflatten(0, (z.shape[0] // num_frames, num_frames)).permute(0, 2, 1, 3, 4)


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """A (B, C, T, H, W) decode as the wrapped class returns it: (B T, C, H, W)."""
    return x.permute(0, 2, 1, 3, 4).flatten(0, 1)


def bound(job: Job, z, gradients: bool = False):
    """A context in which the decode's program reads this call's AlphaBlender weights (its
    image_only_indicator: zeros of (B, T) for z of (B, C, T, H, W), as the wrapped decode makes it;
    `gradients`: computed with autograd, their graph reaching each blender's mix_factor, which
    `video.gradient` backs as it does LTX's timestep embedding)."""
    b, t = int(z.shape[0]), int(z.shape[2])
    return job.program.call.bound(torch.zeros(b, t, dtype=z.dtype, device=z.device), batch=b, grad=gradients)
