"""The decode / encode recipes of the 3-D causal VAEs (Qwen-Image, Wan 2.1 / 2.2, LTX-Video): latents
files, images and videos in, images and video sinks out.

Latents files hold a `latents` tensor (B, C, T, H, W) (or one video's (C, T, H, W)), normalised as the
pipeline's denoiser sees them: z = (raw - latents_mean) * scaling_factor / latents_std, per channel
(Wan / Qwen-Image: their config's latents_mean / latents_std, scaling 1; LTX-Video: its latents_mean /
latents_std buffers and config.scaling_factor). Videos are read by `frames` (a frame pattern, a .npy
or a multi-page TIFF stack, an image as one frame); a decode of one frame writes an image (PNG, TIFF,
.npy), a decode of several frames a video sink (`tilewise.sinks.video`), frame blocks streamed.

torch, safetensors.torch, and sinks, sources and vae (numpy, torch) are imported inside the functions that use
them, so that `import tilewise.pipelines` imports no torch, diffusers or numpy: the CLI's commands import it
before they check their arguments, and a bad argument fails before ~4 s of torch and diffusers imports.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from ..atomic import atomic_path, check_target
from ..errors import BadRequest
from .frames import load_video

logger = logging.getLogger(__name__)


def latent_norm(vae) -> tuple[Any, Any, float]:
    """(latents_mean, latents_std, scaling_factor) of a 3-D VAE as (1, C, 1, 1, 1) tensors and a float: its
    latents_mean / latents_std buffers (LTX-Video, LTX-2) or config lists (Wan, Qwen-Image; zeros and ones
    where it names none: the HunyuanImage refiner), its config's scaling_factor (1 where it names none)."""
    import torch

    cfg = vae.config
    sf = float(cfg.get("scaling_factor") or 1.0)
    buffers = dict(vae.named_buffers(recurse=False))
    if "latents_mean" in buffers:
        mean, std = buffers["latents_mean"], buffers["latents_std"]
    else:
        c = next((int(cfg[k]) for k in ("z_dim", "latent_channels") if cfg.get(k)), None)
        if c is None:
            raise ValueError(f"{type(vae).__name__}'s config names no latent channels (z_dim, "
                             "latent_channels)")
        mean = torch.tensor(cfg.get("latents_mean") or [0.0] * c)
        std = torch.tensor(cfg.get("latents_std") or [1.0] * c)
    shape = (1, -1, 1, 1, 1)
    return mean.detach().reshape(shape).float().cpu(), std.detach().reshape(shape).float().cpu(), sf


def _video_vae(vae, tile_size, mode, budget, staging, progress, process_group=None):
    from ..vae import TiledVAE

    if staging == "disk":
        raise BadRequest(f"--staging disk is not available for {type(vae).__name__} (a 3-D VAE stages its "
                         f"values on the device or the host): use auto, device or host")
    return TiledVAE(vae, tile_size=tile_size, mode=mode, memory_budget=budget, staging=staging,
                    progress=progress, process_group=process_group)


def _writes(tv) -> bool:
    """Whether this process writes the output: one process, or rank 0 of the TiledVAE's group."""
    from ..distributed import rank_world, resolve_group

    return rank_world(resolve_group(tv.process_group))[0] == 0


def _latents(path: str, channels: int):
    """The `latents` tensor of a .safetensors as (1, C, T, H, W): header, shape, dtype, channels and
    values checked (`sources.latents`)."""
    from ..sources import read_latents

    return read_latents(path, channels=channels, video=True)


def _check_output(out: str, bits: int, frames: int) -> None:
    """Refuse an output that cannot take the decode before anything runs: several frames need a frame
    pattern or a stack; the suffix and bits as the sink opening it takes them (`sink_for`,
    `video_sink_for`)."""
    from ..sinks import sink_for
    from ..sinks.video import video_sink_for

    if frames > 1 and "{" not in out and Path(out).suffix.lower() not in (".npy", ".tif", ".tiff"):
        raise BadRequest(f"the decode makes {frames} frames: write them to a frame pattern such as "
                         f"'frames/f{{:04d}}.png', a .npy stack or a .tif stack, not {out!r}")
    (sink_for if frames == 1 and "{" not in out else video_sink_for)(out, bits)


def decode_video_file(vae, latents_path: str, out: str, *, tile_size: int = 32, mode: str = "exact",
                      budget: str | None = None, staging: str = "auto", bits: int = 8, progress: bool = True,
                      replace: bool = True, process_group=None):
    """Decode a latents .safetensors with a 3-D VAE, streamed: one frame to an image file, several to a
    frame sequence or a .npy / TIFF stack. Returns the plan it ran. With `process_group` every rank
    runs its band of tile rows and rank 0 writes."""
    tv = _video_vae(vae, tile_size, mode, budget, staging, progress, process_group)
    z = _latents(latents_path, tv.program("decode").in_channels)
    return decode_to_file(tv, denormalised(vae, z), out, bits=bits, replace=replace)


def denormalised(vae, z):
    """Latents as the pipeline's denoiser sees them, as the VAE decodes them (raw), on its device."""
    mean, std, sf = latent_norm(vae)
    return (z.float() * std.to(z.device) / sf + mean.to(z.device)).to(vae.device, vae.dtype)


def decode_to_file(tv, z, out: str, *, bits: int = 8, replace: bool = True):
    """Decode raw (1, C, T, H, W) latents with a TiledVAE of a 3-D VAE, streamed: one frame to an image
    file, several to a frame sequence or a .npy / TIFF stack (checked first). Returns the plan it ran."""
    import torch

    from ..sinks import open_sink
    from ..sinks.video import open_video_sink

    shape = tuple(z.shape)
    _, c, t, h, w = tv.plan(shape, streamed=True).output_shape
    check_video_output(out, bits, t, replace)
    if not _writes(tv):  # another rank: it runs its tiles, rank 0 writes
        with torch.no_grad():
            tv.decode_to(z, None)
        return tv.plan(shape, streamed=True, sequential=True)
    image = t == 1 and "{" not in out
    sink = (open_sink(out, h, w, c, bits=bits, replace=replace) if image
            else open_video_sink(out, t, h, w, c, bits=bits, replace=replace))
    existing = getattr(sink, "existing", [])
    if existing:
        shown = ", ".join(existing[:3]) + (", ..." if len(existing) > 3 else "")
        logger.warning("%d of the %d frames of %r exist (%s): they are replaced once every new frame is "
                       "complete (--no-clobber keeps them)", len(existing), t, out, shown)
    sequential = image or not getattr(sink, "random_access", False)
    plan = tv.plan(shape, streamed=True, sequential=sequential)
    with sink, torch.no_grad():
        tv.decode_to(z, sink)
    logger.info("wrote %s", out)
    return plan


def check_video_output(out: str, bits: int, frames: int, replace: bool) -> None:
    """An output that can take `frames` decoded frames (`_check_output`), and may be written there."""
    _check_output(out, bits, frames)
    check_target(out.format(0) if "{" in out else out, "output", replace=replace)


def encode_video_file(vae, path: str, out: str, *, tile_size: int = 32, mode: str = "exact",
                      budget: str | None = None, staging: str = "auto", progress: bool = True,
                      replace: bool = True, process_group=None):
    """Encode an image or a video (frame pattern, .npy / TIFF stack) with a 3-D VAE into a latents
    .safetensors (the distribution's mean, normalised as the pipeline's denoiser sees it). With
    `process_group` every rank encodes its band of tile rows and rank 0 writes."""
    import torch
    from safetensors.torch import save_file

    tv = _video_vae(vae, tile_size, mode, budget, staging, progress, process_group)
    x = load_video(path, tv.factor("encode"), tv.program("encode").in_channels).to(vae.device, vae.dtype)
    plan = tv.plan(tuple(x.shape), kind="encode")
    with torch.no_grad():
        raw = tv.encode(x).latent_dist.mean
    mean, std, sf = latent_norm(vae)
    latents = ((raw.float().cpu() - mean) * sf / std).contiguous()
    if not _writes(tv):
        return plan
    with atomic_path(out, replace=replace) as tmp:
        save_file({"latents": latents}, str(tmp),
                  metadata={"normalised": "(z - latents_mean) * scaling_factor / latents_std",
                            "scaling_factor": str(sf), "vae": type(vae).__name__})
    return plan
