"""A causal loop's cache read in a traced call: frames an earlier call of the loop left, concatenated along
time in front of a video value before a causal convolution (Wan's and Qwen-Image's `feat_cache`).

A call of such a loop is traced with the caches its earlier calls left (tensors it did not compute from
its input: constants of the capture). `[c, x]` along time, c such a tensor of n frames and x a video value,
is x with n frames in front that come from the step before: the causal padding of the convolution reading
it (`video._conv3d` merges it, with the zeros an `F.pad` puts in front of it, into one `CausalConv3d`
whose `pad_t` frames are its own cache, the last frames it read in the step before; `cached`: the n frames
the traced call read from an earlier call). It is placed only as such a padding: the cache is the frames
of the same stream the convolution reads (the loop carries each convolution's last input frames over),
which the tests check against the model's own loop.
"""

from __future__ import annotations

from .capture import Ref
from .state import Lowering


def cache_cat(low: Lowering, call, tensors) -> bool | str | None:
    """[c, x] along time (c a cache an earlier call left, x a video value): remembered as x with c's frames
    in front (`low.caches`; a convolution merges it); None where it is no such concatenation."""
    if len(tensors) != 2 or not all(isinstance(t, Ref) for t in tensors):
        return None
    c, x = tensors
    if c.node in low.tainted or low.spatial(x.node) is None:
        return None
    tc, tx = low.cap.values[c.node], low.cap.values[x.node]
    if tc.ndim != 5 or tc.shape[:2] != tx.shape[:2] or tc.shape[3:] != tx.shape[3:]:
        return (f"a concatenation along time of a constant of shape {tuple(tc.shape)} in front of a video "
                f"value of {tuple(tx.shape)} (a cache an earlier call left: its batch, channels and space)")
    low.caches[call.outs[0]] = (x.node, int(tc.shape[2]))
    return True
