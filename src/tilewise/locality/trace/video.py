"""The rules of video values ((B, C, T, H, W) tensors, a 3-D VAE's): each call on them placed as an op
of a video program (`ops3d`, `ops3d_sync`) by what it is.

- `conv3d`: `CausalConv3d`, its padding merged from what feeds it: its own zero padding, an `F.pad`
  (zeros; replicate: the border repeated in space, the first frame in time; reflect in space), and a
  concatenation of
  its input's first frame repeated in front and last frame behind (LTX-Video's causal padding);
- a causal convolution looping over its padded input's windows of frames, the outputs concatenated along
  time (Magvit's): one `CausalConv3d` with the windows' stride in time (`video_windows`);
- a slice of frames (`x[:, :, a:b]`, or every s-th, `x[:, :, a:b:s]`: Allegro's; the first frame
  `x[:, :, 0]`, squeezed; a value's first frame and
  the others are the first step's in a chunked program, `program3d.VideoProgram.chunked`), frames
  repeated (`x.repeat(1, 1, n, 1, 1)`) and frames of one
  value concatenated along time: a `Rearrange` of the frames, whose frame count the op knows;
- `split((1, T - 1), dim=2)` (a value's first frame and the others, or the others and its last): a
  frame slice per part; the parts, each maybe resampled apart (`squeeze(2)` of the one frame, nearest
  `interpolate` by integer factors in time and space, `unsqueeze(2)`), concatenated back in order: a
  `FrameCat` (HunyuanVideo's upsampler); likewise a value's first k frames and the others
  (`x[:, :, :k]`, `x[:, :, k:]`: VidTok's temporal upsamplers);
- trilinear interpolation by a scale factor in time, 1 in space (VidTok's): a `Rearrange` of the frames;
  `avg_pool3d` over windows of frames (kernel and stride (k, 1, 1), maybe padded in time: VidTok's
  downsampler): a `Rearrange` of the frames (`video_pools`);
- `unbind(0)` of a video value, each sample `unsqueeze(0)`'d and the results concatenated along the
  batch (VidTok's non-causal upsampler): the value itself, traced on a batch of one (`video_samples`);
- `group_norm` of a video value: a `VideoGroupNorm`, a sync op whose statistics are over groups x the
  step's frames x the whole frame (in a one-step program, the whole video's: HunyuanVideo's);
- HunyuanVideo's mid-block attention over every frame's tokens with its causal mask (`video_tokens`);
- a GroupNorm of each frame with the frames folded into the batch (Mochi's chunked GroupNorm, Cosmos'):
  a `FrameGroupNorm`, statistics per (batch, frame, group); an attention over each position's frames,
  the positions folded into the batch (Mochi's encoder): a `ColumnAttention` (`video_fold`);
- `scaled_dot_product_attention` of a video value's tokens (Cosmos' attention blocks): over each frame's
  tokens a `FrameSDPA`, over each position's frames a `ColumnSDPA` (`video_sdpa`); `new_ones` of a video
  value read only as such an attention's causal mask: no op;
- a concatenation along time of frames of different values that are not such parts (a cache a chunked
  causal loop carries from call to call) is refused: no measurement of the module around it places it
  either.

These frame rearrangements are ops of one-step programs (every frame in one step: LTX-Video,
HunyuanVideo); a value's frames are then whole in every op. A rule returns False where a call is not
one it places (the 2-D rules are tried next: channels, arithmetic, ...), or a string saying why it
refuses it.
"""

from __future__ import annotations

import torch

from ..ops3d import CausalConv3d, Rearrange
from ..ops3d_sync import FrameCat, VideoGroupNorm
from .capture import Call, Ref
from .state import Lowering, arg_of, const_value, op_name, permutation, refused
from .video_caches import cache_cat
from .video_fold import fold_rule
from .video_frames import frame_slice, span_label, strided_rule
from .video_interleave import interleave_rule
from .video_padding import Padding
from .video_pools import avg_pool3d_rule, columns_rule, repeat_interleave_rule
from .video_rows import permute_rule
from .video_samples import samples_cat, unbind_rule
from .video_sdpa import new_ones_rule, sdpa_rule
from .video_tokens import tokens_rule
from .video_windows import pad_alias, pad_of_pad, window_conv, window_item, windows_cat
from .video_writes import empty_rule, front_cat, front_rule, write_rule


def _conv3d(low: Lowering, i: int, call: Call) -> bool | str:
    x, w = arg_of(call, 0, "input"), arg_of(call, 1, "weight")
    if not isinstance(x, Ref) or not isinstance(w, Ref) or low.spatial(w.node) is not None:
        return False
    windowed = window_conv(low, i, call)  # (a window of its input's frames, `video_windows`)
    if windowed is not False:
        return windowed
    stride, dilation = _triple(arg_of(call, 3, "stride", 1)), _triple(arg_of(call, 5, "dilation", 1))
    padding = arg_of(call, 4, "padding", 0)
    if isinstance(padding, str):
        if padding != "valid":
            return f"conv3d padding={padding!r} (only explicit or 'valid' padding is placed)"
        padding = 0
    if dilation[1:] != (1, 1):
        return f"conv3d with spatial dilation {dilation[1:]} (video programs dilate in time only)"
    pt, ph, pw = _triple(padding)
    pad = Padding([ph, ph, pw, pw], [pt, "zeros"], [pt, "zeros"], "zeros")
    src = x.node
    while src in low.pads or src in low.tpads or src in low.caches:
        if src in low.caches:  # (frames an earlier call of a causal loop cached, `video_caches`)
            why = pad.merge_cache(*low.caches[src])
        else:
            why = pad.merge_pad(*low.pads.pop(src)) if src in low.pads else pad.merge_frames(low.tpads[src])
        if isinstance(why, str):
            return why
        src = why
    name = low.spatial(src)
    if name is None:
        return False
    (front, fill), (back, fill_end) = pad.front, pad.back
    out = low.b.emit(CausalConv3d, (name,), call.where, weight=const_value(low, w),
                     bias=const_value(low, arg_of(call, 2, "bias")), stride=stride[1:], stride_t=stride[0],
                     dilation_t=dilation[0], padding=tuple(pad.space), pad_t=front, pad_end=back, fill=fill,
                     fill_end=fill_end, groups=int(arg_of(call, 6, "groups", 1)), padding_mode=pad.mode,
                     cached=pad.cached)
    low.set(call.outs[0], out)
    return True


def _frames_item(low: Lowering, i: int, call: Call) -> bool | str:
    """x[:, :, a:b] (frames a to b of a video value): a Rearrange of its frames (of a padded value: a window
    a convolution reads, `video_windows`)."""
    x, idx = arg_of(call, 0, "input"), arg_of(call, 1, "indices")
    padded = isinstance(x, Ref) and x.node in low.pads
    if not isinstance(x, Ref) or low.spatial(x.node) is None and not padded or not isinstance(idx, tuple) \
            or len(idx) < 3:
        return False
    if idx[0] is Ellipsis and len(idx) == 4:  # (x[..., a:b, :, :]: the frames, as x[:, :, a:b])
        idx = (slice(None), slice(None), *idx[1:])
    if idx[:2] != (slice(None), slice(None)) or any(s not in (slice(None), Ellipsis) for s in idx[3:]):
        return False
    sl = idx[2]
    if padded:
        return window_item(low, call, x, sl)
    first = sl == 0 and not isinstance(sl, bool)
    if first:  # (x[:, :, 0]: the first frame, squeezed to (B, C, H, W))
        sl = slice(None, 1)
    if not isinstance(sl, slice) or not isinstance(sl.step, int | None) or (sl.step or 1) < 1:
        return f"frames indexed by {sl!r} (only a slice of frames, or the first frame, is placed)"
    if sl.step not in (None, 1):  # (every s-th frame: Allegro's temporal downsampling shortcut)
        return strided_rule(low, call, x, sl)
    a, b = sl.start, sl.stop
    low.frame_refs[call.outs[0]] = (x.node, a, b, 1)
    part, key = {(None, 1): 0, (0, 1): 0, (1, None): 1}.get((a, b)), x.node
    if part is None and a in (None, 0) and isinstance(b, int) and b > 1:  # (its first b frames, the rest)
        part, key = 0, (x.node, b)
    elif part is None and isinstance(a, int) and a > 1 and b is None:
        part, key = 1, (x.node, a)
    if part is not None:  # (a value's first frame or the others: parts that may concatenate back)
        low.frame_parts[call.outs[0]] = (key, part, 2)
    fn, frames_fn = frame_slice(a, b)
    out = low.b.emit(Rearrange, (low.spatial(x.node),), op_name(call, "frames"), fn=fn, frames_fn=frames_fn,
                     label=f"frames {span_label(a, b)}")
    low.set(call.outs[0], out)
    if first:
        low.squeezed.add(call.outs[0])
    return True


def _repeat(low: Lowering, i: int, call: Call) -> bool | str:
    """x.repeat(1, 1, n, 1, 1): every frame n times over (a frame slice's repeats are remembered)."""
    x = arg_of(call, 0, "input")
    reps = call.args[1:] if len(call.args) > 2 else arg_of(call, 1, "repeats")
    if not isinstance(x, Ref) or low.spatial(x.node) is None:
        return False
    reps = tuple(reps) if isinstance(reps, list | tuple) else (reps,)
    if len(reps) != 5 or reps[0] != 1 or any(r != 1 for r in reps[3:]) or reps[1] != 1 and reps[2] != 1:
        return False if reps[2:] == (1, 1, 1) else f"repeat {reps} of a video value"
    n = int(reps[2])
    if x.node in low.frame_refs:
        src, a, b, r = low.frame_refs[x.node]
        low.frame_refs[call.outs[0]] = (src, a, b, r * n)
    if reps[1] != 1:
        return False  # (channels repeated: position by position, the 2-D rules)
    out = low.b.emit(Rearrange, (low.spatial(x.node),), op_name(call, "repeat"),
                     fn=lambda t, ctx, n=n: t.repeat(1, 1, n, 1, 1), frames_fn=lambda t, step, n=n: t * n,
                     label=f"frames x{n}")
    low.set(call.outs[0], out)
    return True


def _frames_cat(low: Lowering, i: int, call: Call) -> bool | str:
    """Frames of one video value concatenated along time (its first frame repeated in front, its last
    behind, ...): one Rearrange of that value; remembered as a padding where it is one (`tpads`)."""
    tensors, dim = arg_of(call, 0, "tensors"), arg_of(call, 1, "dim", 0)
    if dim == 0:  # (the samples of a batch put back, `video_samples`)
        return samples_cat(low, call, tensors)
    if dim not in (2, -3) or not all(isinstance(t, Ref) for t in tensors):
        return False
    conv = windows_cat(low, call, tensors)  # (every window's convolution of one value, `video_windows`)
    if conv is not None:
        return conv if isinstance(conv, str) else _conv3d(low, i, conv)
    fronted = front_cat(low, call, tensors)  # (a padded value's first frame in front, `video_writes`)
    if fronted is not None:
        return fronted
    cached = cache_cat(low, call, tensors)  # (frames an earlier call of a causal loop cached)
    if cached is not None:
        return cached
    parts, src = [], None
    sliced = {low.frame_refs[t.node][0] for t in tensors if t.node in low.frame_refs}
    for t in tensors:
        ref = low.frame_refs.get(t.node, (t.node, None, None, 1) if low.spatial(t.node) else None)
        if t.node in sliced and low.spatial(t.node):  # (a value whose own frames are the others': itself)
            ref = (t.node, None, None, 1)
        if ref is None:
            return "a concatenation along time of a value that is not a video value"
        if src not in (None, ref[0]) and (joined := _parts_cat(low, call, tensors)) is not None:
            low.set(call.outs[0], joined)
            return True
        if src not in (None, ref[0]):
            raise refused(low, call, "a concatenation along time of frames of different values (a causal "
                          "cache carried over from an earlier call of a chunked loop, as CogVideoX's and "
                          "Mochi's conv_cache; the traced lowering reads no such cache yet)", final=True)
        src = ref[0]
        parts.append(ref[1:])
    low.tpads.update(_as_padding(parts, src, call.outs[0]))

    def fn(t, ctx, parts=tuple(parts)):
        return torch.cat([t[:, :, a:b].repeat(1, 1, r, 1, 1) for a, b, r in parts], dim=2)

    def frames_fn(t, step, parts=tuple(parts)):
        return sum(len(range(t)[a:b]) * r for a, b, r in parts)

    label = " + ".join(f"frames {span_label(a, b)}" + (f" x{r}" if r > 1 else "") for a, b, r in parts)
    out = low.b.emit(Rearrange, (low.spatial(src),), op_name(call, "frames"), fn=fn, frames_fn=frames_fn,
                     label=label)
    low.set(call.outs[0], out)
    return True


def _as_padding(parts: list, src: int, out: int) -> dict:
    """{out: (src, front, back)} where the parts are src's first frame repeated, src, its last frame
    repeated (each optional but src), else {}."""
    whole = [k for k, p in enumerate(parts) if p == (None, None, 1)]
    if len(whole) != 1:
        return {}
    k = whole[0]
    before, after = parts[:k], parts[k + 1 :]
    if not all(p[:2] in ((None, 1), (0, 1)) for p in before) or not all(p[:2] == (-1, None) for p in after):
        return {}
    return {out: (src, sum(p[2] for p in before), sum(p[2] for p in after))}


def _group_norm(low: Lowering, i: int, call: Call) -> bool | str:
    """group_norm of a video value: statistics per (batch, group) over its frames and the whole frame, a
    sync op over the step (`VideoGroupNorm`; in a one-step program, the whole video's GroupNorm)."""
    x = arg_of(call, 0, "input")
    if not isinstance(x, Ref) or low.spatial(x.node) is None:
        return False
    weight, bias = const_value(low, arg_of(call, 2, "weight")), const_value(low, arg_of(call, 3, "bias"))
    out = low.b.emit(VideoGroupNorm, (low.spatial(x.node),), call.where,
                     groups=int(arg_of(call, 1, "num_groups")), eps=float(arg_of(call, 4, "eps", 1e-5)),
                     weight=weight, bias=bias)
    low.set(call.outs[0], out)
    return True


def _split(low: Lowering, i: int, call: Call) -> bool | str:
    """x.split((1, T - 1), dim=2) (a video value's first frame and the others; or the others and its
    last): one Rearrange per part, remembered as parts of x (`frame_parts`) that may concatenate back."""
    x, sizes = arg_of(call, 0, "input"), arg_of(call, 1, "split_size_or_sections")
    dim = arg_of(call, 2, "dim", 0)
    if not isinstance(x, Ref) or low.spatial(x.node) is None or dim not in (2, -3):
        return False
    t = int(low.cap.values[x.node].shape[2])
    sizes = [int(s) for s in sizes] if isinstance(sizes, list | tuple) else None
    if sizes == [1, t - 1] and t > 2:
        spans = [(None, 1), (1, None)]
    elif sizes == [t - 1, 1] and t > 2:
        spans = [(None, -1), (-1, None)]
    else:
        return (f"a split of {t} frames into {sizes} (only a value's first or last frame and the others are "
                "placed: other sizes follow the example's frame count)")
    for k, (n, (a, b)) in enumerate(zip(call.outs, spans, strict=True)):
        low.frame_refs[n] = (x.node, a, b, 1)
        low.frame_parts[n] = (x.node, k, len(spans))
        fn, frames_fn = frame_slice(a, b)
        label = f"frames {span_label(a, b)}"
        out = low.b.emit(Rearrange, (low.spatial(x.node),), op_name(call, label), fn=fn, frames_fn=frames_fn,
                         label=label)
        low.set(n, out)
    return True


def _interpolate(low: Lowering, i: int, call: Call) -> bool | str:
    """Nearest interpolation of a video value by integer factors (time, space, space; of a squeezed
    one-frame value: space): a Rearrange upsampling its crop (output pixel i reads input pixel i // s)."""
    x = arg_of(call, 0, "input")
    if not isinstance(x, Ref) or low.spatial(x.node) is None:
        return False
    mode = arg_of(call, 3, "mode", "nearest")
    if mode in ("linear", "trilinear"):
        return _linear_in_time(low, call, x)
    if mode != "nearest" or arg_of(call, 7, "antialias", False):
        return f"interpolate mode={mode!r} of a video value (nearest by integer factors is placed)"
    src, dst = low.cap.values[x.node].shape[2:], low.cap.values[call.outs[0]].shape[2:]
    if any(d % s for s, d in zip(src, dst, strict=True) if s):
        return f"interpolate of a video value from {tuple(src)} to {tuple(dst)} (integer factors are placed)"
    factors = [d // s if s else 1 for s, d in zip(src, dst, strict=True)]
    if len(factors) == 2:  # (a squeezed one-frame value: its single frame in space)
        factors = [1, *factors]
    ft, fh, fw = factors
    if fh != fw:
        return f"interpolate of a video value by {factors} (the same factor in height and width is placed)"

    def fn(t, ctx, f=(ft, fh, fw)):
        if not t.shape[2]:  # (no frames: a first frame's others, of a one-frame video)
            return t.new_empty((*t.shape[:2], 0, t.shape[3] * f[1], t.shape[4] * f[2]))
        return torch.nn.functional.interpolate(t, scale_factor=f, mode="nearest")

    out = low.b.emit(Rearrange, (low.spatial(x.node),), op_name(call, "interpolate"), fn=fn, up=fh,
                     frames_fn=lambda t, step, ft=ft: t * ft, label=f"nearest x{ft},{fh},{fw}")
    low.set(call.outs[0], out)
    return True


def _linear_in_time(low: Lowering, call: Call, x: Ref) -> bool | str:
    """Trilinear interpolation of a video value by a scale factor in time and 1 in space (VidTok's
    temporal upsampler): each output frame a blend of two neighbouring input frames, position by position
    (a one-step program holds every frame): a Rearrange of the frames, the call replayed on the box."""
    src, dst = low.cap.values[x.node].shape, low.cap.values[call.outs[0]].shape
    sf, ac = arg_of(call, 2, "scale_factor"), arg_of(call, 4, "align_corners")
    sf = tuple(sf) if isinstance(sf, list | tuple) else (sf,) * 3
    if len(src) != 5 or len(sf) != 3 or src[3:] != dst[3:] or any(float(s) != 1.0 for s in sf[1:]) or \
            arg_of(call, 1, "size") is not None or arg_of(call, 5, "recompute_scale_factor"):
        return (f"interpolate mode={arg_of(call, 3, 'mode')!r} of a video value from {tuple(src[2:])} to "
                f"{tuple(dst[2:])} (placed: by a scale factor in time only, space kept)")
    ft = float(sf[0])
    if ft != int(ft) or ft < 1:
        return f"trilinear interpolation of a video value's frames by {ft} (an integer factor is placed)"

    mode = arg_of(call, 3, "mode")

    def fn(t, ctx, sf=sf, ac=ac, mode=mode):
        if not t.shape[2]:  # (no frames: a first frames' others, of a short video)
            return t.new_empty((*t.shape[:2], 0, *t.shape[3:]))
        return torch.nn.functional.interpolate(t, scale_factor=list(sf), mode=mode, align_corners=ac)

    out = low.b.emit(Rearrange, (low.spatial(x.node),), op_name(call, "interpolate"), fn=fn,
                     frames_fn=lambda t, step, ft=int(ft): t * ft, label=f"trilinear x{int(ft)} in time")
    low.set(call.outs[0], out)
    return True


def _squeeze(low: Lowering, i: int, call: Call) -> bool | str:
    """x.squeeze(2) of a one-frame video value: the same value, remembered as squeezed (the next calls
    on it are those of `SQUEEZED_RULES`)."""
    x, dim = arg_of(call, 0, "input"), arg_of(call, 1, "dim")
    if not isinstance(x, Ref) or low.spatial(x.node) is None:
        return False
    if dim not in (2, -3) or low.cap.values[x.node].shape[2] != 1:
        return f"squeeze(dim={dim}) of a video value (a one-frame value's time axis is placed)"
    low.set(call.outs[0], low.spatial(x.node))
    low.squeezed.add(call.outs[0])
    return True


def _unsqueeze(low: Lowering, i: int, call: Call) -> bool | str:
    """x.unsqueeze(2) of a squeezed one-frame value: the video value again."""
    x, dim = arg_of(call, 0, "input"), arg_of(call, 1, "dim")
    if dim not in (2, -3):
        return f"unsqueeze(dim={dim}) of a squeezed video frame (its time axis back, dim=2, is placed)"
    low.set(call.outs[0], low.spatial(x.node))
    return True


def _squeezed_item(low: Lowering, i: int, call: Call) -> bool | str:
    """x[:, :, None] of a squeezed one-frame value: the video value again (as unsqueeze(2))."""
    x, idx = arg_of(call, 0, "input"), arg_of(call, 1, "indices")
    if not isinstance(idx, tuple) or idx[:3] != (slice(None), slice(None), None) or any(
            s not in (slice(None), Ellipsis) for s in idx[3:]):
        return f"an index {idx!r} of a squeezed video frame (its time axis back, [:, :, None], is placed)"
    low.set(call.outs[0], low.spatial(x.node))
    return True


def _squeezed_unary(low: Lowering, i: int, call: Call) -> bool | str:
    """An alias of a squeezed frame (contiguous, ...): still the squeezed frame."""
    x = arg_of(call, 0, "input")
    if call.name not in ("contiguous", "clone", "detach") or not isinstance(x, Ref):
        return False
    low.set(call.outs[0], low.spatial(x.node))
    return True


def _parts_cat(low: Lowering, call: Call, tensors) -> str | None:
    """The parts of one split of frames concatenated back in order (each part maybe resampled apart:
    HunyuanVideo's upsampler): a FrameCat of them, or None where they are not."""
    parts = [low.frame_parts.get(t.node) for t in tensors]
    if any(p is None for p in parts) or len({p[0] for p in parts}) != 1:
        return None
    if [p[1] for p in parts] != list(range(parts[0][2])) or len({t.node for t in tensors}) != len(tensors):
        return None
    if len({low.cap.values[t.node].shape[3:] for t in tensors}) != 1:
        return None
    return low.b.emit(FrameCat, tuple(low.spatial(t.node) for t in tensors), op_name(call, "frames"))


def _permute(low: Lowering, i: int, call: Call) -> bool | str:
    """A video value's frames folded into the batch for a GroupNorm of each frame (`video_fold`), or its
    tokens on their way to an Attention (`video_tokens`); False for another permute."""
    return (fold_rule(low, i, call, permutation(call)) or tokens_rule(low, i, call)
            or sdpa_rule(low, i, call) or columns_rule(low, i, call) or permute_rule(low, i, call))


def _triple(v) -> tuple[int, int, int]:
    return tuple(int(x) for x in v) if isinstance(v, list | tuple) else (int(v),) * 3


VIDEO_RULES = {"conv3d": _conv3d, "__getitem__": _frames_item, "repeat": _repeat,
               "repeat_interleave": repeat_interleave_rule, "avg_pool3d": avg_pool3d_rule,
               "cat": _frames_cat,
               "concatenate": _frames_cat, "concat": _frames_cat, "group_norm": _group_norm, "split": _split,
               "interpolate": _interpolate, "squeeze": _squeeze, "permute": _permute,
               "new_ones": new_ones_rule, "unbind": unbind_rule, "reshape": interleave_rule,
               "view": interleave_rule,
               "pad": pad_of_pad, "expand": front_rule, "empty_like": empty_rule,
               "new_empty": empty_rule, "__setitem__": lambda low, i, c: write_rule(low, i, c, _frames_cat),
               **{a: pad_alias for a in ("to", "contiguous")}}
# the calls placed on a one-frame video value squeezed to (B, C, H, W) (any other is refused: the 2-D rules
# would run it on the (B, C, 1, H, W) value); elementwise functions run on it as they are
SQUEEZED_RULES = {"interpolate": _interpolate, "unsqueeze": _unsqueeze, "__getitem__": _squeezed_item,
                  "contiguous": _squeezed_unary,
                  "clone": _squeezed_unary, "detach": _squeezed_unary}
