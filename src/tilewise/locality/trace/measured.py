"""What no rule places, placed by measuring it: a run of calls that leaves the spatial layout and comes
back (`inline_region`), or the module call around the call (`enclosing`, `opaque`), as one op whose halo is
measured on a random input and checked on crops (`measure`): `Pointwise`, `Local`, or `Whole` at the
latent's resolution; else refused."""

from __future__ import annotations

from collections.abc import Callable
from fractions import Fraction

import torch

from ..ops import Pointwise
from ..ops_traced import Local, Whole
from .capture import Call, Ref
from .state import Lowering, op_name, refused


def inline_region(low: Lowering, i: int) -> int | None:
    """Calls i.. of one spatial value that leave the spatial layout and come back to it (a view and a
    mean over channel groups in a forward, ...), placed as one op by their measured locality (their
    recorded sizes of the value's height, width and batch follow the box they run on). The index after
    them, or None where they are not such a run or are not local."""
    cap, values = low.cap, low.cap.values
    first = cap.calls[i]
    srcs = [n for n in first.refs() if low.spatial(n) is not None]
    if len(set(srcs)) != 1:
        return None
    x, region, nodes = srcs[0], [], set()
    for k in range(i, min(i + 16, len(cap.calls))):
        call = cap.calls[k]
        reads = set(call.refs())
        if k > i and not reads & nodes or any(low.spatial(n) is not None and n != x for n in reads):
            return None
        region.append(call)
        nodes.update(call.outs)
        out = values[call.outs[0]]
        scale = _scale(out, values[x])
        if k > i and scale is not None:
            break
    else:
        return None
    fn = _replay_calls(low, region, x)
    module = next((m for p, m in low.root.named_modules() if p == first.where), low.root)
    found = measure(module, fn, values[x], scale)
    if not isinstance(found, int):
        return None
    d, u = scale.denominator, scale.numerator
    label, channels = ", ".join(c.name for c in region), int(out.shape[1])
    if found == 0 and d == u == 1:  # (a norm over the channels through a channels-last view, ...)
        name = low.b.emit(Pointwise, (low.spatial(x),), op_name(first, "calls"), fn=fn, label=label,
                          channels=channels, kernels=len(region))
    else:
        name = low.b.emit(Local, (low.spatial(x),), op_name(first, "calls"), fn=fn, down=d, up=u, halo=found,
                          channels=channels, calls=len(region), label=label)
    low.set(region[-1].outs[0], name)
    return i + len(region)


def _scale(out: torch.Tensor, x: torch.Tensor) -> Fraction | None:
    """out's sides over x's where out is back in x's layout: (B, C', h s, w s) of x's (B, C, h, w), s an
    integer or one over one (None: it is not; the example's unequal sides keep a (B, h, w, C) view of x
    from passing as one)."""
    if out.ndim != 4 or out.shape[0] != x.shape[0]:
        return None
    s = Fraction(out.shape[-2], x.shape[-2])
    if Fraction(out.shape[-1], x.shape[-1]) != s or s.numerator > 1 and s.denominator > 1:
        return None
    return s


def _replay_calls(low: Lowering, calls: list[Call], x: int) -> Callable:
    """The recorded calls as a function of the tensor in place of node x: plain ints equal to x's batch,
    height or width on the example become the tensor's."""
    values = low.cap.values
    ex = values[x].shape

    def run(t):
        sizes = {int(ex[0]): t.shape[0], int(ex[-2]): t.shape[-2], int(ex[-1]): t.shape[-1]}
        env = {x: t}

        def bind(obj):
            if isinstance(obj, Ref):
                return env[obj.node] if obj.node in env else values[obj.node]
            if isinstance(obj, bool) or not isinstance(obj, int | list | tuple | dict):
                return obj
            if isinstance(obj, int):
                return sizes.get(obj, obj)
            if isinstance(obj, dict):
                return {k: bind(v) for k, v in obj.items()}
            return type(obj)(bind(v) for v in obj)

        for c in calls:
            out = c.func(*bind(c.args), **bind(c.kwargs))
            outs = [out] if isinstance(out, torch.Tensor) else list(out)
            env.update(zip(c.outs, outs, strict=False))
        return env[calls[-1].outs[0]]

    return run


def enclosing(low: Lowering, i: int):
    """The innermost module call around call i whose tensor inputs are spatial values or constants and
    whose one output is a (B, C, h, w) tensor (None: none is)."""
    spans = sorted((sp for sp in low.cap.spans if sp.first <= i < sp.last), key=lambda sp: sp.last - sp.first)
    for sp in spans:
        refs = sp.refs()
        ok = all(low.spatial(n) is not None or n not in low.tainted for n in refs)
        if ok and any(low.spatial(n) is not None for n in refs) and len(sp.outs) == 1 \
                and low.cap.values[sp.outs[0]].ndim == 4:
            return sp
    return None


def opaque(low: Lowering, span, cause: Call) -> None:
    """A module call the rules cannot place inside, placed by its measured locality (`measure`): run on
    each box's neighbourhood (`Local`; position by position: `Pointwise`), or, where one position of its
    output reads every position of its input and it runs at the program's smallest resolution (an
    attention block on the latent: its output at its input's resolution), whole (`Whole`: exact, untiled at
    that op; never a decoder or encoder whole, which changes the resolution). Else refused, naming the call
    no rule placed (`cause`) and the module around it."""
    values = low.cap.values
    spatial = list(dict.fromkeys(n for n in span.refs() if low.spatial(n) is not None))
    first, out = values[spatial[0]], values[span.outs[0]]
    scale = Fraction(out.shape[-2], first.shape[-2])
    label, calls, channels = type(span.module).__name__, span.last - span.first, int(out.shape[1])
    around = f"no rule places it, and the module around it ({label} at {span.path!r})"
    if Fraction(out.shape[-1], first.shape[-1]) != scale or scale.numerator > 1 and scale.denominator > 1:
        raise refused(low, cause, f"{around} gives an output that is not its input scaled alike in height "
                      "and width")
    fn = _replay_module(low, span, spatial)
    found = measure(span.module, fn, first, scale) if len(spatial) == 1 else "global"
    if isinstance(found, int):
        d, u = scale.denominator, scale.numerator
        if found == 0 and d == u == 1:
            name = low.b.emit(Pointwise, (low.spatial(spatial[0]),), span.path, fn=fn,
                              label=f"{label} (position by position)", channels=channels, kernels=calls)
        else:
            name = low.b.emit(Local, (low.spatial(spatial[0]),), span.path, fn=fn, down=d, up=u, halo=found,
                              channels=channels, calls=calls, label=label)
    elif found == "global" and scale == 1 and _smallest(low, first):
        name = low.b.emit(Whole, tuple(low.spatial(n) for n in spatial), span.path, fn=fn, scale=scale,
                          channels=channels, calls=calls, label=label)
    else:
        why = found if found != "global" else ("global (one output position reads every input position) "
                                               "above the latent's resolution, where running it whole "
                                               "would not be memory-bounded")
        raise refused(low, cause, f"{around} is {why}")
    low.set(span.outs[0], name)


def _smallest(low: Lowering, like: torch.Tensor) -> bool:
    """Whether a value of like's sides is at the program's smallest resolution (its input's or output's,
    the latent): where a module run whole holds no more than the latent does."""
    values = low.cap.values
    small = min(values[low.cap.input].shape[-2:].numel(), values[low.cap.output].shape[-2:].numel())
    return like.shape[-2:].numel() <= small


def measure(module, fn: Callable, like: torch.Tensor, scale: Fraction):
    """The halo (input pixels, a multiple of the downsampling) with which fn computes every output block
    from its input block's neighbourhood, "global" where one output position reads every input position,
    or why it could not be measured (a string). Measured on a random input like `like` (16 blocks a side,
    the module's device and dtype): the output positions one input position changes, then checked: fn on
    crops (interior and at the borders) gives the crops of its output."""
    p = next(iter(module.parameters()), None)
    device, dtype = (p.device, p.dtype) if p is not None else (torch.device("cpu"), torch.float32)
    if device.type == "meta":
        return "unmeasurable here (its parameters are on the meta device)"
    d, u = scale.denominator, scale.numerator
    side = 16 * d
    g = torch.Generator().manual_seed(0)
    x = torch.randn((1, int(like.shape[1]), side, side + d), generator=g).to(device, dtype)
    try:
        with torch.no_grad():
            y = fn(x)
            x2 = x.clone()
            x2[..., side // 2, side // 2] += 1.0
            changed = ((fn(x2) - y).abs().amax(dim=(0, 1)) > 0).nonzero()
    except Exception as e:  # (a module that cannot run on such an input cannot be measured)
        return f"unmeasurable ({type(e).__name__} on a {side} x {side + d} input)"
    if len(changed) and (changed.min(0).values == 0).all() and (changed.max(0).values + 1 == torch.tensor(
            y.shape[-2:], device=changed.device)).all():
        return "global"
    halo = 0
    if len(changed):
        lo, hi = changed.min(0).values.tolist(), changed.max(0).values.tolist()
        p0 = side // 2
        halo = max(max(p0 - v * d // u, (w + 1) * d // u - 1 - p0) for v, w in zip(lo, hi, strict=True))
        halo = -(-max(halo, 0) // d) * d
    for _ in range(3):  # (a perturbation may not reach its whole receptive field: widen, check again)
        with torch.no_grad():
            agree = _crops_agree(fn, x, y, d, u, halo)
        if agree:
            return halo
        halo = max(2 * halo, d)
    return "not reproduced on crops of its input (its output depends on where the crop is)"


def _crops_agree(fn: Callable, x, y, d: int, u: int, halo: int) -> bool:
    """Whether Local's crops give y's boxes: an interior box and boxes at two corners."""
    op = Local(src=("x",), dst="y", name="", fn=fn, down=d, up=u, halo=halo, channels=int(y.shape[1]))
    h, w = y.shape[-2:]
    tol = 1e-4 * float(y.abs().max()) + 1e-6
    for box in ((h // 3, 2 * h // 3, w // 3, 2 * w // 3), (0, h // 2, 0, w // 2), (h // 2, h, w // 3, w)):
        try:
            got = op.run(None, [x], [(0, x.shape[-2], 0, x.shape[-1])], box, [tuple(x.shape[-2:])])
        except Exception:
            return False
        want = y[..., box[0] : box[1], box[2] : box[3]]
        if got.shape != want.shape or float((got - want).abs().max()) > tol:
            return False
    return True


def _replay_module(low: Lowering, span, spatial: list[int]) -> Callable:
    """The module's call as a function of its spatial inputs (in `spatial`'s order; constants as they
    were)."""
    values = low.cap.values

    def bind(obj, ts):
        if isinstance(obj, Ref):
            return ts[spatial.index(obj.node)] if obj.node in spatial else values[obj.node]
        if isinstance(obj, dict):
            return {k: bind(v, ts) for k, v in obj.items()}
        if isinstance(obj, list | tuple):
            return type(obj)(bind(v, ts) for v in obj)
        return obj

    module, args, kwargs = span.module, span.args, span.kwargs

    def fn(*ts):
        out = module(*bind(args, ts), **bind(kwargs, ts))
        return out[0] if isinstance(out, list | tuple) else out

    return fn
