"""One-frame values of a 2-D program: an image VAE in a video's layout (Qwen-Image 2.1's
AutoencoderKLQwenImage21: (B, C, 1, H, W) values whose convolutions are 2-D ones on the one frame,
`x.squeeze(2)`, conv2d, `.unsqueeze(2)`), traced on a 4-D example (its family's decode and encode add
and drop the frame axis around the wrapped class's calls).

Such a value is carried by the program as (B, C, H, W) (`Lowering.framed`): adding or dropping its frame
axis, or slicing its one frame, is the same value (these rules); a call on it that the other rules place
by replaying it (an elementwise function, a measured run of calls or module) is replayed with the frame
axis put back around the call (`carry`), so it computes as it did in the trace.
"""

from __future__ import annotations

from collections.abc import Callable

from ..ops3d import fold, unfold
from .capture import Call, Ref
from .state import Lowering, arg_of


def carry(low: Lowering, srcs: list[int], out: int, fn: Callable, plain: bool = False) -> Callable:
    """fn (a replayed call of the nodes `srcs`, making node `out`) on the program's tensors: the frame
    axis put back on the one-frame inputs, and taken off a one-frame output; a video value's frames put
    back into the batch around it (`video_batch`), unless the call is `plain` (elementwise, of no
    other tensor: it computes the same on either layout)."""
    batched = [n in low.batched for n in srcs]
    if any(batched) and not plain:

        def folded(*ts):
            b, t = next((x.shape[0], x.shape[2]) for x, f in zip(ts, batched, strict=True) if f)
            return unfold(fn(*(fold(x) if f else x for x, f in zip(ts, batched, strict=True))), b, t)

        return folded
    framed = [n in low.framed for n in srcs]
    drop = low.one_frame(low.cap.values[out])
    if not any(framed) and not drop:
        return fn

    def run(*ts):
        y = fn(*(t.unsqueeze(2) if f else t for t, f in zip(ts, framed, strict=True)))
        return y.squeeze(2) if drop else y

    return run


def _frame_dim(call: Call, i: int = 1) -> bool:
    dim = arg_of(call, i, "dim")
    return dim in (2, -3)


def _unsqueeze(low: Lowering, i: int, call: Call) -> bool:
    """x.unsqueeze(2) of a 2-D program's value: the same value, with its one frame."""
    x = arg_of(call, 0, "input")
    if not isinstance(x, Ref) or x.node in low.framed or low.cap.values[x.node].ndim != 4:
        return False
    if not _frame_dim(call):
        return False
    low.set(call.outs[0], low.spatial(x.node))
    return True


def _squeeze(low: Lowering, i: int, call: Call) -> bool | str:
    """x.squeeze(2) of a one-frame value: the same value."""
    x = arg_of(call, 0, "input")
    if not isinstance(x, Ref) or x.node not in low.framed:
        return False
    if not _frame_dim(call):
        return f"squeeze with dim={arg_of(call, 1, 'dim')!r} of a one-frame value (only its frame axis, 2)"
    low.set(call.outs[0], low.spatial(x.node))
    return True


def _frame_item(low: Lowering, i: int, call: Call) -> bool:
    """x[:, :, a:b] keeping the one frame of a one-frame value (x[:, :, :1], x[:, :, 0:1], ...), or
    x[:, :, 0] dropping its axis: the same value."""
    x, idx = arg_of(call, 0, "input"), arg_of(call, 1, "indices")
    if not isinstance(x, Ref) or x.node not in low.framed or not isinstance(idx, tuple) or len(idx) < 3:
        return False
    if idx[:2] != (slice(None), slice(None)) or any(s not in (slice(None), Ellipsis) for s in idx[3:]):
        return False
    sl, out = idx[2], low.cap.values[call.outs[0]]
    keeps = isinstance(sl, slice) and sl.step in (None, 1) and len(range(1)[sl]) == 1
    if not (keeps or sl in (0, -1)) or out.shape[-2:] != low.cap.values[x.node].shape[-2:]:
        return False
    low.set(call.outs[0], low.spatial(x.node))
    return True


FRAME_RULES = {"unsqueeze": _unsqueeze, "squeeze": _squeeze, "__getitem__": _frame_item}
