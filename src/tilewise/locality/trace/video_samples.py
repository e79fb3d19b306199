"""A video value's batch taken apart and put back: `for sample in x` (`unbind(0)`), each sample
unsqueezed to a batch of one again, the results concatenated along the batch (`cat(dim=0)`): VidTok's
non-causal temporal upsampler, which interpolates each sample apart.

The program is traced on a batch of one (`vae.family_programs`): the unbind yields that one sample, its
`unsqueeze(0)` is the video value again, and the concatenation of the one result along the batch is
that result. Every op of a tile program computes each sample of its batch alike and apart, so the ops
between run on the whole batch as the loop runs them on each sample. Any other call on a sample (its
channels as dim 0, a second sample's loop) is refused by name: only the batch of one coming back is
placed.
"""

from __future__ import annotations

from .capture import Call, Ref
from .state import Lowering, arg_of, refused


def unbind_rule(low: Lowering, i: int, call: Call) -> bool | str:
    """x.unbind(0) of a video value (iterating over its batch): its one traced sample, remembered as such
    (`Lowering.samples`); False for another dim."""
    x, dim = arg_of(call, 0, "input"), arg_of(call, 1, "dim", 0)
    if not isinstance(x, Ref) or low.spatial(x.node) is None or dim != 0:
        return False
    if len(call.outs) != 1:
        return f"unbind of a video value's batch of {len(call.outs)} (traced on a batch of one)"
    low.samples[call.outs[0]] = low.spatial(x.node)
    return True


def sample_call(low: Lowering, i: int, call: Call) -> None:
    """A call on one sample of a video value's batch: unsqueeze(0), the video value again; any other is
    refused."""
    x, dim = arg_of(call, 0, "input"), arg_of(call, 1, "dim")
    if call.name == "unsqueeze" and isinstance(x, Ref) and x.node in low.samples and dim == 0:
        low.set(call.outs[0], low.samples[x.node])
        return
    raise refused(low, call, "a call on one sample of a video value's batch (placed: unsqueeze(0), the "
                  "sample back in a batch of one)")


def samples_cat(low: Lowering, call: Call, tensors) -> bool:
    """cat(dim=0) of one video value (the samples of the traced batch of one put back): that value; False
    for several values (a batch put together from different values is not placed)."""
    if len(tensors) != 1 or not isinstance(tensors[0], Ref) or low.spatial(tensors[0].node) is None:
        return False
    low.set(call.outs[0], low.spatial(tensors[0].node))
    return True
