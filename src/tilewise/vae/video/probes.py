"""Moments of a video run's GroupNorm inputs over given boxes, beside the executor's over every tile core:
fast mode's low pass measures them over the sampled tiles' cores (mapped to its size), for the
difference / ratio correction of the sampled statistics (`fast.estimators.adjusted`)."""

from __future__ import annotations

from ...locality.boxes import box_empty, map_box, sub_tensor
from ..run.sharding import merge_group_stats
from ..run.stats import GroupStats
from .stores import folded


class Probes:
    """Per (value, groups, per frame, step): moments over `boxes` (in pixels of a value of spatial shape
    `ref`) of the cores a run stores; `shapes` are the run's values' spatial shapes."""

    def __init__(self, ref, boxes, shapes):
        self.ref, self.boxes, self.shapes = tuple(ref), tuple(boxes), shapes
        self.moments: dict[tuple, GroupStats] = {}

    def add(self, key: tuple, core, block) -> None:
        """Add the parts of `block` (core `core` of value key[0]) that lie in the boxes."""
        v, groups, per_frame, _ = key
        for b in self.boxes:
            y0, y1, x0, x1 = map_box(b, self.ref, self.shapes[v])
            part = (max(y0, core[0]), min(y1, core[1]), max(x0, core[2]), min(x1, core[3]))
            if not box_empty(part):
                acc = self.moments.setdefault(key, GroupStats(groups))
                acc.add(folded(sub_tensor(block, core, part), per_frame))

    def merge(self, key: tuple, group, rows: int) -> None:
        """Merge key's moments over the ranks of `group` (each rank added its tiles' cores)."""
        merge_group_stats(self.moments.setdefault(key, GroupStats(key[1])), group, rows)

    def stats(self, norms, steps: int) -> dict:
        """(id(op), step) -> (mean, var) over the boxes of every GroupNorm in `norms`."""
        return {(id(op), k): self.moments[key].result() for op in norms for k in range(steps)
                if (key := (op.src[0], op.groups, op.per_frame, k)) in self.moments}
