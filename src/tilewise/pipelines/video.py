"""The decode / encode recipes of the video VAEs (Qwen-Image, Wan 2.1 / 2.2, LTX-Video, HunyuanVideo 1.0 /
1.5, Mochi, Cosmos, Magvit, CogVideoX, Allegro, SVD's temporal decoder): latents files, images and videos in,
images and video sinks out.

Latents files hold a `latents` tensor (B, C, T, H, W) (or one video's (C, T, H, W)), normalised as the
pipeline's denoiser sees them: z = (raw - latents_mean) * scaling_factor / latents_std, per channel
(Wan / Qwen-Image: their config's latents_mean / latents_std, scaling 1; LTX-Video: its latents_mean /
latents_std buffers and config.scaling_factor); Cosmos' (per channel and frame, with the scheduler's
sigma_data), SVD's (its scaling_factor; decoded in calls of decode_chunk_size frames, encoded frame
by frame) and HunyuanVideo 1.5's, Magvit's, CogVideoX's and Allegro's (scaling_factor alone) are laid
out by `video_latents`. Videos are read by `frames` (a frame pattern, a .npy or a multi-page TIFF stack, an
image as one frame); a decode of one frame writes an image (PNG, TIFF,
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
from ..errors import BadInputFile, BadRequest, ModelProblem
from . import video_latents as vl
from .frames import check_video, load_video

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
        c = next((int(cfg[k]) for k in ("z_dim", "latent_channels", "z_channels") if cfg.get(k)), None)
        if c is None:
            raise ValueError(f"{type(vae).__name__}'s config names no latent channels (z_dim, "
                             "latent_channels, z_channels)")
        mean = torch.tensor(cfg.get("latents_mean") or [0.0] * c)
        std = torch.tensor(cfg.get("latents_std") or [1.0] * c)
    shape = (1, -1, 1, 1, 1)
    return mean.detach().reshape(shape).float().cpu(), std.detach().reshape(shape).float().cpu(), sf


def tiled_vae(vae, **settings):
    """TiledVAE(vae, **settings); ModelProblem where no tile program reproduces the loaded VAE as its
    config sets it up (its family's refusal, with the reason: `vae.families`)."""
    from ..locality.build import LoweringError
    from ..vae import TiledVAE

    try:
        return TiledVAE(vae, **settings)
    except LoweringError as e:
        raise ModelProblem(f"the VAE of --model: {e}") from e


def _video_vae(vae, tile_size, mode, budget, staging, progress, process_group=None):
    return tiled_vae(vae, tile_size=tile_size, mode=mode, memory_budget=budget, staging=staging,
                     progress=progress, process_group=process_group)


def _check_frames(vae, path: str, frames: int, kind: str = "encode") -> None:
    """A video (a latents file: kind "decode") of `frames` frames the VAE's encode (decode) takes
    (HunyuanVideo 1.5's, Magvit's encode: 1 + 4 k frames; Allegro's: 4 k; VidTok's non-causal decode: 4
    latent frames or more, `Family.frames`); BadInputFile naming the file otherwise."""
    from ..vae.families import family_of
    from ..vae.settings import Kind

    family = family_of(vae)
    why = family.frames(vae, Kind(kind), frames) if family.frames is not None else ""
    if why:
        raise BadInputFile(f"{path!r} has {frames} frames: {why}")


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
                      replace: bool = True, process_group=None, sigma_data: float | None = None,
                      frames_per_call: int | None = None):
    """Decode a latents .safetensors with a video VAE, streamed: one frame to an image file, several to a
    frame sequence or a .npy / TIFF stack. Returns the plan it ran (SVD's: of its first call). With
    `process_group` every rank runs its band of tile rows and rank 0 writes. `sigma_data`: the scheduler's
    of a Cosmos pipeline (`video_latents.sigma_data`); `frames_per_call`: SVD's decode_chunk_size."""
    _check_frames_per_call(vae, frames_per_call)
    if not vl.has_own_layout(vae):
        tv = _video_vae(vae, tile_size, mode, budget, staging, progress, process_group)
        z = _latents(latents_path, tv.program("decode").in_channels)
        _check_frames(vae, latents_path, z.shape[2], "decode")
        return decode_to_file(tv, denormalised(vae, z), out, bits=bits, replace=replace)
    # (Cosmos' and SVD's files read and their layout checked before the VAE is lowered)
    z = _latents(latents_path, int(vae.config.latent_channels))
    sigma = None
    if type(vae).__name__ == vl.COSMOS:
        sigma = vl.sigma_data(vl.file_metadata(latents_path), sigma_data, latents_path)
    raw = vl.raw_of(vae, z, sigma).to(vae.device, vae.dtype)
    tv = _video_vae(vae, tile_size, mode, budget, staging, progress, process_group)
    return decode_to_file(tv, raw, out, bits=bits, replace=replace, frames_per_call=frames_per_call)


def _check_frames_per_call(vae, frames_per_call: int | None) -> None:
    """frames_per_call (decode_chunk_size) is SVD's, a positive int (BadRequest otherwise)."""
    if frames_per_call is None:
        return
    if type(vae).__name__ != vl.SVD:
        raise BadRequest(f"--decode-chunk-size applies to SVD's temporal decoder ({vl.SVD}, whose decode "
                         f"takes its frames in calls), not to a {type(vae).__name__}")
    if isinstance(frames_per_call, bool) or not isinstance(frames_per_call, int) or frames_per_call < 1:
        raise BadRequest(f"--decode-chunk-size must be a positive number of frames, got {frames_per_call!r}")


def denormalised(vae, z):
    """Latents as the pipeline's denoiser sees them, as the VAE decodes them (raw), on its device."""
    mean, std, sf = latent_norm(vae)
    return (z.float() * std.to(z.device) / sf + mean.to(z.device)).to(vae.device, vae.dtype)


def _calls(tv, frames: int, frames_per_call: int | None) -> list[tuple[int, int]]:
    """The latent frames of each decode call: SVD's in calls of frames_per_call (all by default, as its
    pipeline's call), another VAE's in one."""
    if type(tv.vae).__name__ != vl.SVD:
        return [(0, frames)]
    k = frames if frames_per_call is None else frames_per_call
    return [(a, min(a + k, frames)) for a in range(0, frames, k)]


def decode_to_file(tv, z, out: str, *, bits: int = 8, replace: bool = True,
                   frames_per_call: int | None = None):
    """Decode raw (1, C, T, H, W) latents with a TiledVAE of a video VAE, streamed: one frame to an image
    file, several to a frame sequence or a .npy / TIFF stack (checked first); SVD's in calls of
    `frames_per_call` frames (`video_latents`), each into its frames of the sink. Returns the plan it ran
    (of the first call)."""
    import torch

    from ..sinks import open_sink
    from ..sinks.video import open_video_sink

    calls = _calls(tv, z.shape[2], frames_per_call)
    shapes = [(*z.shape[:2], b - a, *z.shape[3:]) for a, b in calls]
    outs = {s: tv.plan(s, streamed=True).output_shape for s in set(shapes)}
    _, c, _, h, w = outs[shapes[0]]
    t = sum(outs[s][2] for s in shapes)
    if len(calls) > 1:
        logger.info("%s: %d decode calls of at most %d frames", type(tv.vae).__name__, len(calls),
                    calls[0][1])
    check_video_output(out, bits, t, replace)
    if not _writes(tv):  # another rank: it runs its tiles, rank 0 writes
        with torch.no_grad():
            for a, b in calls:
                tv.decode_to(z[:, :, a:b], None)
        return tv.plan(shapes[0], streamed=True, sequential=True)
    image = t == 1 and "{" not in out
    kw = dict(bits=bits, replace=replace, value_range=vl.value_range(tv.vae, bits))
    sink = open_sink(out, h, w, c, **kw) if image else open_video_sink(out, t, h, w, c, **kw)
    existing = getattr(sink, "existing", [])
    if existing:
        shown = ", ".join(existing[:3]) + (", ..." if len(existing) > 3 else "")
        logger.warning("%d of the %d frames of %r exist (%s): they are replaced once every new frame is "
                       "complete (--no-clobber keeps them)", len(existing), t, out, shown)
    sequential = image or not getattr(sink, "random_access", False)
    plan = tv.plan(shapes[0], streamed=True, sequential=sequential)
    with sink, torch.no_grad():
        if len(calls) == 1:
            tv.decode_to(z, sink)
        else:  # (SVD's calls: each into its frames, an output frame for each latent frame)
            for a, b in calls:
                tv.decode_to(z[:, :, a:b], vl.FrameWindow(sink, a, b - a))
    logger.info("wrote %s", out)
    return plan


def check_video_output(out: str, bits: int, frames: int, replace: bool) -> None:
    """An output that can take `frames` decoded frames (`_check_output`), and may be written there."""
    _check_output(out, bits, frames)
    check_target(out.format(0) if "{" in out else out, "output", replace=replace)


def encode_video_file(vae, path: str, out: str, *, tile_size: int = 32, mode: str = "exact",
                      budget: str | None = None, staging: str = "auto", progress: bool = True,
                      replace: bool = True, process_group=None, sigma_data: float | None = None):
    """Encode an image or a video (frame pattern, .npy / TIFF stack) with a video VAE into a latents
    .safetensors (the distribution's mean, normalised as the pipeline's denoiser sees it; SVD's frame by
    frame). With `process_group` every rank encodes its band of tile rows and rank 0 writes.
    `sigma_data`: the scheduler's of a Cosmos pipeline (recorded in the file)."""
    import torch
    from safetensors.torch import save_file

    _check_frames(vae, path, check_video(path)[0])  # (from the headers, before the VAE is lowered)
    tv = _video_vae(vae, tile_size, mode, budget, staging, progress, process_group)
    x = load_video(path, tv.factor("encode"), tv.program("encode").in_channels, vl.pixel_scale(vae))
    x = x.to(vae.device, vae.dtype)
    name = type(vae).__name__
    if name == vl.SVD:  # (its 2-D encoder: frame by frame)
        plan = tv.plan((1, *x.shape[1:2], *x.shape[3:]), kind="encode")
        latents, metadata = vl.file_of(vae, vl.encode_frames(tv, x))
        extra = {}
    else:
        plan = tv.plan(tuple(x.shape), kind="encode")
        with torch.no_grad():
            raw, extra = _encoded(tv.encode(x))
        if vl.has_own_layout(vae):  # (Cosmos': with the scheduler's sigma_data, recorded)
            sigma = vl.sigma_data({}, sigma_data) if name == vl.COSMOS else None
            latents, metadata = vl.file_of(vae, raw, sigma)
        else:
            mean, std, sf = latent_norm(vae)
            latents = ((raw.float().cpu() - mean) * sf / std).contiguous()
            metadata = {"normalised": "(z - latents_mean) * scaling_factor / latents_std",
                        "scaling_factor": str(sf), "vae": name}
    if not _writes(tv):
        return plan
    with atomic_path(out, replace=replace) as tmp:
        save_file({"latents": latents, **extra}, str(tmp), metadata=metadata)
    return plan


def _encoded(out) -> tuple[Any, dict]:
    """The raw latent of an encode's output (its posterior's mode) and the other tensors its latents file
    holds: VidTok's FSQ encode returns its quantised latent and codebook indices, kept as `indices`
    ((B, T, h, w) int32)."""
    if isinstance(out, tuple):
        return out[0], {"indices": out[1].detach().cpu().contiguous()}
    return out.latent_dist.mode(), {}
