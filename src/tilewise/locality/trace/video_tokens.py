"""A video value's tokens on their way through diffusers' Attention: HunyuanVideo's mid-block runs
`x.permute(0, 2, 3, 4, 1).flatten(1, 3)` (tokens in (t, h, w) order), `attn(tokens, attention_mask=...)`
and `.unflatten(1, (T, H, W)).permute(0, 4, 1, 2, 3)` back. The permute is placed only where that chain
follows it (else the measured rules take the permute, as they do for LTX's channel norms); the Attention
becomes its `VideoGroupNorm` and a `StepAttention` over every token of the step. Its mask, a constant of
the computation, must be HunyuanVideo's causal mask between frames (a token attends to its frame and the
frames before; read from the calls that make it, not evaluated) or no mask.
"""

from __future__ import annotations

from ..ops3d_sync import StepAttention, VideoGroupNorm
from ..units import check_attention
from .capture import Call, Ref
from .state import Lowering, arg_of, permutation, refused

ALIASES = {"contiguous", "clone", "detach"}


def tokens_rule(low: Lowering, i: int, call: Call) -> bool | str:
    """permute(0, 2, 3, 4, 1) of a video value followed by flatten(1, 3) and an Attention: its tokens."""
    x = arg_of(call, 0, "input")
    dims = permutation(call)
    if not isinstance(x, Ref) or low.spatial(x.node) is None:
        return False
    if dims != (0, 2, 3, 4, 1):
        return False
    flat = _only_reader(low, i, call.outs[0])
    if flat is None or flat[1].name != "flatten" or _dims(flat[1], 1, "start_dim", "end_dim") != (1, 3):
        return False
    unit = _only_reader(low, flat[0], flat[1].outs[0])
    if unit is None or unit[1].module is None or type(unit[1].module).__name__ != "Attention":
        return False
    low.tokens[call.outs[0]] = (low.spatial(x.node), "channels_last")
    return True


def token_call(low: Lowering, i: int, call: Call) -> None:
    """A call on a video value's tokens (module docstring); LoweringError for any other."""
    src = next(n for n in call.refs() if n in low.tokens)
    name, layout = low.tokens[src]
    out = call.outs[0] if len(call.outs) == 1 else None
    if call.name in ALIASES and out is not None:
        low.tokens[out] = (name, layout)
    elif call.name == "flatten" and layout == "channels_last" and _dims(call, 1, "start_dim",
                                                                         "end_dim") == (1, 3):
        low.tokens[out] = (name, "flat")
    elif call.name == "unflatten" and layout == "flat" and arg_of(call, 1, "dim") == 1:
        low.tokens[out] = (name, "channels_last")
    elif call.name == "permute" and layout == "channels_last" and permutation(call) == (0, 4, 1, 2, 3):
        low.set(out, name)
    elif call.module is not None and type(call.module).__name__ == "Attention" and layout == "flat":
        low.tokens[out] = (_attention(low, call, name, src), "flat")
    else:
        raise refused(low, call, f"a call on a video value's tokens ({layout}) other than HunyuanVideo's "
                      "flatten, Attention, unflatten and permute back", final=True)


def _attention(low: Lowering, call: Call, x: str, tokens: int) -> str:
    """diffusers Attention over a video value's tokens: its GroupNorm over the step and a StepAttention."""
    a = call.module
    other = arg_of(call, 1, "encoder_hidden_states")
    if arg_of(call, 0, "hidden_states") != Ref(tokens) or other is not None:
        raise refused(low, call, "an Attention over a video value's tokens with other inputs (cross "
                      "attention)", final=True)
    why = check_attention(a)
    if why:
        raise refused(low, call, why, final=True)
    mask = arg_of(call, 2, "attention_mask")
    causal = False
    if mask is not None:
        video = low.cap.values[next(n for n, v in low.values.items() if v.name == x)]
        causal = _causal(low, call, mask, *video.shape[2:])
    n = x
    if a.group_norm is not None:
        g = a.group_norm
        n = low.b.emit(VideoGroupNorm, (x,), f"{call.where}.group_norm", groups=g.num_groups, eps=g.eps,
                       weight=g.weight if g.affine else None, bias=g.bias if g.affine else None)
    return low.b.emit(StepAttention, (n, x), call.where, heads=a.heads, to_q=a.to_q, to_k=a.to_k, to_v=a.to_v,
                      to_out=a.to_out, residual=bool(a.residual_connection),
                      rescale=float(a.rescale_output_factor), causal=causal)


def _causal(low: Lowering, call: Call, mask, t: int, h: int, w: int) -> bool:
    """Whether an attention mask is HunyuanVideo's causal mask between the t frames of h x w tokens
    (`prepare_causal_attention_mask`), read from the calls that made it (the mask itself is (t h w)^2
    values, not evaluated): where(a <= b, 0, -inf) of meshgrid(i, i, indexing="xy") (a: the key's frame
    index, b: the query's) of i = arange(s, s + t).repeat_interleave(h w), cast, unsqueezed, expanded."""
    if not isinstance(mask, Ref) or mask.node in low.tainted:
        raise refused(low, call, "an attention mask that depends on the input", final=True)
    c = _made(low, mask)
    while c is not None and c.name in ("to", "unsqueeze", "expand", "contiguous"):
        c = _made(low, c.args[0])
    ok = c is not None and c.name == "where" and tuple(c.args[1:]) == (0, float("-inf"))
    le = _made(low, c.args[0]) if ok else None
    ok = ok and le is not None and le.name == "le" and all(isinstance(a, Ref) for a in le.args)
    grid = _made(low, le.args[0]) if ok else None
    ok = ok and grid is not None and grid is _made(low, le.args[1]) and grid.name == "meshgrid"
    ok = ok and grid.kwargs.get("indexing") == "xy" and [a.node for a in le.args] == grid.outs[:2]
    ok = ok and len(grid.args) == 2 and grid.args[0] == grid.args[1]
    rep = _made(low, grid.args[0]) if ok else None
    ok = ok and rep is not None and rep.name == "repeat_interleave" and arg_of(rep, 1, "repeats") == h * w
    ok = ok and arg_of(rep, 2, "dim") is None
    idx = _made(low, rep.args[0]) if ok else None
    ok = ok and idx is not None and idx.name == "arange" and all(isinstance(a, int) for a in idx.args)
    if ok and len(range(*idx.args)) == t and (len(idx.args) < 3 or idx.args[2] == 1):
        return True
    raise refused(low, call, "an attention mask over a video value's tokens that is not the causal mask "
                  "between frames of HunyuanVideo's prepare_causal_attention_mask (read from the calls that "
                  "make it)", final=True)


def _made(low: Lowering, ref) -> Call | None:
    """The call that made a Ref's value (None for a constant or a plain value)."""
    k = low.cap.producer.get(ref.node) if isinstance(ref, Ref) else None
    return None if k is None else low.cap.calls[k]


def _only_reader(low: Lowering, i: int, node: int) -> tuple[int, Call] | None:
    """The one call after call i that reads node, or None where none or several do."""
    found = [(k, c) for k, c in enumerate(low.cap.calls[i + 1 :], i + 1) if node in c.refs()]
    return found[0] if len(found) == 1 else None


def _dims(call: Call, i: int, a: str, b: str) -> tuple:
    return arg_of(call, i, a, 0), arg_of(call, i + 1, b, -1)
