"""A video value's tokens on their way to and from `scaled_dot_product_attention` (Cosmos'
CosmosCausalAttention processors; VidTok's attention block): the calls between (permute, flatten,
unflatten, transpose, aliases, a reshape merging adjacent axes or splitting a group back) are followed by
the axes they leave, each a group of the video value's axes (B, C, T, H, W; C split into heads N and head
channels D). At the attention, queries, keys and values must be one layout of three values, up to the
order of the dims before the last two (all batch dims to the attention: VidTok's (B, T, H W, C) is one
head of each frame's tokens): (B T, N, H W, D) (each frame's tokens: a `FrameSDPA`, its queries, keys
and values 1x1x1 projections of one value) or (B H W, N, T, D) (each position's frames: a `ColumnSDPA`,
no mask or the causal one, tril of ones over the frames, read from the calls that make it). Its output is
followed the same way until a permute gives back (B, C, T, H, W). Any other call on the tokens is refused
by name.
"""

from __future__ import annotations

from math import prod

from ..ops3d import CausalConv3d
from ..ops3d_sync import ColumnSDPA, FrameSDPA
from .capture import Call, Ref
from .state import Lowering, arg_of, permutation, reaches, refused

ALIASES = {"contiguous", "clone", "detach", "type_as", "to", "float"}
VIDEO = (("B",), ("C",), ("T",), ("H",), ("W",))
FRAME = (("B", "T"), ("N",), ("H", "W"), ("D",))  # each frame's tokens
COLUMN = (("B", "H", "W"), ("N",), ("T",), ("D",))  # each position's frames
SDPA = "scaled_dot_product_attention"


def sdpa_rule(low: Lowering, i: int, call: Call) -> bool:
    """A permute of a video value whose next calls reach a scaled_dot_product_attention: its tokens."""
    x = arg_of(call, 0, "input")
    if (not isinstance(x, Ref) or low.spatial(x.node) is None
            or not reaches(low, i, call.outs[0], SDPA, depth=6)):
        return False
    b, c, t, h, w = low.cap.values[x.node].shape
    sizes = {"B": b, "C": c, "T": t, "H": h, "W": w}
    low.sdpa[call.outs[0]] = (low.spatial(x.node), _permuted(VIDEO, permutation(call)), sizes)
    return True


def sdpa_call(low: Lowering, i: int, call: Call) -> None:
    """A call on a video value's tokens (module docstring); LoweringError for any other."""
    src = next(n for n in call.refs() if n in low.sdpa)
    name, axes, sizes = low.sdpa[src]
    out = call.outs[0] if len(call.outs) == 1 else None
    n = len(axes)
    if call.name in ALIASES and out is not None and arg_of(call, 0, "input") == Ref(src):
        new = axes
    elif call.name == "permute":
        new = _permuted(axes, permutation(call))
    elif call.name == "transpose":
        a, b = (int(arg_of(call, 1, "dim0")) % n, int(arg_of(call, 2, "dim1")) % n)
        new = list(axes)
        new[a], new[b] = new[b], new[a]
        new = tuple(new)
    elif call.name == "flatten":
        a, b = int(arg_of(call, 1, "start_dim", 0)) % n, int(arg_of(call, 2, "end_dim", -1)) % n
        new = (*axes[:a], tuple(x for g in axes[a : b + 1] for x in g), *axes[b + 1 :])
    elif call.name == "unflatten":
        new = _unflatten(low, call, axes, sizes)
    elif call.name in ("reshape", "view") and out is not None:
        new = _reshaped(axes, sizes, tuple(low.cap.values[out].shape))
    elif call.name == SDPA:
        _attention(low, call, sizes)
        return
    else:
        new = None
    if new is None or out is None:
        raise refused(low, call, "a call on a video value's tokens on their way to or from an attention "
                      "other than permute, transpose, flatten, unflatten, aliases and "
                      "scaled_dot_product_attention", final=True)
    new = tuple(("C",) if g == ("N", "D") else g for g in new)
    if new == VIDEO:
        low.set(out, name)
    else:
        low.sdpa[out] = (name, new, sizes)


def _permuted(axes: tuple, dims: tuple) -> tuple:
    return tuple(axes[d] for d in dims)


def _unflatten(low: Lowering, call: Call, axes: tuple, sizes: dict) -> tuple | None:
    """unflatten(dim, sizes) of a group of axes back into its axes, or of the channels into heads N and
    head channels D; None for any other."""
    dim, split = int(arg_of(call, 1, "dim")) % len(axes), tuple(int(s) for s in arg_of(call, 2, "sizes"))
    g = axes[dim]
    if g == ("C",) and len(split) == 2:
        heads = split[0] if split[0] != -1 else sizes["C"] // split[1]
        if heads <= 0 or sizes["C"] % heads or sizes.setdefault("N", heads) != heads:
            return None
        parts = (("N",), ("D",))
    elif len(g) == len(split) and all(s in (-1, sizes[a]) for a, s in zip(g, split, strict=True)):
        parts = tuple((a,) for a in g)
    else:
        return None
    return (*axes[:dim], *parts, *axes[dim + 1 :])


def _reshaped(axes: tuple, sizes: dict, shape: tuple) -> tuple | None:
    """The axes a reshape to `shape` leaves: adjacent groups merged (their sizes' product one dim) or a
    group split back into its axes (one dim each); None for any other reshape (one mixing axes)."""
    size = lambda g: prod(sizes[a] for a in g)  # noqa: E731
    new, k, dims = [], 0, list(shape)
    while dims:
        if k == len(axes):
            return None
        g, d = axes[k], dims[0]
        if len(g) > 1 and sizes[g[0]] != size(g) and tuple(dims[: len(g)]) == tuple(sizes[a] for a in g):
            new += [(a,) for a in g]  # (a group split back into its axes)
            dims, k = dims[len(g) :], k + 1
            continue
        merged, j = axes[k], k + 1
        while j < len(axes) and size(merged) < d:
            merged, j = merged + axes[j], j + 1
        while j < len(axes) and size(merged) == d and size(axes[j]) == 1 and len(dims) == 1:
            merged, j = merged + axes[j], j + 1  # (trailing axes of one: the last dim takes them)
        if size(merged) != d:
            return None
        new.append(merged)
        dims, k = dims[1:], j
    return tuple(new) if k == len(axes) else None


def _attention(low: Lowering, call: Call, sizes: dict) -> None:
    """scaled_dot_product_attention of three values' tokens in one layout: a FrameSDPA or a ColumnSDPA."""
    args = [arg_of(call, k, key) for k, key in enumerate(("query", "key", "value"))]
    found = [low.sdpa.get(a.node) if isinstance(a, Ref) else None for a in args]
    layouts = {_layout(f[1]) if f is not None else None for f in found}
    if len(layouts) != 1 or layouts.pop() not in (FRAME, COLUMN):
        raise refused(low, call, "an attention whose queries, keys and values are not one video value's "
                      "tokens of each frame (B T, N, H W, D) or of each position (B H W, N, T, D)",
                      final=True)
    extra = {k: v for k, v in call.kwargs.items() if k not in ("query", "key", "value", "attn_mask")}
    if len(call.args) > 4 or any(v not in (None, False, 0, 0.0) for v in extra.values()):
        raise refused(low, call, "an attention with dropout, is_causal, a scale or grouped keys", final=True)
    mask = arg_of(call, 3, "attn_mask")
    names, axes, heads = [f[0] for f in found], found[0][1], sizes.get("N", 1)
    if _layout(axes) == FRAME:
        if mask is not None:
            raise refused(low, call, "an attention over each frame's tokens with a mask", final=True)
        n, proj = _projections(low, call, names)
        dst = low.b.emit(FrameSDPA, (n,), call.where, proj=proj, heads=heads)
    else:
        causal = mask is not None and _causal(low, call, mask, sizes["T"])
        dst = low.b.emit(ColumnSDPA, tuple(names), call.where, heads=heads, causal=causal)
    low.sdpa[call.outs[0]] = (dst, axes, sizes)


def _layout(axes: tuple) -> tuple:
    """FRAME or COLUMN where the tokens are in one of them up to the order of the batch dims (every dim
    but the last two: (B, T, H W, C) is (B T, 1 head, H W, C)); else the axes as they are."""
    if len(axes) < 3:
        return axes
    batch, tokens, d = {a for g in axes[:-2] for a in g}, axes[-2], axes[-1]
    heads = {"N"} if d == ("D",) else set() if d == ("C",) else None
    for layout in (FRAME, COLUMN):
        if heads is not None and tokens == layout[2] and batch == set(layout[0]) | heads:
            return layout
    return axes


def _projections(low: Lowering, call: Call, names: list[str]) -> tuple[str, tuple]:
    """The one value queries, keys and values are 1x1x1 projections of, and their (weight, bias)."""
    made = {op.dst: op for op in low.b.ops}
    ops = [made.get(n) for n in names]
    ok = all(isinstance(op, CausalConv3d) and tuple(op.weight.shape[2:]) == (1, 1, 1) and op.groups == 1
             and op.stride == (1, 1) and op.stride_t == 1 and not any(op.padding) and not op.pad_t
             and not op.pad_end for op in ops)
    if not ok or len({op.src for op in ops}) != 1:
        raise refused(low, call, "an attention over each frame's tokens whose queries, keys and values are "
                      "not 1x1x1 projections of one value", final=True)
    return ops[0].src[0], tuple((op.weight, op.bias) for op in ops)


def _causal(low: Lowering, call: Call, mask, t: int) -> bool:
    """Whether a mask is the causal one between t frames, tril(ones(t, t)) cast to bool (Cosmos'
    `torch.tril(x.new_ones(T, T)).bool()`), read from the calls that make it (not evaluated)."""
    c = _made(low, mask)
    while c is not None and c.name in ("bool", "to", "contiguous") and (c.name != "to" or _to_bool(c)):
        c = _made(low, c.args[0])
    ok = c is not None and c.name == "tril" and arg_of(c, 1, "diagonal", 0) == 0
    ones = _made(low, c.args[0]) if ok else None
    if ones is not None and ones.name in ("new_ones", "ones"):
        shape = ones.args[1:] if ones.name == "new_ones" else ones.args
        shape = tuple(shape[0]) if len(shape) == 1 and isinstance(shape[0], list | tuple) else tuple(shape)
        if shape == (t, t):
            return True
    raise refused(low, call, "an attention mask over each position's frames that is not the causal one, "
                  "tril(ones(T, T)) (read from the calls that make it)", final=True)


def new_ones_rule(low: Lowering, i: int, call: Call) -> bool | str:
    """x.new_ones(T, T) of a video value read only on the way to an attention's mask (`_causal`): no op
    (its values follow the frame count the attention runs on, not the example's)."""
    nodes, reach = {call.outs[0]}, False
    for c in low.cap.calls[i + 1 :]:
        if not nodes & set(c.refs()):
            continue
        if c.name == SDPA and arg_of(c, 3, "attn_mask") in [Ref(n) for n in nodes] and not (
                nodes & {a.node for a in c.args[:3] if isinstance(a, Ref)}):
            reach = True
        elif c.name in ("tril", "bool", "to", "contiguous"):
            nodes.update(c.outs)
        else:
            return "new_ones of a video value read other than as an attention's causal mask"
    return reach or "new_ones of a video value read other than as an attention's causal mask"


def _to_bool(c: Call) -> bool:
    import torch

    return torch.bool in (*c.args[1:], *c.kwargs.values())


def _made(low: Lowering, ref) -> Call | None:
    k = low.cap.producer.get(ref.node) if isinstance(ref, Ref) else None
    return None if k is None else low.cap.calls[k]
