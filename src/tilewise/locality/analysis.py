"""Static tileability analysis of a tile program, and an empirical receptive-field probe for any module."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

import torch

from ..geometry import Box
from .lowering import lower
from .ops import Op, OpKind
from .program import Program, Segment, SegmentKind, back_propagate, split_segments

logger = logging.getLogger(__name__)


def _span(y: int, n_out: int, n_in: int) -> tuple[int, int]:
    """Input pixels [lo, hi] that output pixel y of n_out corresponds to when n_in maps onto n_out."""
    return (y * n_in) // n_out, max((y * n_in) // n_out, -(-(y + 1) * n_in // n_out) - 1)


def radius(ops: list[Op], src: str, dst: str, shapes: dict[str, tuple[int, int]]) -> int:
    """Receptive-field radius of dst in src pixels: max distance from an output's own span to its inputs."""
    h_in, w_in = shapes[src]
    h_out, w_out = shapes[dst]
    r = 0
    cy, cx = h_out // 2, w_out // 2
    period = max(1, -(-h_out // h_in), -(-w_out // w_in))
    for k in range(period + 1):
        y, x = cy + k, cx + k
        need = back_propagate(ops, {dst: (y, y + 1, x, x + 1)}).get(src)
        if need is None:
            continue
        ly, hy = _span(y, h_out, h_in)
        lx, hx = _span(x, w_out, w_in)
        r = max(r, ly - need[0], need[1] - 1 - hy, lx - need[2], need[3] - 1 - hx)
    return r


@dataclass
class SegmentReport:
    """Halo and resampling of one segment between sync points."""

    index: int
    kind: str
    first: str
    last: str
    n_ops: int
    halo: int  # receptive-field radius in pixels of the segment's first input
    scale: float  # output size / input size


@dataclass
class Report:
    """What `analyze` found: segments, sync ops, and whether finite-halo exact tiling is possible."""

    name: str
    segments: list[SegmentReport]
    sync_ops: list[tuple[str, str]]  # (module path, kind)
    local_halo: int  # receptive field radius in input pixels if every sync op were made local
    align: int  # tiles must align to this many input pixels (product of strides, or 1)
    scale: float  # output size / input size
    blockers: list[str] = field(default_factory=list)

    @property
    def exact_tileable(self) -> bool:
        """True when a finite halo makes tiles exact (no sync op)."""
        return not self.sync_ops

    @property
    def halo(self) -> int | None:
        """The finite halo (input pixels) when exact_tileable, else None."""
        return self.local_halo if self.exact_tileable else None

    def verdict(self) -> str:
        """One line: exact_tileable with its halo, or which ops prevent it."""
        if self.exact_tileable:
            return f"exact_tileable: yes, halo {self.local_halo} input px, align {self.align}"
        return "exact_tileable: no, global ops: " + "; ".join(self.blockers)

    def __str__(self) -> str:
        head = f"{'seg':>3}  {'kind':<9} {'ops':>4}  {'halo':>4}  {'scale':>6}  first .. last"
        rows = [f"{self.name}: {len(self.segments)} segments, {len(self.sync_ops)} sync ops", head]
        for s in self.segments:
            rows.append(f"{s.index:>3}  {s.kind:<9} {s.n_ops:>4}  {s.halo:>4}  {s.scale:>6.3g}  "
                        f"{s.first} .. {s.last}")
        rows.append(f"receptive field with sync ops made local: {self.local_halo} input px, "
                    f"align {self.align}")
        rows.append(self.verdict())
        return "\n".join(rows)


def cumulative_stride(program: Program) -> int:
    """The downsampling factor tiles must align to: the largest product of strides along any path from
    the input to an op (parallel branches, such as a downsampler and its shortcut, count once)."""
    acc = {program.input: 1}
    for op in program.ops:
        acc[op.dst] = max(acc.get(s, 1) for s in op.src) * getattr(op, "stride", (1, 1))[0]
    return max(acc.values())


def _blockers(sync: list[tuple[str, str]]) -> list[str]:
    names = {OpKind.GROUP_NORM: "GroupNorm (needs global statistics)",
             OpKind.ATTENTION: "attention (needs all tokens)",
             OpKind.WHOLE: "a module run whole (reads every position)"}
    out = []
    for kind in dict.fromkeys(k for _, k in sync):
        where = [n for n, k in sync if k == kind]
        shown = ", ".join(where[:4]) + (f", ... ({len(where)} in all)" if len(where) > 4 else "")
        out.append(f"{names.get(kind, kind)}: {shown}")
    return out


def _segment_report(i: int, seg: Segment, shapes) -> SegmentReport:
    dst = seg.outputs[-1] if seg.outputs else seg.ops[-1].dst
    srcs = seg.inputs or [seg.ops[0].src[0]]
    halo = 0 if seg.kind is not SegmentKind.LOCAL else max(radius(seg.ops, s, dst, shapes) for s in srcs)
    scale = shapes[dst][0] / shapes[srcs[0]][0]
    return SegmentReport(i, seg.kind, seg.ops[0].name, seg.ops[-1].name, len(seg.ops), halo, scale)


def analyze_program(program: Program, hw: tuple[int, int] = (64, 64)) -> Report:
    """Static analysis of a program: segments between sync points, their halos, the blockers."""
    shapes = program.shapes(hw)
    segs = split_segments(program)
    sync = [(op.name, op.kind) for op in program.ops if op.sync]
    align = cumulative_stride(program)
    local = radius(program.ops, program.input, program.output, shapes)
    scale = shapes[program.output][0] / hw[0]
    return Report(program.name, [_segment_report(i, s, shapes) for i, s in enumerate(segs)], sync, local,
                  align, scale, _blockers(sync))


def analyze(module, example_input=None) -> Report:
    """Lower `module` and report halos, sync points and the exact-tileability verdict (a static analysis)."""

    program = module if isinstance(module, Program) else lower(module, _example(module, example_input))
    hw = (64, 64) if example_input is None else tuple(int(s) for s in example_input.shape[-2:])
    grow = cumulative_stride(program)  # make the analysis image large enough that the halo is not clipped
    hw = (max(hw[0], 64 * grow), max(hw[1], 64 * grow))
    return analyze_program(program, hw)


def _example(module, example):
    """The example the lowering traces: the one given (a video's: its channels, `lower` makes its own
    frames and sides), or its own (None)."""
    if example is None or example.ndim not in (4, 5):
        return None
    return example


@dataclass
class ProbeResult:
    """Empirical receptive field: radius in input pixels, or whole-output influence."""

    radius: int | None
    whole_output: bool
    position: tuple[int, int]
    changed: Box | None  # bounding box of changed output pixels

    def __str__(self) -> str:
        if self.whole_output:
            return f"probe at input {self.position}: influence reaches the whole output (not finite-halo)"
        return f"probe at input {self.position}: receptive-field radius {self.radius} input px"


def probe_receptive_field(module, example_input, position: tuple[int, int] | None = None,
                          delta: float = 1.0) -> ProbeResult:
    """Perturb one input position (all channels, and all frames of a (B, C, T, H, W) video) and measure
    which outputs change (bitwise diff)."""

    if example_input.ndim not in (4, 5):
        raise ValueError(f"example_input must be (B, C, H, W) or a video (B, C, T, H, W), got shape "
                         f"{tuple(example_input.shape)}")
    h, w = example_input.shape[-2:]
    py, px = position if position is not None else (h // 2, w // 2)
    if not (0 <= py < h and 0 <= px < w):
        raise ValueError(f"position {(py, px)} is outside the input of size {(h, w)}")
    if not (isinstance(delta, int | float) and math.isfinite(delta) and delta != 0):
        raise ValueError(f"delta must be a finite non-zero number, got {delta!r}")
    if not bool(torch.isfinite(example_input).all()):
        bad = int((~torch.isfinite(example_input)).sum())
        raise ValueError(f"example_input of shape {tuple(example_input.shape)} holds {bad} NaN or inf "
                         "values: NaN != NaN, so every output would look changed and the receptive field be "
                         "wrong; "
                         "probe with a finite example")
    with torch.no_grad():
        y0 = module(example_input)
        x1 = example_input.clone()
        x1[..., py, px] += delta
        y1 = module(x1)
    y0 = getattr(y0, "sample", y0)
    y1 = getattr(y1, "sample", y1)
    if not bool(torch.isfinite(y0).all()):
        raise ValueError(f"{type(module).__name__} gives NaN or inf outputs on the finite example_input "
                         f"(shape {tuple(example_input.shape)}): the probe cannot tell which outputs change; "
                         "check the module's weights")
    changed = (y1 != y0).flatten(0, -3).any(0)
    ho, wo = changed.shape
    ys, xs = torch.nonzero(changed, as_tuple=True)
    if len(ys) == 0:
        return ProbeResult(0, False, (py, px), None)
    box = (int(ys.min()), int(ys.max()) + 1, int(xs.min()), int(xs.max()) + 1)
    if bool(changed.all()):
        logger.info("probe: every output changed; the influence is global (or the example is too small)")
        return ProbeResult(None, True, (py, px), box)
    r = 0
    for y in (box[0], box[1] - 1):
        lo, hi = _span(y, ho, h)
        r = max(r, lo - py, py - hi)
    for x in (box[2], box[3] - 1):
        lo, hi = _span(x, wo, w)
        r = max(r, lo - px, px - hi)
    return ProbeResult(r, False, (py, px), box)


def halo_for(program: Program, hw: tuple[int, int]) -> int:
    """Receptive-field radius of the whole program (sync ops taken as local) for an input of size hw."""
    return radius(program.ops, program.input, program.output, program.shapes(hw))


__all__ = ["Report", "ProbeResult", "analyze", "analyze_program", "probe_receptive_field", "halo_for"]
