"""What each rank of a multi-process exact TiledVAE run will hold, planned before it runs."""

from __future__ import annotations

from dataclasses import dataclass

from ...memory import format_bytes
from ..run.segments import cut, last_readers, tile_grid
from ..run.sharding import RowBands, Rows
from ..settings import Attention


@dataclass
class RankPlan:
    """What one rank of an exact TiledVAE run will hold: its rows, tiles and staged bytes."""

    rank: int
    rows: Rows  # reference (latent) rows of its tile cores
    tiles: int
    staged_peak: int  # most staged bytes (its bands of full-size values plus halo rows) alive at once

    def __str__(self) -> str:
        return (f"rank {self.rank}: latent rows [{self.rows[0]}, {self.rows[1]}), {self.tiles} tiles, "
                f"staged at most {format_bytes(self.staged_peak)}")


def rank_plans(p, ref: str, attention: Attention, shape: tuple[int, ...], world: int, tile: int,
               item: int) -> list[RankPlan]:
    """Per-rank plan of an exact run of program p (tiles of `tile` over value `ref`, `item` bytes per
    element) on `world` ranks: what each rank's `Executor(group=...)` will stage."""
    segs = cut(p, {}, attention)
    shapes, chans = p.shapes(tuple(shape[-2:])), p.channels()
    grid = tile_grid(shapes[ref], tile)
    last = last_readers(segs, p.input)
    plans = []
    for r in range(world):
        bands = RowBands.build(grid, r, world)
        bands.plan_segments(segs, shapes, grid, ref, skip={p.input})
        alive: dict[str, int] = {}
        peak = 0
        for i, seg in enumerate(segs):
            for v in seg.outputs:
                if v != p.output:
                    lo, hi = bands.stored_rows(v, shapes[v][0])
                    alive[v] = int(shape[0]) * chans[v] * (hi - lo) * shapes[v][1] * item
            peak = max(peak, sum(alive.values()))
            for v in [v for v, j in last.items() if j == i]:
                alive.pop(v, None)
        plans.append(RankPlan(r, bands.owned[r], len(bands.tiles[r]), peak))
    return plans
