"""A video value's frames a:b as a step of a chunked program computes them (`frame_slice`), and every s-th
of them (`strided_frames`): read by the frame-slice rules of `video` and `video_pools`."""

from __future__ import annotations

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


def strided_frames(a, b, s: int):
    """(fn, frames_fn) of every s-th frame of a value's frames a:b (`x[:, :, a:b:s]`)."""
    return (lambda t, ctx: t[:, :, a:b:s]), (lambda t, step: len(range(t)[a:b:s]))
