"""Fast mode's programs as a plan's search makes them (the head / part split, the pieces, the low pass),
each once per search inside `memo.remembered()`, and the cuts of its passes that `settle._recomputed`
tries recomputing staged values in (`staged_cuts`).
"""

from __future__ import annotations

from ...locality.program import Program
from ..fast.split import fast_split, low_pass, low_program, recomputed_in, split_pieces, split_program
from ..run.options import Choices
from ..settings import Job, Kind, Settings
from .memo import recall, segments


def staged_cuts(job: Job, settings: Settings, choices: Choices) -> list[tuple[list, str, str]]:
    """The cuts of a fast plan's passes that may recompute staged values instead of moving them (each: its
    segments with the values it recomputes already, its input, the `Choices` field naming them), as they
    run: the exact latent-resolution pass (decode's head, encode's tail: exact mode's recomputation), the
    low pass (`low_recompute`: its program reuses the part's value names) and, where the sampled tiles are
    staged, their pass piece by piece (`staged_tile_stats`); `settle._recomputed` tries them. The other
    tiles stage nothing (the crop estimator: no cuts)."""
    k = fast_split(job.program, job.kind, settings.mode, settings.fast)
    if k is None:
        return []
    first, second = split_once(job.program, k)
    exact, part = (first, second) if job.kind is Kind.DECODE else (second, first)
    progs = [exact, *(pieces_once(part, choices.fast_cuts or ()) if choices.staged_estimate else ())]
    cuts = [(segments(q, {}, settings.attention, recomputed_in(q, choices.recompute)), q.input, "recompute")
            for q in progs]
    if settings.fast.low:
        low = low_program(part, settings.fast.low)[0] if job.kind is Kind.DECODE else part
        cuts.append((segments(low, {}, settings.attention, choices.low_recompute), low.input,
                     "low_recompute"))
    return cuts


def split_once(p: Program, k: int) -> tuple[Program, Program]:
    """`fast.split.split_program`, once per program and cut inside `memo.remembered()`: the same programs
    for every plan a search makes, so that what is remembered by program (segments, counts) is found."""
    return recall(("fast split", id(p), k), lambda: split_program(p, k), p)


def pieces_once(part: Program, cuts: tuple[int, ...]) -> list[Program]:
    """`fast.split.split_pieces`, once per part and cuts inside `memo.remembered()` (as `split_once`)."""
    return recall(("fast pieces", id(part), tuple(cuts)), lambda: split_pieces(part, tuple(cuts)), part)


def low_pass_once(kind: Kind, part: Program, shape, ref: str, low: int, factor: int):
    """`fast.split.low_pass`, once per part and shape inside `memo.remembered()` (as `split_once`)."""
    args = (kind, part, tuple(shape), ref, low, factor)
    return recall(("fast low pass", id(part), *args[2:]), lambda: low_pass(*args), part)
