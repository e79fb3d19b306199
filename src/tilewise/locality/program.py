"""The tile program: ops in execution order over named values, segments between sync points, a region
interpreter (`run_op`) and the back-propagation of boxes that tells each op what it must compute.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from ..geometry import Box
from ..vocabulary import Vocabulary
from .boxes import Upsampled, clip_box, union_box
from .ops import Op, OpKind, RunContext


@dataclass
class Program:
    """A lowered module: ops in execution order over named values, from `inputs[0]` to `output`."""

    ops: list[Op]
    input: str
    output: str
    in_channels: int
    name: str = ""
    call: Any = None  # values its ops read that each call computes (`trace.percall.CallValues`), or None

    def shapes(self, hw: tuple[int, int]) -> dict[str, tuple[int, int]]:
        """Spatial shape of every value for an input of spatial shape hw."""
        out = {self.input: tuple(hw)}
        for op in self.ops:
            out[op.dst] = op.out_shape([out[s] for s in op.src])
        return out

    def channels(self) -> dict[str, int]:
        """Channel count of every value."""
        out = {self.input: self.in_channels}
        for op in self.ops:
            out[op.dst] = op.out_channels([out[s] for s in op.src])
        return out

    def run(self, x, ctx: RunContext | None = None):
        """Untiled interpreter: every op on the whole image (the lowering's reference run)."""
        ctx = ctx or RunContext()
        shapes = self.shapes(tuple(x.shape[-2:]))
        full = {v: (0, h, 0, w) for v, (h, w) in shapes.items()}
        vals = {self.input: (x, full[self.input])}
        last = last_use(self.ops, [self.output])
        for i in range(len(self.ops)):
            run_op(self.ops, i, ctx, vals, full, shapes, last, shared=[x])
        return vals[self.output][0]


def run_op(ops: list[Op], i: int, ctx: RunContext, vals: dict, need: dict[str, Box], shapes, last: dict,
           keep=(), shared=()) -> None:
    """Run ops[i] on its `need` box: vals (value -> (tensor, box)) gains its output and loses the values
    read for the last time (`last`, from last_use) unless kept.

    Working memory, same values: an op whose first input dies here and is ours (not `shared`: the
    program input, staged values) may overwrite it (activations, GroupNorm); an upsampling read only by
    the convolution right after it is never materialised whole (`Upsampled`).
    """
    op = ops[i]
    ins = [vals[s][0] for s in op.src]
    have = [vals[s][1] for s in op.src]
    nxt = ops[i + 1] if i + 1 < len(ops) else None
    if (op.kind is OpKind.RESAMPLE and nxt is not None and nxt.kind is OpKind.CONV and nxt.src == (op.dst,)
            and last.get(op.dst) == i + 1 and op.dst not in keep):
        y = op.lazy(ins, have)
    else:
        others = [*shared, *(t for v, (t, _) in vals.items() if v != op.src[0])]
        run = op.run_in_place if may_overwrite(op, i, last, keep, ins, others) else op.run
        y = run(ctx, ins, have, need[op.dst], [shapes[s] for s in op.src])
    vals[op.dst] = (y, need[op.dst])
    for s in set(op.src):
        if last.get(s) == i and s not in keep:
            del vals[s]


def may_overwrite(op: Op, i: int, last: dict[str, int], keep, ins: list, shared) -> bool:
    """Whether op (the i-th) may overwrite its first input: this is the input's last read, the value is
    not kept, no other source of op is the same value, and it shares no memory with `shared` (the
    program input, staged values and every other live value: identity ops alias their input). Never while
    autograd records (a graph may have saved the input: the 3-D VAEs' recomputed steps)."""
    if torch.is_grad_enabled():
        return False
    s = op.src[0]
    if last.get(s) != i or s in keep or op.src.count(s) > 1 or isinstance(ins[0], Upsampled):
        return False
    key = _storage(ins[0])
    return all(isinstance(t, Upsampled) or _storage(t) != key for t in shared)


def _storage(t) -> int:
    """Identity of the memory a tensor views (its storage; fake tensors, which have no data pointer,
    included)."""
    return t.untyped_storage()._cdata


def last_use(ops: list[Op], keep: list[str]) -> dict[str, int]:
    """Index of the last op reading each value (values in `keep` are never freed)."""
    last: dict[str, int] = {}
    for i, op in enumerate(ops):
        for s in op.src:
            last[s] = i
    for k in keep:
        last.pop(k, None)
    return last


class SegmentKind(Vocabulary):
    """A segment of local ops (halos, tiles) or one global attention op (all tokens' keys first)."""

    LOCAL = "local"
    ATTENTION = "attention"
    WHOLE = "whole"  # one op run on the whole of its inputs (`ops_traced.Whole`)


@dataclass
class Segment:
    """A run of ops between sync points: reads `inputs` (staged), produces `outputs` (staged but those
    `measured`: their cores' statistics taken, nothing stored; a later segment recomputes them); `again`:
    ids of ops an earlier segment ran too (their GroupNorm affines made there)."""

    ops: list[Op]
    inputs: list[str] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)
    kind: SegmentKind = SegmentKind.LOCAL
    measured: list[str] = field(default_factory=list)
    again: frozenset = frozenset()


def split_segments(program: Program, is_global: Callable[[Op], bool] | None = None) -> list[Segment]:
    """Cut the program before every sync op whose input is produced in the current segment.

    `is_global(op)` says which ops are barriers (default: every sync op); a global attention op forms
    a segment of its own.
    """
    is_global = is_global or (lambda op: op.sync)
    segments: list[Segment] = []
    cur: list[Op] = []
    made: set[str] = set()

    def close():
        nonlocal cur, made
        if cur:
            segments.append(Segment(ops=cur))
        cur, made = [], set()

    for op in program.ops:
        if not is_global(op):
            cur.append(op)
        elif op.kind in (OpKind.ATTENTION, OpKind.WHOLE):
            close()
            kind = SegmentKind.ATTENTION if op.kind is OpKind.ATTENTION else SegmentKind.WHOLE
            segments.append(Segment(ops=[op], kind=kind))
        else:
            if any(s in made for s in op.src):
                close()
            cur.append(op)
        made.add(op.dst)
    close()
    _link(segments, program)
    return segments


def _link(segments: list[Segment], program: Program) -> None:
    """Fill each segment's staged inputs and outputs from value producers and consumers (a value no op
    makes is given from outside, as the program input is: fast mode's estimated part of a program)."""
    producer = {program.input: -1}
    for i, seg in enumerate(segments):
        for op in seg.ops:
            producer[op.dst] = i
    for i, seg in enumerate(segments):
        for op in seg.ops:
            for s in op.src:
                p = producer.get(s, -1)
                if p != i:
                    if s not in seg.inputs:
                        seg.inputs.append(s)
                    if p >= 0 and s not in segments[p].outputs:
                        segments[p].outputs.append(s)
    last = segments[producer[program.output]] if producer.get(program.output, -1) >= 0 else None
    if last is not None and program.output not in last.outputs:
        last.outputs.append(program.output)


# ops a reader may run again on its own tile to recompute a value (local: boxes back-propagate; a
# GroupNorm here has its statistics from an earlier segment)
RECOMPUTABLE = (OpKind.CONV, OpKind.POINTWISE, OpKind.ADD, OpKind.GROUP_NORM, OpKind.RESAMPLE)


def recomputable(segments: list[Segment], given: str, longer: bool = False) -> list[str]:
    """Staged values a later segment could recompute instead of reading (`recompute`), in program order:
    a GroupNorm input made in a local segment by local ops (RECOMPUTABLE) from that segment's staged
    inputs, each of which stays staged until the value's last reader anyway (`given`, the program input,
    stays to the end). `longer`: those inputs may also be staged longer for it (read by the value's
    readers too), a value may be made from values recomputed themselves (a chain: its readers remake
    it from the chain's staged leaves), and it may be any value only local segments read (a resnet's
    shortcut, read by its residual add)."""
    last = _last_readers(segments, given)
    out = []
    for seg in segments:
        for v in seg.outputs:
            if v not in last or v in seg.measured or seg.kind is not SegmentKind.LOCAL:
                continue  # (the output, or a value no segment reads)
            readers = [s for s in segments if v in s.inputs]
            normed = all(any(op.kind is OpKind.GROUP_NORM and op.src[0] == v for op in s.ops)
                         for s in readers)
            local = all(s.kind is SegmentKind.LOCAL for s in readers)
            made = _made_from(seg, v)
            if made is None or not (normed or (longer and local)):
                continue
            if longer or all(u == given or last.get(u, -1) >= last[v] for u in made[1]):
                out.append(v)
    return out


def recompute(segments: list[Segment], values, given: str) -> list[Segment]:
    """The segments with each of `values` recomputed, not staged: the segment making it still computes
    it for its statistics (`Segment.measured`) but stores nothing; each segment reading it first runs
    the ops that make it, on its own tile from the staged values they read (a bigger halo, more FLOPs,
    fewer staged bytes; those values staged until its last reader). Values in program order, each
    `recomputable` (`longer`) among the segments so far: a value made from one recomputed before it is
    remade from that one's staged leaves (a chain)."""
    segs = [replace(s, ops=list(s.ops), inputs=list(s.inputs), outputs=list(s.outputs),
                    measured=list(s.measured)) for s in segments]
    order = {id(op): k for k, op in enumerate(op for s in segments for op in s.ops)}
    for v in values:
        if v not in recomputable(segs, given, longer=True):
            raise ValueError(f"value {v!r} cannot be recomputed by its readers; recomputable: "
                             f"{recomputable(segs, given, longer=True)}")
        i = next(k for k, s in enumerate(segs) if v in s.outputs)
        ops, leaves = _made_from(segs[i], v)
        segs[i].measured.append(v)
        for j, seg in enumerate(segs):
            if j == i or v not in seg.inputs:
                continue
            have = {id(op) for op in seg.ops}
            new = [op for op in ops if id(op) not in have]
            seg.ops = sorted(new + seg.ops, key=lambda op: order[id(op)])
            seg.inputs = [u for u in seg.inputs if u != v] + [u for u in leaves if u not in seg.inputs]
            seg.again = seg.again | {id(op) for op in new}
    return segs


def _made_from(seg: Segment, v: str) -> tuple[list[Op], list[str]] | None:
    """The ops of seg that make v and the staged inputs of seg they read, or None when one of them is
    not RECOMPUTABLE."""
    need, ops = {v}, []
    for op in reversed(seg.ops):
        if op.dst in need:
            if op.kind not in RECOMPUTABLE:
                return None
            ops.append(op)
            need.update(op.src)
    made = {op.dst for op in seg.ops}
    return ops[::-1], [u for u in seg.inputs if u in need and u not in made]


def _last_readers(segments: list[Segment], given: str) -> dict[str, int]:
    """Index of the last segment reading each staged value (not `given`)."""
    last = {u: i for i, s in enumerate(segments) for u in s.inputs}
    last.pop(given, None)
    return last


def back_propagate(ops: list[Op], wants: dict[str, Box], shapes: dict | None = None) -> dict[str, Box]:
    """Box of every value needed to produce the wanted boxes (clipped to the image when shapes given)."""
    need: dict[str, Box] = dict(wants)
    for op in reversed(ops):
        box = need.get(op.dst)
        if box is None:
            continue
        for s, b in zip(op.src, op.input_boxes(box), strict=True):
            if shapes is not None:
                b = clip_box(b, shapes[s])
            need[s] = union_box(need.get(s), b)
    return need
