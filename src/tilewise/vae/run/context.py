"""What a run of the executor is given and makes: its `ExecContext` (GroupNorm statistics looked up,
their affines kept) and its `RunResult`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ...locality.ops import RunContext
from .staging import Staging
from .stats import GroupStats


@dataclass
class ExecContext(RunContext):
    """RunContext of the executor: GroupNorm statistics are looked up, never computed on a tile; their
    per-channel affine is computed once per GroupNorm (not per tile: a GPU launches each kernel)."""

    affines: dict[int, Any] = field(default_factory=dict)  # id(op) -> (stats, (a, s))

    def group_stats(self, op, x, box, shape):
        stats = self.stats.get(id(op))
        if stats is None:
            raise AssertionError(f"statistics of {op.name} are not ready: a segment cut is missing")
        return stats

    def group_affine(self, op, x, box, shape):
        stats = self.group_stats(op, x, box, shape)
        kept = self.affines.get(id(op))
        if kept is None or kept[0] is not stats or kept[1][0].device != x.device:
            kept = self.affines[id(op)] = (stats, op.affine(stats, x))
        return kept[1]


@dataclass
class RunResult:
    """What one run made: its output (None when streamed to `emit`), the most staged bytes this process
    held at once, the statistics every GroupNorm applied, and the probes' own statistics."""

    output: Any
    staged_peak: int
    stats: dict[int, Any]  # id(GroupNorm) -> (mean, var)
    probe_stats: dict[tuple[str, int], GroupStats]  # (value, groups) -> statistics over the probe boxes
    staging: Staging | None = None  # with `keep_staged`: every staged value, open (the caller closes it)
    batched: int = 0  # (segment, tile) runs made in a batch of several tiles (`tile_batch`)
