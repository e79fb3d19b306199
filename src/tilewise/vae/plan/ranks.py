"""What each rank of a multi-process exact TiledVAE run will hold, planned before it runs."""

from __future__ import annotations

from dataclasses import dataclass

from .executor import Executor
from .sharding import RowBands, Rows


@dataclass
class RankPlan:
    """What one rank of an exact TiledVAE run will hold: its rows, tiles and staged bytes."""

    rank: int
    rows: Rows  # reference (latent) rows of its tile cores
    tiles: int
    staged_peak: int  # most staged bytes (its bands of full-size values plus halo rows) alive at once

    def __str__(self) -> str:
        from ..memory import format_bytes

        return (f"rank {self.rank}: latent rows [{self.rows[0]}, {self.rows[1]}), {self.tiles} tiles, "
                f"staged at most {format_bytes(self.staged_peak)}")


def plan_ranks(tv, shape: tuple[int, ...], world: int, kind: str = "decode", tile_size: int | None = None,
               dtype=None) -> list[RankPlan]:
    """Per-rank plan of an exact TiledVAE run on `world` ranks (what `Executor(group=...)` will stage)."""
    import torch

    if not isinstance(world, int) or world < 1:
        raise ValueError(f"world must be a positive int (ranks), got {world!r}")
    if tv.mode != "exact":
        raise ValueError(f"per-rank plans cover exact mode; this TiledVAE has mode={tv.mode!r}")
    p = tv.program(kind)
    ref = p.input if kind == "decode" else p.output
    ex = Executor(p, tile_size or tv.tile_size, ref, attention=tv.attention, progress=False)
    shapes, chans = p.shapes(tuple(shape[-2:])), p.channels()
    segs = ex.segments()
    grid = ex._grid(shapes)
    last = ex._last_reader(segs)
    item = torch.empty((), dtype=dtype or tv.vae.dtype).element_size()
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
