"""Row-band sharding of the executor's tile grid over the ranks of a torch.distributed group.

Every rank builds the same plan from the same grid (no communication): the grid's tile rows are cut into
`world` contiguous runs of near-equal height (`tilewise.distributed.shard`, strategy "contiguous"), so
rank r owns one horizontal band of reference rows and, through the floor mapping of `map_box`, one band
of rows of every value. A rank stages only its band of each value plus the halo rows its own tiles
read (rows [lo, hi) of the value: about 1/N of the single-process bytes plus halos); before a segment
runs, the halo rows it lacks arrive from the ranks that own them (full-width rows, point to point, each
row once per value). The same plan tells the attention segment which rows' keys and values this rank
computes, and the output which rows it contributes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ...distributed import _comm_device, _global, all_gather_cat, all_merge_moments, shard
from ...locality.boxes import box_empty, map_box
from ...locality.program import SegmentKind, back_propagate

logger = logging.getLogger(__name__)

Rows = tuple[int, int]  # [y0, y1), half-open


def map_rows(rows: Rows, ref: int, size: int) -> Rows:
    """Reference rows mapped to a value with `size` rows (floor of the scaled edges, as map_box)."""
    return rows[0] * size // ref, rows[1] * size // ref


def _cap(a: Rows, b: Rows) -> Rows | None:
    lo, hi = max(a[0], b[0]), min(a[1], b[1])
    return (lo, hi) if lo < hi else None


@dataclass
class RowBands:
    """Which tile rows each rank runs, and the rows of each value it owns, needs and stores."""

    rank: int
    world: int
    ref_rows: int
    owned: list[Rows]  # per rank: reference rows of its tile cores ([y, y) when it has no tile)
    tiles: list[set[int]]  # per rank: the tile indices it runs
    needs: dict[tuple[int, str], list[Rows | None]] = field(default_factory=dict)  # (segment, value) -> rows
    got: dict[tuple[str, int], Any] = field(default_factory=dict)  # (value, rank) -> bool rows it holds

    @classmethod
    def build(cls, grid, rank: int, world: int) -> RowBands:
        """Contiguous runs of the grid's tile rows, balanced by core height."""

        rows: dict[int, Rows] = {}
        for t in grid:
            rows[t.row] = (t.core[0], t.core[1])
        order = sorted(rows)
        owned, tiles = [], []
        start = 0
        for r in range(world):
            mine = shard(order, r, world, cost=lambda i: rows[i][1] - rows[i][0], strategy="contiguous")
            if mine:
                owned.append((rows[mine[0]][0], rows[mine[-1]][1]))
                start = rows[mine[-1]][1]
            else:
                owned.append((start, start))
            mine_rows = set(mine)
            tiles.append({t.index for t in grid if t.row in mine_rows})
        ref_rows = max(hi for _, hi in rows.values())
        return cls(rank, world, ref_rows, owned, tiles)

    def owned_rows(self, size: int, rank: int | None = None) -> Rows:
        """Rows of a value with `size` rows that `rank` (default: this one) writes."""
        return map_rows(self.owned[self.rank if rank is None else rank], self.ref_rows, size)

    def plan_segments(self, segs, shapes, grid, ref: str, skip: set[str]) -> None:
        """Rows of each staged input every rank's tiles read, per segment (back-propagated from cores)."""
        for i, seg in enumerate(segs):
            inputs = [v for v in seg.inputs if v not in skip]
            if not inputs:
                continue
            per_rank: list[dict[str, Rows]] = [{} for _ in range(self.world)]
            owner = {i: k for k in range(self.world) for i in self.tiles[k]}
            for tile in grid:
                r = owner[tile.index]
                cores = {v: map_box(tile.core, shapes[ref], shapes[v]) for v in seg.outputs}
                cores = {v: b for v, b in cores.items() if not box_empty(b)}
                if not cores:
                    continue
                need = back_propagate(seg.ops, cores, shapes)
                for v in inputs:
                    if v in need and not box_empty(need[v]):
                        lo, hi = need[v][0], need[v][1]
                        old = per_rank[r].get(v)
                        per_rank[r][v] = (lo, hi) if old is None else (min(old[0], lo), max(old[1], hi))
            if seg.kind is SegmentKind.ATTENTION:  # keys and values of the owned rows of the normalised input
                n = seg.ops[0].src[0]
                for r in range(self.world):
                    own = self.owned_rows(shapes[n][0], r)
                    if own[0] < own[1]:
                        old = per_rank[r].get(n, own)
                        per_rank[r][n] = (min(old[0], own[0]), max(old[1], own[1]))
            for v in inputs:
                self.needs[(i, v)] = [per_rank[r].get(v) for r in range(self.world)]

    def stored_rows(self, value: str, size: int) -> Rows:
        """Rows of `value` this rank stores: its owned band plus every halo row its tiles read."""
        lo, hi = self.owned_rows(size)
        for (_, v), rows in self.needs.items():
            mine = rows[self.rank]
            if v == value and mine is not None:
                lo, hi = (mine if lo >= hi else (min(lo, mine[0]), max(hi, mine[1])))
        if lo >= hi:
            lo = hi = min(lo, size)
        return lo, hi

    def transfers(self, seg_index: int, value: str, size: int) -> list[tuple[int, int, Rows]]:
        """(src, dst, rows) that bring the rows segment `seg_index` reads to every rank, each row once."""

        rows = self.needs.get((seg_index, value))
        if rows is None:
            return []
        out = []
        for dst in range(self.world):
            have = self.got.get((value, dst))
            if have is None:
                have = np.zeros(size, dtype=bool)
                lo, hi = self.owned_rows(size, dst)
                have[lo:hi] = True
                self.got[(value, dst)] = have
            want = rows[dst]
            if want is None:
                continue
            for src in range(self.world):
                if src == dst:
                    continue
                cut = _cap(want, self.owned_rows(size, src))
                if cut is None:
                    continue
                missing = ~have[cut[0] : cut[1]]
                for a, b in _runs(missing):
                    out.append((src, dst, (cut[0] + a, cut[0] + b)))
                have[cut[0] : cut[1]] = True
        return out


def _runs(mask) -> list[Rows]:
    """Half-open runs of True in a 1-D bool array."""
    runs, start = [], None
    for i, m in enumerate(mask.tolist()):
        if m and start is None:
            start = i
        elif not m and start is not None:
            runs.append((start, i))
            start = None
    if start is not None:
        runs.append((start, len(mask)))
    return runs


def exchange_rows(stage, value: str, plan: list[tuple[int, int, Rows]], rank: int, group) -> int:
    """Run the (src, dst, rows) transfers of one staged value: full-width rows, point to point.

    Staged tensors hold rows [lo, hi) of their value (`stage.read` / `stage.write` translate), so a send
    reads global rows and a receive writes them. Returns the number of rows this rank received.
    """


    shape, dtype, where = stage.info(value)
    width = shape[-1]
    device = _comm_device(group, where)
    pending, got = [], 0
    for tag, (src, dst, (y0, y1)) in enumerate(plan):
        if src == rank:
            buf = stage.read(value, (y0, y1, 0, width)).contiguous().to(device)
            pending.append((dist.isend(buf, dst=_global(group, dst), group=group, tag=tag), buf, None))
        elif dst == rank:
            buf = torch.empty((*shape[:-2], y1 - y0, width), dtype=dtype, device=device)
            pending.append((dist.irecv(buf, src=_global(group, src), group=group, tag=tag), buf, (y0, y1)))
    for work, buf, rows in pending:
        work.wait()
        if rows is not None:
            stage.write(value, (rows[0], rows[1], 0, width), buf)
            got += rows[1] - rows[0]
    return got


def merge_group_stats(acc, group, batch: int) -> None:
    """Replace a rank's GroupStats by the exact merge over all ranks (Chan, rank order, float64)."""


    if acc.mean is None:
        zeros = torch.zeros(batch, acc.groups, dtype=torch.float64)
        n, mean, m2 = all_merge_moments(0, zeros, zeros.clone(), group)
    else:
        n, mean, m2 = all_merge_moments(acc.n, acc.mean, acc.m2, group)
    if n == 0:
        raise AssertionError("no rank saw a pixel of a GroupNorm input: the tile plan is broken")
    acc.replace(n, mean, m2)


def gather_rows(band, rows: Rows, size: int, group):
    """Every rank's output band concatenated top to bottom: the full output on every rank."""

    full = all_gather_cat(band, group, dim=-2)
    if full.shape[-2] != size:
        raise AssertionError(f"gathered {full.shape[-2]} output rows, expected {size} (this rank: {rows})")
    return full


def stream_rows(band, rows: Rows, bands: RowBands, size: int, emit, group, chunk: int = 64) -> None:
    """Send every other rank's output band to rank 0 in row chunks; rank 0 passes them to emit in order."""


    rank = bands.rank
    device = _comm_device(group, band.device)
    for src in range(1, bands.world):
        lo, hi = bands.owned_rows(size, src)
        for y in range(lo, hi, chunk):
            y1 = min(hi, y + chunk)
            if rank == src:
                dist.send(band[..., y - lo : y1 - lo, :].contiguous().to(device), dst=_global(group, 0),
                          group=group)
            elif rank == 0:
                buf = torch.empty((*band.shape[:-2], y1 - y, band.shape[-1]), dtype=band.dtype, device=device)
                dist.recv(buf, src=_global(group, src), group=group)
                emit((y, y1, 0, band.shape[-1]), buf.to(band.device))
