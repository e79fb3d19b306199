"""A video value's channels interleaved into its frames, as Wan's temporal upsampler computes it:
`x.reshape(B, k, C, T, H, W)`, `torch.stack((y[:, 0], ..., y[:, k - 1]), 3)`, `.reshape(B, C, T k, H, W)`:
frame t k + j of the output is channels [j C, (j + 1) C) of frame t of x. One `Rearrange` (k frames of
each frame, C of the k C channels), placed where the calls are exactly these (any other reader of their
values: not this rule's)."""

from __future__ import annotations

from ..ops3d import Rearrange
from .capture import Call, Ref
from .state import Lowering, arg_of, op_name


def interleave_rule(low: Lowering, i: int, call: Call) -> bool:
    """x.reshape(B, k, C, T, H, W) of a video value read as the module docstring says: the Rearrange of
    the whole run (its output the last reshape's); False for another reshape."""
    x = arg_of(call, 0, "input")
    if not isinstance(x, Ref) or low.spatial(x.node) is None or len(call.outs) != 1:
        return False
    b, c, t, h, w = low.cap.values[x.node].shape
    y = low.cap.values[call.outs[0]]
    if y.ndim != 6 or y.shape[0] != b or tuple(y.shape[3:]) != (t, h, w) or y.shape[1] * y.shape[2] != c:
        return False
    k, part = int(y.shape[1]), int(y.shape[2])
    items = _readers(low, i, call.outs[0])
    order = {r.outs[0]: _group(arg_of(r, 1, "indices")) for r in items if r.name == "__getitem__"}
    if len(order) != len(items) or sorted(order.values(), key=str) != list(range(k)):
        return False
    stacks = {id(s): s for r in items for s in _readers(low, i, r.outs[0])}
    if len(stacks) != 1:
        return False
    stack = next(iter(stacks.values()))
    parts = [p.node for p in arg_of(stack, 0, "tensors")]
    if stack.name != "stack" or arg_of(stack, 1, "dim", 0) != 3 or [order.get(p) for p in parts] != list(
            range(k)):
        return False
    back = _readers(low, i, stack.outs[0])
    if len(back) != 1 or back[0].name not in ("reshape", "view") or tuple(
            low.cap.values[back[0].outs[0]].shape) != (b, part, t * k, h, w):
        return False
    out = low.b.emit(Rearrange, (low.spatial(x.node),), op_name(call, "interleave"), channels=part,
                     fn=lambda v, ctx, k=k, c=part: v.unflatten(1, (k, c)).permute(0, 2, 3, 1, 4, 5)
                     .flatten(2, 3),
                     frames_fn=lambda n, step, k=k: n * k, label=f"{k} channel groups into frames")
    low.set(back[0].outs[0], out)
    return True


def _group(idx) -> int | None:
    """j of an index [:, j] (trailing slices whole) of a (B, k, C, T, H, W) value, else None."""
    whole = slice(None)
    if not isinstance(idx, tuple) or len(idx) < 2 or idx[0] != whole or any(s != whole for s in idx[2:]):
        return None
    return idx[1] if isinstance(idx[1], int) and not isinstance(idx[1], bool) else None


def _readers(low: Lowering, i: int, node: int) -> list[Call]:
    """The calls after call i that read node."""
    return [c for c in low.cap.calls[i + 1 :] if node in c.refs()]
