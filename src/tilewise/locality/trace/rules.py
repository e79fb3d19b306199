"""The rules: each recorded call placed as a primitive op by what the call is (the package docstring
lists them); a call no rule places is refused here and handed to `measured` by the driver."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..build import LoweringError
from ..ops import Add, OpKind, Pointwise
from ..ops_traced import Cat, Combine, Slice
from ..units import (
    CHANNEL_ATTENTION,
    FRAME_ATTENTION,
    attention,
    channel_attention,
    frame_attention,
)
from .capture import Call, Ref, capture, needed
from .frames import FRAME_RULES, carry
from .layers import LAYER_RULES
from .state import Lowering, arg_of, channel_dim, is_attention, op_name, refused
from .video import SQUEEZED_RULES, VIDEO_RULES
from .video_batch import batch_call
from .video_fold import fold_call
from .video_frames import KEEP_PARTS
from .video_pools import column_call, group_call
from .video_samples import sample_call
from .video_sdpa import sdpa_call
from .video_tokens import token_call

ALIASES = {"contiguous", "clone", "detach", "dropout", "float", "to", "type_as", "half", "bfloat16", "double"}


UNARY = {"silu", "relu", "gelu", "mish", "sigmoid", "tanh", "clamp", "clip", "neg", "exp", "log", "abs",
         "sqrt", "rsqrt", "square", "pow", "hardtanh", "leaky_relu", "softplus", "elu", "selu", "erf",
         "silu_", "relu_", "clamp_", "tanh_", "sigmoid_", "neg_", "nan_to_num", "reciprocal"}


ARITHMETIC = {"add", "sub", "mul", "div", "true_divide", "__rsub__", "__rdiv__", "__rtruediv__", "rsub",
              "add_", "sub_", "mul_", "div_", "__radd__", "__rmul__"}


IN_PLACE_FORM = {"silu": "silu_", "relu": "relu_", "mish": "mish_"}  # (activations: F.x(t, inplace=True))


def lower_call(low: Lowering, i: int, call: Call) -> None:
    """Place one recorded call (module docstring); LoweringError for one no rule places."""
    if i in low.skip:  # (a call of a run one op placed: `video_rows`)
        return
    if any(n in low.tokens for n in call.refs()):  # (a video value's tokens, to or from an Attention)
        token_call(low, i, call)
        return
    if any(n in low.sdpa for n in call.refs()):  # (a video value's tokens, to or from an attention)
        sdpa_call(low, i, call)
        return
    if any(n in low.folds for n in call.refs()):  # (its frames in the batch, to a GroupNorm of each frame)
        fold_call(low, i, call)
        return
    if any(n in low.groups for n in call.refs()):  # (its frames' channels in groups, `video_pools`)
        group_call(low, i, call)
        return
    if any(n in low.columns for n in call.refs()):  # (each position's frames a row, `video_pools`)
        column_call(low, i, call)
        return
    if any(n in low.samples for n in call.refs()):  # (one sample of its batch, `video_samples`)
        sample_call(low, i, call)
        return
    if any(n in low.batched for n in call.refs()):  # (its frames in the batch, a 2-D layer of each frame)
        batch_call(low, i, call, _two_d, UNARY | ARITHMETIC | ALIASES)
        return
    spatial = [n for n in call.refs() if low.spatial(n) is not None or n in low.pads or n in low.windows
               or n in low.window_convs or n in low.fronts or n in low.writes or n in low.caches]
    # (paddings, windows of frames: `video_windows`; a first frame repeated, a buffer written in part:
    # `video_writes`; a causal cache read: `video_caches`)
    if any(n in low.writes for n in call.refs()) and call.name != "__setitem__":
        raise refused(low, call, "a read of a buffer of video frames written in part")
    if not spatial:  # (constants the forward made: sizes, masks, casts of parameters)
        return
    if low.cap.values[low.cap.input].ndim == 4:  # (a 2-D program: its one-frame values, `frames`)
        placed = FRAME_RULES[call.name](low, i, call) if call.name in FRAME_RULES else False
    else:
        if any(n in low.squeezed for n in spatial):
            rule = SQUEEZED_RULES.get(call.name) or (_unary if call.name in UNARY else None)
            placed = rule(low, i, call) if rule is not None else False
            if placed is not True:
                raise refused(low, call, placed or "a call on a video value's one frame squeezed to "
                              "(B, C, H, W) (placed: interpolate, unsqueeze(2), elementwise functions)")
            low.squeezed.update(n for n in call.outs if low.spatial(n) and low.cap.values[n].ndim == 4)
            _keep_parts(low, call)
            return
        video = VIDEO_RULES.get(call.name) if any(low.cap.values[n].ndim == 5 for n in spatial) else None
        placed = video(low, i, call) if video is not None else False
    if placed is True:
        _keep_parts(low, call)
        return
    if isinstance(placed, str):
        raise refused(low, call, placed)
    rule = RULES.get(call.name) or (_unit if call.module is not None else None)
    if rule is None:
        rule = _arithmetic if call.name in ARITHMETIC else _unary if call.name in UNARY else None
    placed = rule is not None and rule(low, i, call)
    if placed is not True:
        raise refused(low, call, placed or "no rule places it as an op of a tile program")
    _keep_parts(low, call)


def _two_d(low: Lowering, i: int, call: Call) -> bool | str:
    """The 2-D rules' placing of a call (`video_batch`: on a video value's frames in the batch)."""
    rule = RULES.get(call.name) or (_arithmetic if call.name in ARITHMETIC else _unary if call.name in UNARY
                                    else None)
    return rule(low, i, call) if rule is not None else False


def _keep_parts(low: Lowering, call: Call) -> None:
    """A call that keeps its input a part of a split of frames (`video_frames.KEEP_PARTS`) passes it on."""
    channels = call.name in ("split", "chunk", "cat", "concat", "concatenate") and channel_dim(
        arg_of(call, 2 if call.name in ("split", "chunk") else 1, "dim", 0), 5)  # (of its channels)
    if (call.name in KEEP_PARTS and len(call.outs) == 1) or channels:  # (a split's every output: a part)
        parts = {low.frame_parts[n] for n in call.refs() if n in low.frame_parts}
        if len(parts) == 1:
            part = parts.pop()
            low.frame_parts.update({n: part for n in call.outs})


def _alias(low: Lowering, i: int, call: Call) -> bool:
    x = arg_of(call, 0, "input")
    if not isinstance(x, Ref) or low.spatial(x.node) is None:
        return False
    t_in, t_out = low.cap.values[x.node], low.cap.values[call.outs[0]]
    drawn = call.name == "dropout" and bool(arg_of(call, 2, "training", True))
    if drawn and float(arg_of(call, 1, "p", 0.5)) > 0:
        raise refused(low, call, "dropout in training mode draws random masks (no tile program reproduces "
                      "them): call .eval() on the wrapped module", final=True)
    if t_out.dtype != t_in.dtype or t_out.shape != t_in.shape:
        return _unary(low, i, call)  # (a cast: an elementwise function)
    low.set(call.outs[0], low.spatial(x.node))
    return True


def _unary(low: Lowering, i: int, call: Call, kernels: int = 1) -> bool:
    """An elementwise function of one spatial value, the call replayed with the box in its place; a
    division by a number of an Add's output that only it reads is that Add's scale ((a + b) / s: the
    resnets' output_scale_factor)."""
    if _scaled_add(low, call):
        return True
    refs = call.refs()
    spatial = [n for n in refs if low.spatial(n) is not None]
    if len(set(spatial)) != 1 or len(call.outs) != 1:
        return False
    x = spatial[0]
    t_in, t_out = low.cap.values[x], low.cap.values[call.outs[0]]
    if t_out.shape[-2:] != t_in.shape[-2:] or t_out.ndim != t_in.ndim or t_out.shape[2:] != t_in.shape[2:]:
        return False
    plain = call.name in UNARY | ARITHMETIC | ALIASES and len(call.refs()) == 1  # (no tensor but x)
    fn = carry(low, [x], call.outs[0], _replay(low, call, x), plain)
    in_place = IN_PLACE_FORM.get(call.name)
    fn_ = None
    if in_place:
        f = getattr(torch.nn.functional, call.name)
        fn_ = lambda t: f(t, inplace=True)  # noqa: E731
    out = low.b.emit(Pointwise, (low.spatial(x),), op_name(call, call.name), fn=fn, label=call.name,
                     channels=int(low.cap.values[call.outs[0]].shape[1]), kernels=kernels, fn_=fn_)
    low.set(call.outs[0], out)
    return True


def _scaled_add(low: Lowering, call: Call) -> bool:
    """(a + b) / s folded into the Add (module docstring of `_unary`)."""
    x, s = arg_of(call, 0, "input"), arg_of(call, 1, "other")
    if call.name not in ("div", "true_divide") or not isinstance(x, Ref) or not isinstance(s, int | float):
        return False
    last = low.b.ops[-1] if low.b.ops else None
    if last is None or last.kind is not OpKind.ADD or last.scale != 1.0 or last.dst != low.spatial(x.node):
        return False
    if low.readers.get(x.node, 0) != 1:
        return False
    last.scale = float(s)
    low.set(call.outs[0], last.dst)
    return True


def _arithmetic(low: Lowering, i: int, call: Call) -> bool:
    """x op y: of two spatial values of one shape, an Add (x + y, alpha 1) or a Combine; else unary."""
    a, b = arg_of(call, 0, "input"), arg_of(call, 1, "other")
    na = low.spatial(a.node) if isinstance(a, Ref) else None
    nb = low.spatial(b.node) if isinstance(b, Ref) else None
    if na is None or nb is None:
        return _unary(low, i, call)
    if low.cap.values[a.node].shape != low.cap.values[b.node].shape or "alpha" in call.kwargs:
        return False
    op = call.name.strip("_")
    if op == "add":
        out = low.b.emit(Add, (na, nb), op_name(call, "add"))
    else:
        fns = {"sub": torch.sub, "mul": torch.mul, "div": torch.div, "true_divide": torch.div,
               "rsub": lambda x, y: torch.sub(y, x), "rdiv": lambda x, y: torch.div(y, x)}
        if op not in fns:
            return False
        out = low.b.emit(Combine, (na, nb), op_name(call, op), fn=fns[op], label=op)
    low.set(call.outs[0], out)
    return True


def _channel_repeat(low: Lowering, i: int, call: Call) -> bool | str:
    """x.repeat_interleave(r, dim=1): every channel r times, position by position."""
    ndim = low.cap.values[call.outs[0]].ndim
    if not channel_dim(arg_of(call, 2, "dim"), ndim) or not isinstance(arg_of(call, 1, "repeats"), int):
        return "repeat_interleave along another dim than the channels"
    return _unary(low, i, call)


def _repeat(low: Lowering, i: int, call: Call) -> bool | str:
    """x.repeat(1, n, 1, 1[, 1]): the channels n times over, position by position."""
    reps = call.args[1:] if len(call.args) > 2 else arg_of(call, 1, "repeats")
    reps = tuple(reps) if isinstance(reps, list | tuple) else (reps,)
    if len(reps) < 4 or reps[0] != 1 or any(r != 1 for r in reps[2:]):
        return f"repeat {reps} (only the channels are repeated position by position)"
    return _unary(low, i, call)


def _cat(low: Lowering, i: int, call: Call) -> bool:
    tensors, dim = arg_of(call, 0, "tensors"), arg_of(call, 1, "dim", 0)
    if not channel_dim(dim, low.cap.values[call.outs[0]].ndim):
        return False
    if not all(isinstance(t, Ref) and low.spatial(t.node) for t in tensors):
        return False
    out = low.b.emit(Cat, tuple(low.spatial(t.node) for t in tensors), op_name(call, "cat"))
    low.set(call.outs[0], out)
    return True


def _slices(low: Lowering, i: int, call: Call) -> bool:
    """chunk / split / __getitem__ along channels: one Slice op per output."""
    x = arg_of(call, 0, "input")
    if not isinstance(x, Ref) or low.spatial(x.node) is None:
        return False
    src = low.cap.values[x.node]
    if call.name == "__getitem__":
        starts = _channel_item(arg_of(call, 1, "indices"), src.shape[1])
        if starts is None:
            return False
        bounds = [starts]
    else:
        if not channel_dim(arg_of(call, 2, "dim", 0), src.ndim):
            return False
        sizes = [int(low.cap.values[n].shape[1]) for n in call.outs]
        edges = [sum(sizes[:k]) for k in range(len(sizes) + 1)]
        bounds = list(zip(edges[:-1], edges[1:], strict=True))
    for n, (a, z) in zip(call.outs, bounds, strict=True):
        out = low.b.emit(Slice, (low.spatial(x.node),), op_name(call, f"channels {a}:{z}"), start=a, stop=z)
        low.set(n, out)
    return True


def _channel_item(idx, channels: int) -> tuple[int, int] | None:
    """(start, stop) of x[idx] when idx slices channels only (x[:, a:b]), else None."""
    if not isinstance(idx, tuple) or len(idx) < 2 or idx[0] != slice(None):
        return None
    if any(s != slice(None) for s in idx[2:]) or not isinstance(idx[1], slice):
        return None
    if idx[1].step not in (None, 1):
        return None
    start, stop, _ = idx[1].indices(channels)
    return start, stop


def _unit(low: Lowering, i: int, call: Call) -> bool:
    """A unit module's call: diffusers' Attention (`units.attention`), its spatial norm (MoVQ's: the
    latent conditions the norm) lowered in line first."""
    if type(call.module).__name__ in CHANNEL_ATTENTION:  # (on a 2-D program's one-frame value)
        x = arg_of(call, 0, "x")
        if not isinstance(x, Ref) or low.spatial(x.node) is None or len(call.refs()) != 1:
            return False
        low.set(call.outs[0], channel_attention(low.b, call.module, low.spatial(x.node), call.where))
        return True
    if type(call.module).__name__ in FRAME_ATTENTION:  # (on a video value: over each frame's tokens)
        x = arg_of(call, 0, "x")
        if not isinstance(x, Ref) or low.spatial(x.node) is None or len(call.refs()) != 1:
            return False
        low.set(call.outs[0], frame_attention(low.b, call.module, low.spatial(x.node), call.where))
        return True
    x = arg_of(call, 0, "hidden_states")
    if not isinstance(x, Ref) or low.spatial(x.node) is None or x.node in low.framed:
        return False
    temb, a, n = arg_of(call, 2, "temb"), call.module, None
    if getattr(a, "spatial_norm", None) is not None:
        if not isinstance(temb, Ref) or low.spatial(temb.node) is None:
            return "its spatial norm has no spatial latent to condition on"
        n = _inline(low, a.spatial_norm, [x.node, temb.node])
    elif len(call.refs()) != 1:
        return "an Attention call with other tensor inputs than its hidden states"
    out = attention(low.b, a, low.spatial(x.node), call.where, normed=n)
    low.set(call.outs[0], out)
    return True


def _inline(low: Lowering, module: torch.nn.Module, nodes: list[int]) -> str:
    """module(*values of nodes) lowered into the same program (its calls captured on their meta values
    and placed as the outer lowering's are): the name of its output value."""
    cap = capture(module, module, tuple(low.cap.values[n] for n in nodes), is_attention)
    inner = Lowering(cap, module, low.b)
    for n, outer in zip(cap.inputs, nodes, strict=True):
        inner.set(n, low.spatial(outer))
    live = inner.live = needed(cap)
    for k, c in enumerate(cap.calls):
        if k in live:
            for r in c.refs():
                inner.readers[r] = inner.readers.get(r, 0) + 1
    for k, c in enumerate(cap.calls):
        if k in live:
            lower_call(inner, k, _prefixed(c, module, low, nodes))
    out = inner.spatial(cap.output)
    if out is None:
        raise LoweringError(f"cannot lower {type(module).__name__}: its output is not spatial")
    return out


def _prefixed(c: Call, module, low: Lowering, nodes) -> Call:
    """A call of an in-line module named under the path it has in the outer module."""
    path = next((p for p, m in low.root.named_modules() if m is module), type(module).__name__)
    c.where = f"{path}.{c.where}" if c.where else path
    return c


RULES: dict[str, Callable] = {
    **LAYER_RULES, "cat": _cat, "concatenate": _cat,
    "concat": _cat, "chunk": _slices, "split": _slices,
    "__getitem__": _slices, "repeat_interleave": _channel_repeat, "repeat": _repeat,
    **{a: _alias for a in ALIASES},
}


def _replay(low: Lowering, call: Call, x: int) -> Callable:
    """call's function of the tensor in place of node x (the other arguments as they were; the running
    call's values of those it computes per call)."""

    def bind(obj, t):
        if isinstance(obj, Ref):
            return t if obj.node == x else low.value(obj.node)
        if isinstance(obj, dict):
            return {k: bind(v, t) for k, v in obj.items()}
        if isinstance(obj, list | tuple):
            return type(obj)(bind(v, t) for v in obj)
        return obj

    func, args, kwargs = call.func, call.args, call.kwargs
    return lambda t: func(*bind(args, t), **bind(kwargs, t))
