"""A VAE family's tile programs: its decode or encode traced (`locality.trace`) into a program, a causal
loop's first and a later call merged, a chunked family's per kind of first call; lowered once per VAE
state and first call, refused by name (LoweringError) when the TiledVAE is built, never at a call. The
families themselves are table entries in `families`."""

from __future__ import annotations

import weakref
from dataclasses import replace

import torch

from ..locality.build import LoweringError
from ..locality.lowering import EXAMPLE_FRAMES, EXAMPLE_HW
from ..locality.program import Program
from ..locality.trace import lower_traced
from ..locality.trace.calls import merge_calls
from .families import Family
from .settings import Kind


def lower_family(vae, family: Family, kind: Kind, frames: int | None = None) -> Program:
    """The tile program of a decode or encode of `vae`: its family's computation traced (`locality.trace`,
    with decode's per-call inputs, `Family.inputs`; a causal loop's first and a later call, `Family.loop`,
    merged into one program); a chunked family's (`Family.chunk`) for an input of `frames` frames: its
    first call traced, the calls its steps (default: the steady calls' frame count, as every call after
    the first). Lowered once per VAE state and first call. LoweringError naming the VAE, the call and its
    module path, for one the lowering cannot place."""
    name = type(vae).__name__
    if family.refuses(vae):
        raise LoweringError(f"TiledVAE cannot tile {name}: {family.refuses(vae)}")
    state = _state(vae), family.state(vae) if family.state is not None else ()
    lead, every = _chunk(vae, family, kind)
    first = _first(lead, every, frames) if every else None
    cached = _CACHE.get(vae, {}).get((kind, first))
    if cached is not None and _same_state(cached[0], state):
        return cached[1]
    call = f" of a first call of {first} frames" if every else ""
    what = f"TiledVAE cannot tile {name} ({kind.value}{call})"
    steady = lower_family(vae, family, kind, every) if every and first > every and not lead else None
    try:
        if family.loop is not None:
            program = _lower_loop(vae, family, kind, f"{name}.{kind.value}")
        else:
            run = family.decode if kind is Kind.DECODE else family.encode
            inputs = family.inputs(vae) if family.inputs is not None and kind is Kind.DECODE else {}
            program = lower_traced(vae, lambda t, *e: run(vae, t, *e), _example(vae, kind, family, first),
                                   name=f"{name}.{kind.value}", inputs=inputs)
            if every:
                program = replace(program, first=first, every=every, chunked=True, tail=bool(lead))
                if first >= every and not lead:  # (several calls: its later steps are the steady calls')
                    _check_later(program, program if first == every else steady)
                # (a loop whose first call takes other frames than the rest, KVAE's: no first call is a
                # later one, whose first frame is not apart (`trace.video._frames`) where a cache is read)
    except LoweringError as e:
        raise LoweringError(f"{what}: {e}") from None
    _CACHE.setdefault(vae, {})[kind, first] = (state, program)
    return program


def _lower_loop(vae, family: Family, kind: Kind, name: str) -> Program:
    """A causal loop's program (`Family.loop`): its first and a later call traced and merged
    (`trace.calls.merge_calls`) with what runs on every frame before and after the loop (traced on a
    video of EXAMPLE_FRAMES)."""
    steps, calls, (before, after) = family.loop(vae, kind, lambda t: _example(vae, kind, family, t))
    head, later = (lower_traced(vae, run, x, name=name) for run, x in calls)
    video = _example(vae, kind, family)
    dtype = video.dtype
    if before is not None:
        before = lower_traced(vae, before[0], video.new_empty((1, before[1], *video.shape[2:])), name=name)
    if after is not None:
        after = lower_traced(vae, after[0], torch.empty(1, after[1], EXAMPLE_FRAMES[0], *EXAMPLE_HW,
                                                        device="meta", dtype=dtype), name=name)
    return merge_calls(head, later, name, steps, before=before, after=after)


def _check_later(program, steady) -> None:
    """LoweringError where a chunked program, traced on its first call, computes in the calls after it
    other ops or frames than a steady call's own trace does (`VideoProgram.call_ops`)."""
    if program.call_ops(1) != steady.call_ops(0):
        raise LoweringError(f"the program traced on its first call of {program.first} frames computes, in "
                            f"the calls of {program.every} frames after it, other ops or frames than their "
                            "own trace does (a branch on the call's frame count it does not follow: an odd "
                            "call resamples its first frame apart)")


def _chunk(vae, family: Family, kind: Kind) -> tuple[int, int]:
    """(lead, every) of a chunked family's loop: `every` frames a call, the first taking the remainder too
    (lead 0: CogVideoX's) or `lead` frames (the last then the remainder: KVAE's); (0, 0) for another."""
    if family.chunk is None or family.refuses(vae):
        return 0, 0
    got = family.chunk(vae, kind)
    return (int(got[0]), int(got[1])) if isinstance(got, tuple) else (0, int(got))


def _first(lead: int, every: int, frames: int | None) -> int:
    """The frames of the first call of a chunked loop for an input of `frames` (default: a steady call's
    count, or the lead's)."""
    if lead:
        return lead if frames is None else min(lead, frames)
    return first_call(every, every if frames is None else frames)


def first_call(every: int, frames: int) -> int:
    """The frames the first call of a chunked loop of `every` frames a call takes of `frames` (the others'
    and the remainder; all of them for fewer than 2 every)."""
    return frames - every * (max(frames // every, 1) - 1)


def lower_calls(vae, family: Family, kind: Kind) -> None:
    """Lower what a TiledVAE of `vae` runs, refused here, not at a call: the program, and a chunked
    family's for each kind of first call (of the steady calls' frames, one more, fewer: its branches on
    the frame count)."""
    lead, every = _chunk(vae, family, kind)
    kinds = {lead, 1} if lead else {every, every + 1, 1}  # (KVAE's first calls: of all its frames, of fewer)
    for frames in sorted(kinds) if every else (None,):
        lower_family(vae, family, kind, frames)


_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # vae -> kind -> (state, program)


def _state(vae) -> tuple[tuple, tuple[bool, ...]]:
    """What a program was lowered from: the VAE's parameters (moves and casts keep them; replacing a
    layer does not) and its modules' training modes (dropout, ...)."""
    return tuple(vae.parameters()), tuple(m.training for m in vae.modules())


def _same_state(a, b) -> bool:
    """Whether two (`_state`, the family's state) pairs are the same."""
    (pa, ma), fa = a
    (pb, mb), fb = b
    return fa == fb and ma == mb and len(pa) == len(pb) and all(x is y for x, y in zip(pa, pb, strict=True))


def _example(vae, kind: Kind, family: Family, frames: int | None = None):
    """The example a family's decode or encode is traced on (meta: nothing is computed): a latent of
    EXAMPLE_HW, or an image of EXAMPLE_HW times 64 (every downsampling of 2 up to 64 divides it) of
    in_channels (or the family's `channels`); a video family's of EXAMPLE_FRAMES (or its `example_frames`)."""
    cfg = vae.config
    h, w = EXAMPLE_HW
    dtype = next((p.dtype for p in vae.parameters()), torch.float32)
    video = family.video or family.batched and kind is Kind.DECODE
    own = family.example_frames(vae, kind) if family.example_frames is not None else None
    frames = ((frames or own or EXAMPLE_FRAMES[kind is Kind.ENCODE]),) if video else ()
    if kind is Kind.DECODE:
        c = next((cfg[k] for k in ("latent_channels", "z_channels", "latent_dim", "z_dim") if k in cfg), None)
        if c is None:
            raise LoweringError(f"TiledVAE cannot tile {type(vae).__name__}: its config names no latent "
                                "channels (latent_channels, z_channels)")
        return torch.empty(1, int(c), *frames, h, w, device="meta", dtype=dtype)
    c = family.channels(vae) if family.channels is not None else int(cfg.in_channels)
    return torch.empty(1, c, *frames, h * 64, w * 64, device="meta", dtype=dtype)
