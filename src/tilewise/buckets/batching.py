"""Batch assembly per bucket: every request exactly once, short batches kept and reported."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .assign import Assignment, Size
from .planner import BucketPlanner, _positive_int

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Batch:
    """Requests (by index into the input list) that share one bucket."""

    bucket: Size
    indices: tuple[int, ...]
    assignments: tuple[Assignment, ...]
    short: bool  # fewer requests than batch_size (kept as is, never filled with duplicates)

    def __len__(self) -> int:
        return len(self.indices)


class BatchPlan(list):
    """A list of Batch with the plan's totals: padding fraction, distinct shapes, short batches."""

    def __init__(self, batches: list[Batch], batch_size: int, guidance: float, latent_factor: int):
        super().__init__(batches)
        self.batch_size, self.guidance, self.latent_factor = batch_size, guidance, latent_factor

    @property
    def short_batches(self) -> list[Batch]:
        """Batches with fewer than batch_size requests."""
        return [b for b in self if b.short]

    @property
    def padding_fraction(self) -> float:
        """Padded positions / processed positions, over all requests (short batches add no filler)."""
        padded = sum(a.padded_pixels for b in self for a in b.assignments)
        total = sum(a.bucket[0] * a.bucket[1] for b in self for a in b.assignments)
        return padded / total if total else 0.0

    @property
    def cut_fraction(self) -> float:
        """Requested pixels cut away (resize-cover / crop) / requested pixels."""
        cut = sum(a.cut_fraction * a.request[0] * a.request[1] for b in self for a in b.assignments)
        total = sum(a.request[0] * a.request[1] for b in self for a in b.assignments)
        return cut / total if total else 0.0

    @property
    def shapes(self) -> list[tuple[int, int, int]]:
        """Distinct model input shapes (N, H/f, W/f); CFG (guidance > 1) doubles N."""
        cfg = 2 if self.guidance > 1 else 1
        f = self.latent_factor
        return sorted({(len(b) * cfg, b.bucket[1] // f, b.bucket[0] // f) for b in self})

    @property
    def num_shapes(self) -> int:
        """Number of distinct compiled shapes this plan needs."""
        return len(self.shapes)

    def summary(self) -> str:
        """One paragraph: batches, short ones, distinct shapes, padding and cut fractions."""
        n = sum(len(b) for b in self)
        short = ", ".join(f"{b.bucket[0]}x{b.bucket[1]}:{len(b)}" for b in self.short_batches) or "none"
        return (
            f"{n} requests in {len(self)} batches of up to {self.batch_size} over "
            f"{len({b.bucket for b in self})} buckets; short batches (kept, not filled): {short}; "
            f"{self.num_shapes} distinct shapes (guidance={self.guidance}); padding "
            f"{self.padding_fraction:.1%} of processed positions; {self.cut_fraction:.1%} of requested "
            "pixels cut."
        )


def batch_by_bucket(
    requests: Sequence[Any],
    planner: BucketPlanner,
    batch_size: int,
    policy: str = "pad",
    *,
    guidance: float = 1.0,
    **assign_kwargs: Any,
) -> BatchPlan:
    """Group requests ((width, height) pairs or Assignments) by bucket, in input order, into batches."""
    batch_size = _positive_int("batch_size", batch_size)
    assignments = [_as_assignment(i, r, planner, policy, assign_kwargs) for i, r in enumerate(requests)]
    groups: dict[Size, list[int]] = {}
    for i, a in enumerate(assignments):
        groups.setdefault(a.bucket, []).append(i)
    batches = [
        Batch(
            bucket,
            tuple(idx[j : j + batch_size]),
            tuple(assignments[i] for i in idx[j : j + batch_size]),
            len(idx[j : j + batch_size]) < batch_size,
        )
        for bucket, idx in groups.items()
        for j in range(0, len(idx), batch_size)
    ]
    plan = BatchPlan(batches, batch_size, guidance, planner.latent_factor)
    seen = sorted(i for b in plan for i in b.indices)
    if seen != list(range(len(requests))):  # every request exactly once
        raise AssertionError(f"batching lost or duplicated requests: {seen} vs {len(requests)} inputs")
    if plan.short_batches:
        logger.info(
            "%d short batch(es) kept: %s",
            len(plan.short_batches),
            [(b.bucket, len(b)) for b in plan.short_batches],
        )
    return plan


def _as_assignment(i: int, request: Any, planner: BucketPlanner, policy: str, kw: dict) -> Assignment:
    """An Assignment as given, or the planner's assignment of a (width, height) pair."""
    if isinstance(request, Assignment):
        return request
    if not isinstance(request, Sequence) or len(request) != 2:
        raise ValueError(f"request {i} must be a (width, height) pair or an Assignment, got {request!r}")
    return planner.assign(request[0], request[1], policy, **kw)
