"""A causal loop's program from the traces of its calls: the first call and a later one (Wan's and
Qwen-Image's `_decode` / `_encode`, each call reading the caches the calls before it left).

The later call, traced with the caches the first one left (`video_caches`: a cache read is the causal
padding of the convolution reading it), is the program of every step after the first; its causal
convolutions' caches the steps' (a convolution its later call pads with zeros, not a cache, keeps
nothing in the step before: Wan's temporal upsampler's second call). The first call's trace is the
program of step 0: the ops it does not compute pass their input on there (`ops_steps.from_step`), a
measured op it computes otherwise is its own there (`ops_steps.first_step`). What cannot be one program
so is refused by name: an op only the first call computes, one that reads other values there, a causal
convolution padded otherwise there.
"""

from __future__ import annotations

from collections import defaultdict

from ..build import LoweringError
from ..ops import OpKind
from ..ops_steps import first_step, from_step
from ..program import Program
from ..program3d import VideoProgram


def merge_calls(first: Program, later: Program, name: str, steps: tuple[int, int, bool],
                before: Program | None = None, after: Program | None = None) -> VideoProgram:
    """The video program of a causal loop whose first call traced as `first` and the later ones as
    `later` (module docstring); steps: (frames of the first call, of each later one, whether the frames
    of an incomplete last call are dropped); before / after: one-step programs of what runs on every
    frame before and after the loop (their ops the same in every step)."""
    twins = _twins(first, later, name)
    alias = {later.input: first.input}
    ops = []
    for op in later.ops:
        twin = twins.get(op.dst)
        if twin is None:  # (not computed in the first call: its first input passes there)
            alias[op.dst] = alias[op.src[0]]
            ops.append(from_step(op, 1))
            continue
        reads = tuple(alias[s] for s in op.src)
        if reads != twin.src:
            raise LoweringError(f"{name}: {op.name} ({op.describe()}) reads other values in the first call "
                                "of the loop than in the later ones (not one program with steps)")
        alias[op.dst] = twin.dst
        ops.append(_as_first(op, twin, name))
    if alias[later.output] != first.output:
        raise LoweringError(f"{name}: the first call of the loop outputs another value than the later ones")
    f, every, drop = steps
    out, cin = later.output, later.in_channels
    if before is not None:
        ops, out = _chained(before.ops, before.output, ops, later.input, out, "loop")
        cin = before.in_channels
    if after is not None:
        ops, out = _chained(ops, out, after.ops, after.input, after.output, "after")
    return VideoProgram(ops=ops, input=later.input, output=out, in_channels=cin, name=name, call=later.call,
                        first=f, every=every, drop=drop)


def _chained(head: list, made: str, ops: list, joint: str, output: str, prefix: str) -> tuple[list, str]:
    """(head's ops, then `ops` reading head's output `made` for `joint`, renamed apart (prefix.); the name
    of `ops`' output `output`)."""
    rename = {joint: made}
    out = list(head)
    for op in ops:
        clone = object.__new__(type(op))
        clone.__dict__.update(op.__dict__)
        clone.src = tuple(rename.get(s, s) for s in op.src)
        clone.dst = rename[op.dst] = f"{prefix}.{op.dst}"
        out.append(clone)
    return out, rename[output]


def _key(op) -> tuple:
    return type(op).__name__, op.name, op.describe()


def _twins(first: Program, later: Program, name: str) -> dict:
    """later's op dst -> the first call's op of the same class, module and description (in order)."""
    pool: dict[tuple, list] = defaultdict(list)
    for op in first.ops:
        pool[_key(op)].append(op)
    twins = {}
    for op in later.ops:
        if pool.get(_key(op)):
            twins[op.dst] = pool[_key(op)].pop(0)
    only = [op for ops in pool.values() for op in ops]
    if only:
        listed = ", ".join(f"{op.name} ({op.describe()})" for op in only[:3])
        raise LoweringError(f"{name}: the first call of the loop computes ops the later calls do not: "
                            f"{listed} (an op of the first call alone is not placed)")
    return twins


def _as_first(op, twin, name: str):
    """op of the later calls with its first call's twin: itself where both compute the same; with a
    measured twin of its own in step 0 (`first_step`); refused for a causal convolution padded otherwise
    in the first call."""
    if op.kind is OpKind.CONV3D:
        same = (twin.pad_t, twin.pad_end, twin.fill, twin.fill_end, twin.stride_t) == (
            op.pad_t, op.pad_end, op.fill, op.fill_end, op.stride_t)
        if not same:
            raise LoweringError(f"{name}: the causal convolution {op.name} is padded otherwise in the first "
                                "call of the loop than in the later ones (not placed)")
        return op
    fns = [(getattr(o, "fn", None), getattr(o, "frames_fn", None)) for o in (op, twin)]
    if fns[0] == fns[1]:
        return op
    if hasattr(op, "cache_elems"):
        raise LoweringError(f"{name}: {op.name} ({op.describe()}), which keeps a cache, is computed "
                            "otherwise in the first call of the loop than in the later ones (not placed)")
    return first_step(op, twin)
