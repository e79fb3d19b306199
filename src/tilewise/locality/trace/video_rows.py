"""A video value's positions in the batch for a computation along time, run whole: VidTok's resnets'
1-D halves take `x.permute(0, 3, 4, 1, 2).reshape(B H W, C, T)` (each position's frames a row; from
its frames in the batch, `(B, T, C, H, W).permute(0, 3, 4, 2, 1)`), run a resnet of 1-D layers on the
rows (a LayerNorm over the channels through a permute, causal Conv1d's with their first frame repeated
in front, activations, sums) and go back by `.reshape(B, H, W, C', T').permute(0, 3, 4, 1, 2)`.

Whatever the calls on the rows compute, each row is one position's frames: the run from the reshape into
rows to the reshape back is one op of the video value, the calls replayed as they ran on each box's rows
(`rows_rule`), checked by measurement to be position by position (a row never reads another: `measure`)
and its frames measured (`frames_map`: a `Pointwise`, or a `Rearrange` of the frames). The calls on the
rows may read the rows and constants only, none of their sizes the example's frames or rows (sizes that
would not follow the input), and nothing after the run reads the rows. Where `video_pools` places the
rows' calls one by one (CogVideoX's, KVAE's samplers), it takes them first.
"""

from __future__ import annotations

from fractions import Fraction

import torch

from .capture import Call, Ref
from .measured import _emit, measure
from .state import Lowering, permutation

RESHAPES = ("reshape", "view", "flatten")
INTO = {(0, 1, 2, 3, 4): (0, 3, 4, 1, 2), (0, 2, 1, 3, 4): (0, 3, 4, 2, 1)}  # (the value's layout: its
# permute to (B, H, W, C, T)), of the video value (B, C, T, H, W) and of its frames unfolded (B, T, C, H, W)
SIZED = {"reshape", "view", "expand", "new_zeros", "new_empty", "new_ones", "repeat", "zeros", "ones"}


def rows_rule(low: Lowering, i: int, call: Call, name: str, layout: tuple) -> bool:
    """A permute to (B, H, W, C, T) of video value `name` (in `layout`: the permute that made the permuted
    tensor from it) whose one reader reshapes it to rows (B H W, C, T), the calls on the rows up to the
    reshape and permute back placed as one op (module docstring); False where they are not such a run."""
    if INTO.get(layout) != permutation(call):
        return False
    cap, node = low.cap, call.outs[0]
    b, h, w, c, t = cap.values[node].shape
    found = _run(low, i, node, (b * h * w, c, t))
    if found is None:
        return False
    calls, rows, back, at = found
    fn = _rows_fn(low, calls, rows, back)
    like = torch.empty((b, c, t, h, w), device="meta", dtype=cap.values[node].dtype)
    halo = measure(low.root, fn, like, Fraction(1))
    if halo != 0:  # (a row read another: not position by position)
        return False
    out = cap.values[back]
    shape = (int(out.shape[0]), int(out.shape[1]), int(out.shape[2]), int(out.shape[3]), int(out.shape[4]))
    made = _emit(low, (name,), f"{call.where}.rows" if call.where else "rows", fn, 0, Fraction(1), like,
                 torch.empty(shape, device="meta"), "rows: " + ", ".join(c.name for c in calls), len(calls))
    low.set(back, made)
    low.skip.update(at[1:])
    return True


def permute_rule(low: Lowering, i: int, call: Call) -> bool:
    """`rows_rule` of a permute of a video value (B, C, T, H, W)."""
    x = call.args[0] if call.args else None
    if not isinstance(x, Ref) or low.spatial(x.node) is None:
        return False
    return rows_rule(low, i, call, low.spatial(x.node), (0, 1, 2, 3, 4))


def _run(low: Lowering, i: int, node: int, rows: tuple):
    """(the calls on the rows, the rows' node, the node back in (B, C, T', H, W)) of the run from the
    permute (call i, making node) to the permute back; None where it is not one (module docstring)."""
    cap = low.cap
    b, h, w, _, t = cap.values[node].shape
    readers = [k for k in range(i + 1, len(cap.calls)) if node in cap.calls[k].refs()]
    if len(readers) != 1 or cap.calls[readers[0]].name not in RESHAPES:
        return None
    start = readers[0]
    entry = cap.calls[start]
    if len(entry.outs) != 1 or tuple(cap.values[entry.outs[0]].shape) != rows:
        return None
    region, calls, back, at = {entry.outs[0]}, [], None, [i, start]
    for k in range(start + 1, len(cap.calls)):
        c = cap.calls[k]
        refs = set(c.refs())
        if not refs & region or k not in low.live:
            continue
        if any(n not in region and n in low.tainted for n in refs) or len(c.outs) < 1:
            return None  # (another value of the input read: not the rows alone)
        last = calls[-1] if calls else None
        if c.name == "permute" and permutation(c) == (0, 3, 4, 1, 2) and last is not None and \
                last.name in RESHAPES and c.refs() == [last.outs[0]]:
            before, got = cap.values[last.outs[0]].shape, cap.values[c.outs[0]].shape
            if len(before) == 5 and tuple(before[:3]) == (b, h, w) and tuple(got[3:]) == (h, w):
                back = c.outs[0]
                calls.pop()
                at.append(k)
                break
        calls.append(c)
        at.append(k)
        region.update(c.outs)
    if back is None or not calls or any(c.name in SIZED and _sized(c, t, rows[0]) for c in calls):
        return None
    inner = region | {back}
    if any(inner - {back} & set(c.refs()) for k, c in enumerate(cap.calls) if k > at[-1] and k in low.live):
        return None  # (the rows read after the run)
    return calls, entry.outs[0], back, at


def _sized(c: Call, t: int, n: int) -> bool:
    """Whether a call names the example's frames or rows as a size (they would not follow the input)."""
    ints = [a for a in (*c.args[1:], *c.kwargs.values()) if isinstance(a, int) and not isinstance(a, bool)]
    ints += [v for a in c.args[1:] if isinstance(a, list | tuple) for v in a if isinstance(v, int)]
    return any(v in (t, n) for v in ints)


def _rows_fn(low: Lowering, calls: list[Call], rows: int, last: int):
    """The calls on the rows replayed as they ran, on a (B, C, T, H, W) box: its positions to rows and
    back."""
    out = calls[-1].outs[0]

    def bind(obj, env):
        if isinstance(obj, Ref):
            return env[obj.node] if obj.node in env else low.value(obj.node)
        if isinstance(obj, dict):
            return {k: bind(v, env) for k, v in obj.items()}
        if isinstance(obj, list | tuple):
            return type(obj)(bind(v, env) for v in obj)
        return obj

    def fn(x):
        b, c, t, h, w = x.shape
        env = {rows: x.permute(0, 3, 4, 1, 2).reshape(b * h * w, c, t)}
        for call in calls:
            y = call.func(*bind(call.args, env), **bind(call.kwargs, env))
            env.update(zip(call.outs, [y] if isinstance(y, torch.Tensor) else list(y), strict=False))
        y = env[out]
        return y.reshape(b, h, w, *y.shape[1:]).permute(0, 3, 4, 1, 2)

    return fn
