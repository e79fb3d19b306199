"""The order and fusion of a traced program's ops: dead ops dropped, chains of pointwise ops fused, a
value's last reader hoisted before its first where it can be (a resnet's shortcut projection)."""

from __future__ import annotations

from ..ops import Op, OpKind, Pointwise
from ..ops3d import Rearrange


def schedule(ops: list[Op], given: str) -> list[Op]:
    """ops with chains of single-reader pointwise ops fused and each value's last reader moved before its
    first where its other sources are ready (module docstring)."""
    return _hoist_last_readers(_fuse_pointwise(ops))


def _readers(ops: list[Op]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for i, op in enumerate(ops):
        for s in op.src:
            out.setdefault(s, []).append(i)
    return out


def _fuse_pointwise(ops: list[Op]) -> list[Op]:
    """Chains of unary pointwise ops, each read only by the next, as one op (kernels summed); a
    rearrangement of frames only after a rearrangement read only by it, as one (a depth-to-space that
    drops its first frames: LTX-Video's upsamplers)."""
    readers, out = _readers(ops), []
    for op in ops:
        prev = out[-1] if out else None
        if (op.kind is OpKind.REARRANGE and prev is not None and prev.kind is OpKind.REARRANGE
                and op.src == (prev.dst,) and len(readers.get(prev.dst, [])) == 1 and op.down == op.up == 1):
            out[-1] = _then(prev, op)
            continue
        if (op.kind is OpKind.POINTWISE and prev is not None and prev.kind is OpKind.POINTWISE
                and op.src == (prev.dst,) and len(readers.get(prev.dst, [])) == 1):
            f, g = prev.fn, op.fn
            out[-1] = Pointwise(src=prev.src, dst=op.dst, name=prev.name, fn=lambda t, f=f, g=g: g(f(t)),
                                label=f"{prev.label}, {op.label}", channels=op.channels,
                                kernels=prev.kernels + op.kernels)
        else:
            out.append(op)
    return out


def _hoist_last_readers(ops: list[Op]) -> list[Op]:
    """Move a value's second (and last) reader, a convolution, to just before its first where every
    source of it is made by then: the value then dies at its first reader, which may overwrite it (a
    resnet's shortcut projection before its GroupNorm). Each value is looked at once."""
    ops, seen = list(ops), set()
    while True:
        made = {op.dst: i for i, op in enumerate(ops)}
        hit = None
        for v, rs in _readers(ops).items():
            if v in seen or len(rs) != 2:
                continue
            first, last = rs
            op = ops[last]
            if op.kind is OpKind.CONV and all(made.get(s, -1) < first for s in op.src):
                hit = (v, first, last)
                break
        if hit is None:
            return ops
        v, first, last = hit
        seen.add(v)
        ops.insert(first, ops.pop(last))


def live_ops(ops: list[Op], out: str) -> list[Op]:
    """ops without those no later op (or the output) reads (a module replaced by one op leaves its first
    calls' ops dead)."""
    want, keep = {out}, []
    for op in reversed(ops):
        if op.dst in want:
            keep.append(op)
            want.update(op.src)
    return keep[::-1]


def _then(a: Rearrange, b: Rearrange) -> Rearrange:
    """Rearrangement a, then b (of frames only: a's geometry)."""
    fa, fb = a.fn, b.fn

    def frames(t, step):
        return b.frames([a.frames([t], step)], step)

    return Rearrange(src=a.src, dst=b.dst, name=a.name, fn=lambda t, ctx: fb(fa(t, ctx), ctx), down=a.down,
                     up=a.up, channels=a.channels, frames_fn=frames, label=f"{a.label}, {b.label}")
