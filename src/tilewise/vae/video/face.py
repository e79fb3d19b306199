"""What TiledVAE does for a 3-D causal VAE (AutoencoderKLQwenImage, AutoencoderKLWan 2.1 / 2.2,
AutoencoderKLLTXVideo): checks, decode, encode, decode_to and plan, with the wrapped VAE's return types.

Latents and images are (B, C, T, H, W), as the pipelines pass them (T = 1 for Qwen-Image's images).
These families have no GroupNorm: mode="fast" has nothing to estimate and runs exact (the plan says so).
"""

from __future__ import annotations

import logging

from .video import VideoExecutor
from .video_plan import VideoPlan, choose_video, make_video_plan

logger = logging.getLogger(__name__)


def check(tv, t, kind: str) -> None:
    """ValueError naming the value and what would be valid, before any work."""
    import torch

    p = tv.program(kind)
    what = "latent z" if kind == "decode" else "video x"
    if not isinstance(t, torch.Tensor) or t.ndim != 5:
        shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{what} of {type(tv.vae).__name__} must be a (B, C, T, H, W) tensor (T = 1 for an "
                         f"image), got {shape}")
    if t.shape[1] != p.in_channels:
        raise ValueError(f"{what} has {t.shape[1]} channels, the VAE {kind}r expects {p.in_channels} "
                         f"(shape {tuple(t.shape)})")
    if min(t.shape) == 0:
        raise ValueError(f"{what} is empty: shape {tuple(t.shape)}")
    if kind == "encode":
        f = tv.factor("encode")
        h, w = t.shape[-2:]
        if h % f or w % f:
            raise ValueError(f"video height and width must be multiples of {f} for encode, got {h}x{w}; "
                             f"pad or crop to {h - h % f or f}x{w - w % f or f}")
    if tv.process_group is not None:
        raise ValueError("process_group: 3-D VAEs run in one process for now; drop process_group")
    if torch.is_grad_enabled() and t.requires_grad:
        raise RuntimeError("TiledVAE does not support autograd: tiled paths run under torch.no_grad and "
                           "would break backward(); use the wrapped VAE directly to train")


def run(tv, kind: str, t, emit=None, sequential: bool = False):
    """The tiled run (the untiled program when the latent fits one tile and nothing streams), with
    retry_on_oom halving the tile."""
    import torch

    tile, staging, order = choose_video(tv, tuple(t.shape), kind, to_sink=emit is not None,
                                        sequential=sequential)
    p = tv.program(kind)
    ref = p.input if kind == "decode" else p.output
    if tv.mode == "fast":
        logger.info("TiledVAE: %s has no GroupNorm, fast mode runs exact", type(tv.vae).__name__)
    while True:
        try:
            with torch.no_grad():
                if emit is None and max(p.shapes(tuple(t.shape[-2:]))[ref]) <= tile:
                    return p.run_steps(t)
                ex = VideoExecutor(p, tile, ref, attention=tv.attention, staging=staging, order=order,
                                   device=t.device, query_chunk=tv.query_chunk, progress=tv.progress)
                out = ex.run(t, emit=emit)
                tv.last_staged_peak = ex.staged_peak
                return out
        except torch.OutOfMemoryError:
            if not tv.retry_on_oom or tile <= 1:
                raise
            logger.warning("TiledVAE %s: out of memory at tile_size %d, retrying with %d", kind, tile,
                           tile // 2)
            tile //= 2
            torch.cuda.empty_cache() if torch.cuda.is_available() else None


def decode(tv, z, return_dict: bool = True):
    """DecoderOutput(sample=(B, C, T', H', W')) like the VAE's decode."""
    from diffusers.models.autoencoders.vae import DecoderOutput

    check(tv, z, "decode")
    sample = run(tv, "decode", z)
    return DecoderOutput(sample=sample) if return_dict else (sample,)


def encode(tv, x, return_dict: bool = True):
    """AutoencoderKLOutput(latent_dist=DiagonalGaussianDistribution) like the VAE's encode."""
    from diffusers.models.autoencoders.autoencoder_kl import AutoencoderKLOutput
    from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution

    check(tv, x, "encode")
    dropped = x.shape[2] - tv.program("encode").chunks(x.shape[2])[-1][1]
    if dropped:
        logger.warning("%s encodes 1 + %d k frames: the last %d of %d input frames are not encoded",
                       type(tv.vae).__name__, tv.program("encode").every, dropped, x.shape[2])
    posterior = DiagonalGaussianDistribution(run(tv, "encode", x))
    return AutoencoderKLOutput(latent_dist=posterior) if return_dict else (posterior,)


def decode_to(tv, z, sink) -> None:
    """Decode one latent video into a video sink (`tilewise.sinks.video`) frame block by frame block, or
    a one-frame decode into an image sink; never holding the video."""
    check(tv, z, "decode")
    if z.shape[0] != 1:
        raise ValueError(f"decode_to streams one video: batch must be 1, got {z.shape[0]}")
    plan = make_video_plan(tv, tuple(z.shape), "decode", to_sink=True)
    _, c, t, h, w = plan.output_shape
    frames = getattr(sink, "frames", None)
    if frames is None:  # an image sink: one frame
        if t != 1:
            raise ValueError(f"an image sink takes one frame, the decode makes {t}: use a video sink "
                             f"(tw.open_video_sink)")
        if (sink.height, sink.width) != (h, w):
            raise ValueError(f"sink is {sink.height}x{sink.width} but the decoded image is {h}x{w}")

        def emit(t0, box, block):
            sink.write(box[0], box[2], block[0, :, 0].float())

        run(tv, "decode", z, emit=emit, sequential=True)
        return
    if (frames, sink.height, sink.width) != (t, h, w):
        raise ValueError(f"sink holds {frames} frames of {sink.height}x{sink.width}, the decode makes {t} "
                         f"frames of {h}x{w}")

    def emit_frames(t0, box, block):
        sink.write(t0, box[0], box[2], block[0].float())

    run(tv, "decode", z, emit=emit_frames, sequential=not getattr(sink, "random_access", False))


def plan(tv, shape, kind: str = "decode", tile_size: int | None = None, staging: str | None = None,
         order: str | None = None) -> VideoPlan:
    """The plan for an input of `shape` (B, C, T, H, W): tiles, causal steps, cache bytes, the peak."""
    if len(shape) != 5:
        raise ValueError(f"a 3-D VAE plans (B, C, T, H, W) shapes, got {tuple(shape)}")
    if kind not in ("decode", "encode"):
        raise ValueError(f"kind must be 'decode' or 'encode', got {kind!r}")
    return make_video_plan(tv, tuple(shape), kind, tile_size, staging, order)
