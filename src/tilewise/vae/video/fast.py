"""Fast mode for 3-D VAEs, the named approximation: GroupNorm statistics estimated from a sample of the
real tiles, then one pass with them fixed.

Exact mode cuts a video program at every GroupNorm of a video value: the values before it are staged for
the whole step (every frame of a one-step program) while its statistics are merged over every tile. Fast
mode cuts the program where one value crosses (`fast_split`, as the 2-D fast mode does): a decode before
its first spatial upsampling, an encode after its last spatial downsampling. The latent-resolution part
(with the mid-block's attention) runs exact; the other part's GroupNorms are estimated:

1. Decode only: the latent-resolution head runs exact, its output (the estimated tail's input) held.
2. The estimation pass (`sampled.SampledStats`): a stratified sample of the tiles (`fast_sample`, by
   default half of them) runs the estimated part together, segment by segment, their statistics merged
   over their cores.
3. The run: the whole program with the estimated part's GroupNorms given (`VideoExecutor(fixed_stats)`):
   an affine per channel (and frame) there, so that part is cut only where exact mode cuts for other
   reasons, nothing between its GroupNorms is staged and each tile runs through it end to end with a
   larger halo. (A decode's head runs again here: its output is not held through the run.)

A program whose estimated part holds attention or a whole-domain op, whose cut more than one value
crosses, or whose head changes the frames of a causal step, runs exact, and its plan says why
(`fast_split` returns the reason). Its error against exact mode is measured in tests/test_video_fast.py
and benchmarks/video_fast.py.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ...locality.ops import OpKind
from ...locality.ops3d import Rearrange
from ...locality.program import Program
from ...locality.program3d import VideoProgram
from ..settings import Estimator, Job, Kind, Mode, Settings
from .sampled import SampledStats, held_bytes, sampled
from .stores import nbytes

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class FastSplit:
    """A video program cut for fast mode before op `at`, where value `cut` crosses (a decode's tail may
    read the latent too): the latent-resolution part exact, the other estimated."""

    program: VideoProgram
    at: int
    cut: str
    kind: Kind

    @property
    def head(self) -> VideoProgram:
        """The ops before the cut (decode: exact, run first for the estimation pass)."""
        p = self.program
        return dataclasses.replace(p, ops=p.ops[: self.at], output=self.cut, name=p.name + "[head]")

    @property
    def part(self) -> Program:
        """The estimated part up to its last GroupNorm (what follows changes no statistic): a decode's
        tail (from the cut, and the latent where it reads it), an encode's head."""
        p = self.program
        a, b = (self.at, len(p.ops)) if self.kind is Kind.DECODE else (0, self.at)
        last = max((i for i in range(a, b) if p.ops[i].kind is OpKind.GROUP_NORM), default=b - 1)
        if not _feeds(p.ops[a : last + 1]):  # (a GroupNorm off the path to the last: the part whole)
            last = b - 1
        first, channels = (self.cut, p.channels()[self.cut]) if self.kind is Kind.DECODE \
            else (p.input, p.in_channels)
        return Program(ops=p.ops[a : last + 1], input=first, output=p.ops[last].dst, in_channels=channels,
                       name=p.name + ("[tail]" if self.kind is Kind.DECODE else "[head]"))

    @property
    def fixed(self) -> frozenset[int]:
        """ids of the GroupNorms fast mode estimates."""
        return frozenset(id(op) for op in self.part.ops if op.kind is OpKind.GROUP_NORM)


def fast_split(settings: Settings, job: Job, shape) -> FastSplit | str | None:
    """Where fast mode cuts the job's program for an input of `shape` (B, C, T, H, W); a reason (str) where
    it cannot; None in exact mode or for a program without GroupNorms."""
    p = job.program
    if settings.mode is not Mode.FAST or not any(op.kind is OpKind.GROUP_NORM for op in p.ops):
        return None
    if settings.fast.estimator is not Estimator.TILES:
        return "its estimator is 'tiles' only (fast_estimator='crops' is the 2-D VAEs')"
    if job.kind is Kind.ENCODE and settings.fast.color_fix:
        return "color_fix is for the 2-D VAEs' encode"
    shapes = p.shapes(tuple(shape[-2:]))
    if job.kind is Kind.DECODE:
        k = next((i for i, op in enumerate(p.ops) if _scale(op, shapes) > 1), None)
    else:
        down = [i for i, op in enumerate(p.ops) if _scale(op, shapes) < 1]
        k = down[-1] + 1 if down else None
    if k is None or k == 0 or k >= len(p.ops):
        return "it has no spatial resampling to cut at"
    # (the nearest cut on the latent-resolution side where one value crosses, besides the latent a
    # decode's tail may read: a decode's upsampler may slice its input's frames first, HunyuanVideo's;
    # CogVideoX's and KVAE's decoders condition their norms on the latent)
    near = range(k, 0, -1) if job.kind is Kind.DECODE else range(k, len(p.ops))
    at, k = p.ops[k].name, next((c for c in near if len(_crossing(p, c, job.kind)) == 1), None)
    if k is None:
        return f"no cut on the latent-resolution side of {at} has one value crossing it"
    (cut,) = _crossing(p, k, job.kind)
    split = FastSplit(p, k, cut, job.kind)
    syncs = [op for op in split.part.ops if op.kind in (OpKind.ATTENTION, OpKind.WHOLE)]
    if syncs:
        return f"its estimated part holds {syncs[0].name} ({syncs[0].describe()})"
    if not split.fixed:
        return "its estimated part has no GroupNorm"
    return split


def fast_stats(settings: Settings, job: Job, split: FastSplit, x, tile: int, executor,
               home=None) -> tuple[dict, int]:
    """The estimated statistics ((id(GroupNorm), step) -> (mean, var)) and the most bytes held while making
    them; `executor(program, ref)` makes an exact video executor (the decode's head); `home`: where the
    estimation holds what it keeps (the host where the run stages there; None: x's device)."""
    given, held = {job.program.input: x}, 0
    if job.kind is Kind.DECODE:
        res = executor(split.head, split.head.input).run(x)
        h = res.output if home is None else res.output.to(home)
        given[split.cut], held = h, res.staged_peak + nbytes(h)
    shapes = job.program.shapes(tuple(x.shape[-2:]))
    tiles = sampled(shapes, split.cut, part_tile(job, split, x.shape, tile),
                    settings.fast.fraction(Estimator.TILES))
    adjust = None
    if settings.fast.low > 1:  # (the low pass first: the sample's statistics corrected as they are made)
        small, xs, ref = low_pass(job, x, settings.fast.low)
        probes = (shapes[split.cut], tuple(t.core for t in tiles))
        low = executor(small, ref, probes=probes).run(xs, emit=lambda *_: None)
        adjust = {k: (low.stats[k], low.probe_stats[k]) for k in low.probe_stats if k in low.stats}
        held = max(held, low.staged_peak)
    logger.info("TiledVAE %s: fast mode estimates %d GroupNorms from %d sampled tiles%s", job.model,
                len(split.fixed), len(tiles), f", corrected by a {settings.fast.low}x smaller low pass"
                if adjust is not None else "")
    est = SampledStats(job.program, split.part, split.cut, tiles, settings.query_chunk, x.device, home,
                       adjust)
    stats = est.run(given)
    head = nbytes(given[split.cut]) if job.kind is Kind.DECODE else 0
    return stats, max(held, est.held_peak + head)


def low_pass(job: Job, x, low: int):
    """(program, input, reference value) of fast mode's low pass, `low` times smaller in space; x may be a
    shape (planning). Decode: the upsamplings take the reduction out (`low_program`: a nearest x2
    becomes x1), so the low pass sees all of the latent-resolution content and runs the head at full
    size; what they cannot absorb is average-pooled out of the latent. Encode: the video resized down
    frame by frame (antialiased) to multiples of the VAE's factor, as the 2-D encode's low pass."""
    tensor = isinstance(x, torch.Tensor)
    shape = tuple(int(d) for d in (x.shape if tensor else x))
    p = job.program
    if job.kind is Kind.DECODE:
        small, left = low_program(p, shape[-2:], low)
        if tensor:
            return small, (F.avg_pool3d(x, (1, left, left), ceil_mode=True) if left > 1 else x), p.input
        return small, (*shape[:3], -(-shape[-2] // left), -(-shape[-1] // left)), p.input
    f = job.factor
    size = tuple(max(f, round(d / low / f) * f) for d in shape[-2:])
    if not tensor:
        return p, (*shape[:3], *size), p.output
    b, c, t = shape[:3]
    frames = F.interpolate(x.transpose(1, 2).flatten(0, 1), size=size, mode="bilinear", antialias=True,
                           align_corners=False)
    return p, frames.view(b, t, c, *size).transpose(1, 2), p.output


def low_program(p: VideoProgram, hw, factor: int) -> tuple[VideoProgram, int]:
    """The decode program `factor` times smaller after its first spatial upsampling, stopped at its last
    GroupNorm: each upsampling by r followed by the mean over its blocks of gcd(r, the factor left) (a
    `Rearrange` packing them: a nearest upsampling so undone, a depth-to-space or transposed convolution
    box-filtered), as far as they absorb the factor (every op upsampling one resolution by the same g);
    returns it and the factor left over."""
    shapes = p.shapes(tuple(hw))
    left, ops, taken = factor, [], {}  # (taken: input shape -> its mean's g, one per resolution)
    for op in p.ops:
        r = _scale(op, shapes)
        at = shapes[op.src[0]] if r > 1 else None
        if r > 1 and r == int(r) and (at in taken or left > 1):
            # (an upsampler may resample slices of its input apart, HunyuanVideo's first frame and the
            # rest: every op reading that resolution takes the same g, or the slices' sizes would part)
            if at not in taken:
                taken[at] = math.gcd(int(r), left)
                left //= taken[at]
            g = taken[at]
            made = f"{op.dst}[x{int(r)}]"
            ops += [dataclasses.replace(op, dst=made),
                    Rearrange(src=(made,), dst=op.dst, name=f"{op.name}[low pass]", fn=_mean_of(g), down=g,
                              label=f"mean of {g}x{g} blocks (fast mode's low pass)")]
        else:
            ops.append(op)
    last = max(i for i, op in enumerate(ops) if op.kind is OpKind.GROUP_NORM)
    ops = _needed(ops[: last + 1])  # (not what only reads past the last GroupNorm: a spatial norm's)
    small = dataclasses.replace(p, ops=ops, output=ops[-1].dst, name=p.name + "[low pass]")
    return small, left


def _mean_of(g: int):
    """(x, ctx) -> the mean of every g x g block of each frame of x (B, C, T, H, W)."""
    return lambda t, ctx: F.avg_pool3d(t, (1, g, g))


def estimation_bytes(settings: Settings, job: Job, split: FastSplit, shape, tile: int) -> int:
    """The bytes the estimation pass holds besides its working set, for an input of `shape`: the sampled
    tiles' regions and caches, and a decode's head output."""
    p = job.program
    shapes = p.shapes(tuple(shape[-2:]))
    head = 0
    if job.kind is Kind.DECODE:
        frames = sum(p.frames(p.chunks(int(shape[2])))[split.cut])
        h, w = shapes[split.cut]
        head = int(shape[0]) * p.channels()[split.cut] * frames * h * w * job.item
    tiles = sampled(shapes, split.cut, part_tile(job, split, shape, tile),
                    settings.fast.fraction(Estimator.TILES))
    return held_bytes(p, split.part, shape, split.cut, tiles, job.item) + head


def part_tile(job: Job, split: FastSplit, shape, tile: int) -> int:
    """The run's tile (latent pixels) in pixels of the estimated part's reference value."""
    shapes = job.program.shapes(tuple(shape[-2:]))
    return max(1, tile * shapes[split.cut][0] // shapes[job.ref][0])


def fast_note(split: FastSplit | str | None, p, one: bool = False) -> str:
    """What mode="fast" does for a 3-D VAE's program (`one`: the input fits one tile)."""
    if not any(op.kind is OpKind.GROUP_NORM for op in p.ops):
        return "fast mode estimates GroupNorm statistics; this VAE has none: the run is exact"
    if one:
        return "fast mode: the input fits one tile, so the untiled run is taken: the run is exact"
    if isinstance(split, str):
        return f"fast mode runs this 3-D VAE exact: {split}"
    part = "high-resolution tail" if split.kind is Kind.DECODE else "high-resolution head"
    return (f"fast mode (approximate): the statistics of the {len(split.fixed)} GroupNorms of its {part} are "
            "estimated from a sample of its tiles, then every tile runs through them end to end")


def _needed(ops) -> list:
    """The ops of `ops` whose value the last op's output needs."""
    wanted = {ops[-1].dst}
    for op in reversed(ops):
        if op.dst in wanted:
            wanted.update(op.src)
    return [op for op in ops if op.dst in wanted]


def _feeds(ops) -> bool:
    """Whether every GroupNorm of `ops` feeds the last op's output."""
    kept = {id(op) for op in _needed(ops)}
    return all(id(op) in kept for op in ops if op.kind is OpKind.GROUP_NORM)


def _crossing(p, k: int, kind: Kind) -> set[str]:
    """Values made before op k (and p's input, but for a decode: its tail is given the latent) that ops
    from k on read."""
    made = {op.dst for op in p.ops[:k]} | ({p.input} if kind is Kind.ENCODE else set())
    return {s for op in p.ops[k:] for s in op.src if s in made}


def _scale(op, shapes) -> float:
    """How many times op's output is larger than its first input along each spatial side (1 where the
    sides scale differently or nothing is read)."""
    if not op.src or op.src[0] not in shapes:
        return 1
    (h0, w0), (h1, w1) = shapes[op.src[0]], shapes[op.dst]
    if not h0 or not w0 or h1 * w0 != w1 * h0:
        return 1
    return h1 / h0
