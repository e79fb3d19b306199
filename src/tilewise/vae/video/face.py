"""What TiledVAE does for a 3-D causal VAE (AutoencoderKLQwenImage, AutoencoderKLWan 2.1 / 2.2,
AutoencoderKLLTXVideo, AutoencoderKLLTX2Video, AutoencoderKLHunyuanVideo): checks, the run, decode_to's
sinks and the plan; `vae.tiled` wraps the results in the VAE's own return types.

Latents and images are (B, C, T, H, W), as the pipelines pass them (T = 1 for Qwen-Image's images); a
timestep-conditioned LTX decode runs with its call's timestep embedding bound (`bound`).
mode="fast" estimates the GroupNorm statistics of the high-resolution part from a sample of its tiles
(`video.fast`); a family without GroupNorms, or whose program fast mode cannot cut, runs exact (the plan
says so).
"""

from __future__ import annotations

import contextlib
import logging

import torch

from ...distributed import rank_world, resolve_group
from ..checks import check_device
from ..settings import Job, Kind, Mode, Place, Settings
from .executor import VideoExecutor
from .fast import FastSplit, fast_note, fast_split, fast_stats
from .plan import choose_video, make_video_plan

logger = logging.getLogger(__name__)


def check(settings: Settings, job: Job, t) -> None:
    """ValueError naming the value and what would be valid, before any work."""
    p = job.program
    what = "latent z" if job.kind is Kind.DECODE else "video x"
    if not isinstance(t, torch.Tensor) or t.ndim != 5:
        shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{what} of {job.model} must be a (B, C, T, H, W) tensor (T = 1 for an "
                         f"image), got {shape}")
    if t.shape[1] != p.in_channels:
        raise ValueError(f"{what} has {t.shape[1]} channels, the VAE {job.kind}r expects {p.in_channels} "
                         f"(shape {tuple(t.shape)})")
    if min(t.shape) == 0:
        raise ValueError(f"{what} is empty: shape {tuple(t.shape)}")
    check_device(job, t, what)
    if job.kind is Kind.ENCODE:
        f = job.factor
        h, w = t.shape[-2:]
        if h % f or w % f:
            raise ValueError(f"video height and width must be multiples of {f} for encode, got {h}x{w}; "
                             f"pad or crop to {h - h % f or f}x{w - w % f or f}")


def bound(job: Job, temb, z, gradients: bool = False):
    """A context in which a decode's program reads this call's per-call values: LTX-Video 0.9.5+'s /
    LTX-2's timestep embedding (per-channel scales and shifts), computed once from temb
    (`program.call`; `gradients`: with autograd, their graph reaching temb and the embedders' parameters,
    `video.gradient` backs it); a decoder not conditioned ignores temb, as the stock one does. ValueError
    for a conditioned decode without a (B,) temb."""
    call = job.program.call
    if call is None:
        return contextlib.nullcontext()
    if not isinstance(temb, torch.Tensor):
        raise ValueError(f"{job.model}'s decoder is conditioned on a timestep (timestep_conditioning): "
                         f"decode(z, temb) needs temb, a (B,) tensor (the pipeline's decode_timestep), got "
                         f"{type(temb).__name__}")
    if temb.numel() != z.shape[0]:
        raise ValueError(f"temb must hold one timestep per sample: {z.shape[0]} for z of shape "
                         f"{tuple(z.shape)}, got shape {tuple(temb.shape)}")
    return call.bound(temb, batch=int(z.shape[0]), grad=gradients)


def run(settings: Settings, job: Job, t, emit=None, sequential: bool = False):
    """The tiled run (the untiled program when the latent fits one tile and nothing streams: exact in fast
    mode too), with retry_on_oom halving the tile: (output, most staged bytes; None for the untiled run)."""
    group = resolve_group(settings.process_group)
    tile, staging, order = choose_video(settings, job, tuple(t.shape), to_sink=emit is not None,
                                        sequential=sequential)
    p = job.program
    side = max(p.shapes(tuple(t.shape[-2:]))[job.ref])
    split = fast_split(settings, job, tuple(t.shape))
    while True:
        try:
            with torch.no_grad():
                if emit is None and group is None and side <= tile:
                    return p.run_steps(t), None
                if settings.mode is Mode.FAST:
                    logger.info("TiledVAE %s: %s", job.model, fast_note(split, p))
                return _tiled(settings, job, t, emit, tile, staging, order, group, split)
        except torch.OutOfMemoryError:
            if not settings.retry_on_oom or tile <= 1:
                raise
            logger.warning("TiledVAE %s: out of memory at tile_size %d, retrying with %d", job.kind, tile,
                           tile // 2)
            tile //= 2
            torch.cuda.empty_cache() if torch.cuda.is_available() else None


def _tiled(settings: Settings, job: Job, t, emit, tile: int, staging, order, group, split):
    """`run`'s tiled run: (output, most bytes staged or held). Fast mode (`split`, a `fast.FastSplit`)
    estimates its statistics first (`video.fast`), its decode's head run on the same tile, staging and
    order; with a process group every rank estimates them alike."""

    def executor(program, ref, stats=None, probes=None):
        return VideoExecutor(program, tile, ref, attention=settings.attention, staging=staging, order=order,
                             device=t.device, query_chunk=settings.query_chunk,
                             progress=settings.progress and rank_world(group)[0] == 0, group=group,
                             stage_dir=settings.stage_dir, fixed_stats=stats, probes=probes)

    stats, held = None, 0
    if isinstance(split, FastSplit):  # (held in host memory where the run stages there)
        home = torch.device("cpu") if staging is not Place.DEVICE else None
        stats, held = fast_stats(settings, job, split, t, tile, executor, home)
    res = executor(job.program, job.ref, stats).run(t, emit=emit)
    return res.output, max(res.staged_peak, held)


def dropped_frames(job: Job, x) -> None:
    """Say (a warning) which input frames the model's 1 + k n frame steps leave out of the encode."""
    dropped = x.shape[2] - job.program.chunks(x.shape[2])[-1][1]
    if dropped:
        logger.warning("%s encodes 1 + %d k frames: the last %d of %d input frames are not encoded",
                       job.model, job.program.every, dropped, x.shape[2])


def decode_to(settings: Settings, job: Job, z, sink) -> int | None:
    """Decode one latent video into a video sink (`tilewise.sinks.video`) frame block by frame block, or
    a one-frame decode into an image sink; never holding the video. Returns the most staged bytes.

    With a process group every rank calls it; rank 0 writes (its sink gets every step's frames whole),
    the others pass sink=None."""
    check(settings, job, z)
    if z.shape[0] != 1:
        raise ValueError(f"decode_to streams one video: batch must be 1, got {z.shape[0]}")
    rank = rank_world(resolve_group(settings.process_group))[0]
    if (sink is None) != (rank != 0):
        raise ValueError(f"rank {rank}: " + ("only rank 0 writes the video: pass sink=None here" if rank
                                             else "decode_to needs a sink (a video or image sink), got None"))
    plan = make_video_plan(settings, job, tuple(z.shape), to_sink=True)
    if sink is None:  # another rank: it runs its tiles; rank 0 writes
        return run(settings, job, z, emit=lambda *_: None, sequential=True)[1]
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

        return run(settings, job, z, emit=emit, sequential=True)[1]
    if (frames, sink.height, sink.width) != (t, h, w):
        raise ValueError(f"sink holds {frames} frames of {sink.height}x{sink.width}, the decode makes {t} "
                         f"frames of {h}x{w}")

    def emit_frames(t0, box, block):
        sink.write(t0, box[0], box[2], block[0].float())

    return run(settings, job, z, emit=emit_frames, sequential=not getattr(sink, "random_access", False))[1]
