"""A video value's frames a:b as a step of a chunked program computes them (`frame_slice`), and every s-th
of them (`strided_rule`, a Rearrange): read by the frame-slice rules of `video` and `video_pools`."""

from __future__ import annotations

from ..ops3d import Rearrange
from .capture import Call, Ref
from .state import Lowering, op_name

# calls whose output is still the part of a split of frames their input is (`Lowering.frame_parts`)
KEEP_PARTS = {"contiguous", "clone", "detach", "squeeze", "unsqueeze", "interpolate", "to", "float",
              "__getitem__"}


def frame_slice(a, b):
    """(fn, frames_fn) of the frames a:b of a value. A value's first frame (:1) and the others (1:) are the
    first step's: after it, none and all (a chunked program traced on its first call, `VideoProgram.
    chunked`: its later calls take the branch without the first frame apart; a one-step program has
    step 0 only)."""
    if (a, b) in ((None, 1), (0, 1), (1, None)):
        def fn(t, ctx, a=a, b=b):  # (ctx None: run outside a run, as the plan measures it: a first step)
            first = ctx is None or getattr(ctx, "step", 0) == 0
            return t[:, :, a:b] if first else t[:, :, t.shape[2] if a is None or a == 0 else 0:]

        def frames_fn(t, step, a=a, b=b):
            return len(range(t)[a:b]) if step == 0 else 0 if b == 1 else t

        return fn, frames_fn
    return (lambda t, ctx, a=a, b=b: t[:, :, a:b]), (lambda t, step, a=a, b=b: len(range(t)[a:b]))


def strided_rule(low: Lowering, call: Call, x: Ref, sl: slice) -> bool:
    """x[:, :, a:b:s] (every s-th frame of a video value): a Rearrange of its frames, run on each step's
    frames as the traced call runs on its call's (never a part of a split or a padding: `frame_refs`
    holds unit-step slices only)."""
    a, b, s = sl.start, sl.stop, sl.step
    out = low.b.emit(Rearrange, (low.spatial(x.node),), op_name(call, "frames"),
                     fn=lambda t, ctx: t[:, :, a:b:s], frames_fn=lambda t, step: len(range(t)[a:b:s]),
                     label=f"frames {span_label(a, b)} every {s}")
    low.set(call.outs[0], out)
    return True


def span_label(a, b) -> str:
    """a:b as a slice is written, its missing ends blank."""
    return f"{'' if a is None else a}:{'' if b is None else b}"
