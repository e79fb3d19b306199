"""What no rule places, placed by measuring it: a run of calls that leaves the spatial layout and comes
back (`inline_region`), or the module call around the call (`enclosing`, `opaque`), as one op whose halo is
measured on a random input and checked on crops (`measure`): `Pointwise`, `Local`, or `Whole` at the
latent's resolution; else refused."""

from __future__ import annotations

from collections.abc import Callable
from fractions import Fraction

import torch

from ..build import LoweringError
from ..ops import Pointwise
from ..ops3d import Rearrange
from ..ops_traced import Local, Whole
from .capture import Call, Ref
from .frames import carry
from .state import Lowering, op_name, refused
from .video_frames import KEEP_PARTS


def inline_region(low: Lowering, i: int) -> int | None:
    """Calls i.. of one spatial value that leave the spatial layout and come back to it (a view and a
    mean over channel groups in a forward, ...), placed as one op by their measured locality (their
    recorded sizes of the value's height, width and batch follow the box they run on; calls of constants
    between them are left to the replay, `Lowering.value`). The index after them, or None where they are
    not such a run or are not local."""
    cap = low.cap
    first = cap.calls[i]
    srcs = [n for n in first.refs() if low.spatial(n) is not None]
    if len(set(srcs)) != 1:
        return None
    x, region, nodes = srcs[0], [], set()
    for k in range(i, len(cap.calls)):
        call = cap.calls[k]
        if len(region) == 16:  # (a run of at most 16 calls)
            return None
        reads = set(call.refs())
        if k > i and not reads & nodes and not reads & low.tainted:
            continue  # (a constant's call between, FSQ's levels: the replay computes it as it reads it)
        if k > i and not reads & nodes or any(low.spatial(n) is not None and n != x for n in reads):
            return None
        region.append(call)
        nodes.update(call.outs)
        out = low.carried(call.outs[0])
        scale = _scale(out, low.carried(x))
        if k > i and scale is not None:
            break
    else:
        return None
    end = k + 1
    fn = carry(low, [x], region[-1].outs[0], _replay_calls(low, region, x))
    module = next((m for p, m in low.root.named_modules() if p == first.where), low.root)
    found = measure(module, fn, low.carried(x), scale)
    if not isinstance(found, int):
        return None
    frames = frames_map(low, fn, low.carried(x), scale, int(out.shape[1])) if out.ndim == 5 else None
    if isinstance(frames, str):  # (sizes of the value's frames the replay cannot follow: the module around)
        return None
    label = ", ".join(c.name for c in region)
    name = _emit(low, (low.spatial(x),), op_name(first, "calls"), fn, found, scale, low.carried(x), out,
                 label, len(region), frames)
    low.set(region[-1].outs[0], name)
    if x in low.frame_parts and all(c.name in KEEP_PARTS for c in region):  # (still the part of a split)
        low.frame_parts[region[-1].outs[0]] = low.frame_parts[x]
    return end


def _emit(low: Lowering, src: tuple, where: str, fn: Callable, halo: int, scale: Fraction, x, out,
          label: str, calls: int, frames=False) -> str:
    """A measured run of calls or module as its op: position by position a `Pointwise`; else a `Local`
    with its halo; of a video value, one that changes its frames without a halo a `Rearrange` (their
    frames as measured: `frames_map`, unless given)."""
    d, u, channels = scale.denominator, scale.numerator, int(out.shape[1])
    if frames is False:
        frames = frames_map(low, fn, x, scale, channels) if x.ndim == 5 else None
    if isinstance(frames, str):
        raise LoweringError(f"cannot lower {type(low.root).__name__}: {label} at {where!r}: {frames}")
    if halo == 0 and d == u == 1 and frames is None:  # (a norm over the channels through a view, ...)
        return low.b.emit(Pointwise, src, where, fn=fn, label=label, channels=channels, kernels=calls)
    if halo == 0 and (frames is not None or x.ndim == 5):
        return low.b.emit(Rearrange, src, where, fn=lambda t, ctx: fn(t), down=d, up=u, channels=channels,
                          frames_fn=frames, label=label)
    return low.b.emit(Local, src, where, fn=fn, down=d, up=u, halo=halo, channels=channels, calls=calls,
                      label=label, frames_fn=frames)


def frames_map(low: Lowering, fn: Callable, like: torch.Tensor, scale: Fraction, channels: int):
    """How many frames fn makes of t (a video value like `like`): None where it keeps them, else
    (t, step) -> floor(a t + b), a and b fitted on runs at three frame counts (small random inputs, the
    module's device and dtype) and checked (ceil(a t + b) where the counts between the example's take
    it); a string where they do not fit one such line. A run counts
    only where its output has the example's `channels` (a reshape's -1 may take up frames it misses)."""
    d, t0 = scale.denominator, int(like.shape[2])
    p = next(iter(low.root.parameters()), None)
    device, dtype = (p.device, p.dtype) if p is not None else (torch.device("cpu"), torch.float32)
    if device.type == "meta":
        return "its frames are unmeasurable here (its parameters are on the meta device)"
    g = torch.Generator().manual_seed(1)
    runs, more = {}, {}

    def run(t):
        x = torch.randn((1, int(like.shape[1]), t, 2 * d, 2 * d), generator=g).to(device, dtype)
        try:
            with torch.no_grad():
                y = fn(x)
        except Exception:  # (a frame count the module does not take)
            return None
        if int(y.shape[1]) != channels:
            return (f"its output's channels follow its frames ({channels} on the example, {int(y.shape[1])} "
                    f"from {t} frames): a size it was given is fixed at the example's frame count")
        return int(y.shape[2])

    for t in (t0, 2 * t0 - 1, 3 * t0 - 2, 2 * t0, 3 * t0):
        o = run(t)
        if isinstance(o, str):
            return o
        if o is not None:
            runs[t] = o
        if len(runs) == 3:
            break
    if len(runs) < 2:
        return "its frames could not be measured (it runs on too few frame counts)"
    (t1, o1), (t2, o2), *_ = sorted(runs.items())
    a = Fraction(o2 - o1, t2 - t1)
    b = o1 - a * t1
    if any((a * t + b) // 1 != o for t, o in runs.items()):
        return _rounded_line(run, t0)
    if a == 1 and b == 0:
        return None
    # (frame counts between the example's: a stride over padded frames rounds up, Cosmos' wavelet patcher)
    for t in range(t0 + 1, t0 + min(int(1 / a) if a < 1 else 1, 8) + 1):
        o = run(t)
        if isinstance(o, int):
            more[t] = o
    if any((a * t + b) // 1 != o for t, o in more.items()) and all(
            -((-a * t - b) // 1) == o for t, o in {**runs, **more}.items()):
        return lambda t, step, a=a, b=b: int(-((-a * t - b) // 1))
    return lambda t, step, a=a, b=b: int((a * t + b) // 1)


def _rounded_line(run: Callable, t0: int):
    """(t, step) -> ceil or floor of a t + b, fitted on six frame counts from t0 (a stride 2 whose odd
    counts keep their first frame apart, CogVideoX's time downsampling: ceil(t / 2)); or why not."""
    runs = {t: run(t) for t in range(t0, t0 + 6)}
    if any(isinstance(o, str) for o in runs.values()):
        return next(o for o in runs.values() if isinstance(o, str))
    runs = {t: o for t, o in runs.items() if o is not None}
    if len(runs) < 4:
        return "its frames are not a linear function of its input's"
    (t1, o1), (t2, o2) = sorted(runs.items())[:3:2]
    a = Fraction(o2 - o1, t2 - t1)
    b = o1 - a * t1
    for up in (False, True):
        if all((-((-a * t - b) // 1) if up else (a * t + b) // 1) == o for t, o in runs.items()):
            return lambda t, step, a=a, b=b, up=up: int(-((-a * t - b) // 1) if up else (a * t + b) // 1)
    return "its frames are not a linear function of its input's"


def _scale(out: torch.Tensor, x: torch.Tensor) -> Fraction | None:
    """out's sides over x's where out is back in x's layout: (B, C', h s, w s) of x's (B, C, h, w) (of a
    video value (B, C, T, h, w): with any frame count), s an integer or one over one (None: it is not;
    the example's unequal sides keep a (B, h, w, C) view of x from passing as one)."""
    if out.ndim != x.ndim or out.ndim not in (4, 5) or out.shape[0] != x.shape[0]:
        return None
    s = Fraction(out.shape[-2], x.shape[-2])
    if Fraction(out.shape[-1], x.shape[-1]) != s or s.numerator > 1 and s.denominator > 1:
        return None
    return s


SIZE_CALLS = {"reshape", "view", "expand", "new_zeros", "new_empty", "new_ones"}  # (their ints are sizes)
# calls whose ints are dims (never sizes; unflatten's sizes apart)
DIM_CALLS = {"permute", "flatten", "unflatten", "movedim", "moveaxis", "transpose", "squeeze", "unsqueeze",
             "mean", "sum", "amax", "amin", "var", "std", "softmax", "norm", "normalize", "chunk", "split",
             "cat", "concatenate", "stack", "roll", "flip", "narrow", "select", "argmax", "cumsum"}


def _replay_calls(low: Lowering, calls: list[Call], x: int) -> Callable:
    """The recorded calls as a function of the tensor in place of node x: plain ints equal to x's height
    or width (a video value's frames) on the example become the tensor's, and the first size given to a
    reshape (view, ...) equal to x's batch becomes the tensor's batch. Each intermediate is freed after its
    last reader (the replay holds what the calls still read, as the module did)."""
    ex = low.cap.values[x].shape
    video = len(ex) == 5 and x not in low.framed  # (a one-frame value's frame is no size that follows)
    last = {}  # node -> index of the last call reading it (freed after it: a replay holds what it needs)
    for k, c in enumerate(calls):
        for n in c.refs():
            last[n] = k

    def run(t):
        sides = [(int(ex[-2]), t.shape[-2]), (int(ex[-1]), t.shape[-1])]
        sizes = _size_map([*sides, (int(ex[2]), t.shape[2])] if video else sides)
        env = {x: t}
        for k, c in enumerate(calls):
            if c.name in DIM_CALLS:  # (dims stay; unflatten's sizes follow the tensor)
                args, kwargs = c.args, c.kwargs
                if c.name == "unflatten":
                    args = (*args[:2], _bind(args[2], low, env, sizes), *args[3:]) if len(args) > 2 else args
                args = tuple(_bind(a, low, env, sizes) if isinstance(a, Ref) else a for a in args)
            else:
                args, kwargs = _bind(c.args, low, env, sizes), _bind(c.kwargs, low, env, sizes)
                if c.name in SIZE_CALLS:
                    args = _batch_size(args, int(ex[0]), t.shape[0])
            out = c.func(*args, **kwargs)
            del args, kwargs
            outs = [out] if isinstance(out, torch.Tensor) else list(out)
            del out
            env.update(zip(c.outs, outs, strict=False))
            del outs
            for n in [n for n in env if last.get(n, -1) <= k and n != calls[-1].outs[0]]:
                del env[n]
        return env.pop(calls[-1].outs[0])

    return run


def _bind(obj, low: Lowering, env: dict, sizes: dict):
    """A recorded argument on the replay's tensors (`env`), its ints that are sizes mapped (`sizes`)."""
    if isinstance(obj, Ref):
        return env[obj.node] if obj.node in env else low.value(obj.node)
    if isinstance(obj, bool) or not isinstance(obj, int | list | tuple | dict):
        return obj
    if isinstance(obj, int):
        return sizes.get(obj, obj)
    if isinstance(obj, dict):
        return {k: _bind(v, low, env, sizes) for k, v in obj.items()}
    return type(obj)(_bind(v, low, env, sizes) for v in obj)


def _size_map(sides: list[tuple[int, int]]) -> dict[int, int]:
    """Example size -> the tensor's, for each (example side, tensor side) and the sides a power of two
    (up to 64) times smaller or larger (a patchify's reshape names the side over its patch), or three
    times a power of two larger (Mochi's 3x temporal unpatchify); a size two sides claim is left out."""
    out, claims = {}, {}
    for ex, now in sides:
        for k in (1, 2, 4, 8, 16, 32, 64):
            pairs = [(ex * k, now * k), (ex * 3 * k, now * 3 * k)]
            pairs += [(ex // k, now // k)] if ex % k == 0 and now % k == 0 else []
            for a, b in pairs:
                claims.setdefault(a, set()).add(ex)
                out[a] = b
    return {a: b for a, b in out.items() if len(claims[a]) == 1}


def _batch_size(args: tuple, batch: int, now: int) -> tuple:
    """A reshape's sizes with the first (the batch's, when it equals the example's batch) made `now`."""
    if args and isinstance(args[1] if len(args) > 1 else None, list | tuple):
        sizes = list(args[1])
        if sizes and sizes[0] == batch:
            sizes[0] = now
        return (args[0], type(args[1])(sizes), *args[2:])
    if len(args) > 1 and args[1] == batch:
        return (args[0], now, *args[2:])
    return args


def enclosing(low: Lowering, i: int):
    """The innermost module call around call i whose tensor inputs are spatial values or constants and
    whose one output is a (B, C, h, w) tensor (None: none is)."""
    spans = sorted((sp for sp in low.cap.spans if sp.first <= i < sp.last), key=lambda sp: sp.last - sp.first)
    for sp in spans:
        refs = sp.refs()
        ok = all(low.spatial(n) is not None or n not in low.tainted for n in refs)
        if ok and any(low.spatial(n) is not None for n in refs) and len(sp.outs) == 1 \
                and low.cap.values[sp.outs[0]].ndim == low.cap.values[refs[0]].ndim in (4, 5):
            return sp
    return None


def opaque(low: Lowering, span, cause: Call) -> None:
    """A module call the rules cannot place inside, placed by its measured locality (`measure`): run on
    each box's neighbourhood (`Local`; position by position: `Pointwise`), or, where one position of its
    output reads every position of its input and it runs at the program's smallest resolution (an
    attention block on the latent: its output at its input's resolution), whole (`Whole`: exact, untiled at
    that op; never a decoder or encoder whole, which changes the resolution). Else refused, naming the call
    no rule placed (`cause`) and the module around it."""
    spatial = list(dict.fromkeys(n for n in span.refs() if low.spatial(n) is not None))
    first, out = low.carried(spatial[0]), low.carried(span.outs[0])
    scale = Fraction(out.shape[-2], first.shape[-2])
    label, calls, channels = type(span.module).__name__, span.last - span.first, int(out.shape[1])
    around = f"no rule places it, and the module around it ({label} at {span.path!r})"
    if Fraction(out.shape[-1], first.shape[-1]) != scale or scale.numerator > 1 and scale.denominator > 1:
        raise refused(low, cause, f"{around} gives an output that is not its input scaled alike in height "
                      "and width")
    fn = carry(low, spatial, span.outs[0], _replay_module(low, span, spatial))
    found = measure(span.module, fn, first, scale) if len(spatial) == 1 else "global"
    if isinstance(found, int):
        name = _emit(low, (low.spatial(spatial[0]),), span.path, fn, found, scale, first, out,
                     label if found or scale != 1 else f"{label} (position by position)", calls)
    elif found == "global" and scale == 1 and _smallest(low, first):
        name = low.b.emit(Whole, tuple(low.spatial(n) for n in spatial), span.path, fn=fn, scale=scale,
                          channels=channels, calls=calls, label=label)
    else:
        why = found if found != "global" else ("global (one output position reads every input position) "
                                               "above the latent's resolution, where running it whole "
                                               "would not be memory-bounded")
        raise refused(low, cause, f"{around} is {why}")
    low.set(span.outs[0], name)
    if spatial[0] in low.batched and low.cap.values[span.outs[0]].ndim == 4:  # (still in the batch)
        low.batched[span.outs[0]] = low.batched[spatial[0]]


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
    frames = tuple(like.shape[2:3]) if like.ndim == 5 else ()  # (a video value: its frames as they were)
    x = torch.randn((1, int(like.shape[1]), *frames, side, side + d), generator=g).to(device, dtype)
    try:
        with torch.no_grad():
            y = fn(x)
            x2 = x.clone()
            x2[..., side // 2, side // 2] += 1.0
            changed = ((fn(x2) - y).abs().amax(dim=tuple(range(y.ndim - 2))) > 0).nonzero()
    except Exception as e:  # (a module that cannot run on such an input cannot be measured)
        return f"unmeasurable ({type(e).__name__} on a {side} x {side + d} input)"
    if len(changed) and (changed.min(0).values == 0).all() and (changed.max(0).values + 1 == torch.tensor(
            y.shape[-2:], device=changed.device)).all():
        return "global"
    halo = 0
    if len(changed):
        lo, hi = changed.min(0).values.tolist(), changed.max(0).values.tolist()
        p0 = side // 2
        # (output block v reads its input pixels [v d / u, (v + 1) d / u) widened by the halo: the lowest
        # and highest changed blocks bound it)
        halo = max(max(p0 - (-(-(v + 1) * d // u) - 1), w * d // u - p0) for v, w in zip(lo, hi, strict=True))
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

    def bind(obj, ts):
        if isinstance(obj, Ref):
            return ts[spatial.index(obj.node)] if obj.node in spatial else low.value(obj.node)
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
