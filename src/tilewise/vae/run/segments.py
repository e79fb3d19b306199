"""What plans and runs share about a tile program: where it is cut into segments (`cut`), which segment
reads each staged value last (`last_readers`), and the tile grid every pass runs over (`tile_grid`). The
executor runs what these say; the plans count the same segments over the same grid.
"""

from __future__ import annotations

from ...geometry import TileGrid
from ...locality.ops import Op, OpKind
from ...locality.program import Program, Segment, recompute, split_segments
from ..settings import Attention

__all__ = ["cut", "last_readers", "tile_grid"]


def cut(program: Program, fixed, attention: Attention, recomputed=()) -> list[Segment]:
    """The program cut at its barriers: GroupNorms without fixed statistics (ids in `fixed` have them),
    and attention when global; the staged values in `recomputed` recomputed by their readers
    (`program.recompute`)."""

    def is_global(op: Op) -> bool:
        if op.kind is OpKind.GROUP_NORM:
            return id(op) not in fixed
        if op.kind is OpKind.ATTENTION:
            return attention is Attention.GLOBAL
        return op.sync

    segs = split_segments(program, is_global)
    return recompute(segs, recomputed, program.input) if recomputed else segs


def last_readers(segs: list[Segment], given: str) -> dict[str, int]:
    """Index of the last segment reading each staged value (`given`, the program input, is not staged)."""
    last: dict[str, int] = {}
    for i, seg in enumerate(segs):
        for v in seg.inputs:
            last[v] = i
    last.pop(given, None)
    return last


def tile_grid(hw: tuple[int, int], tile: int) -> TileGrid:
    """The tile grid every pass runs over a reference value of spatial shape hw: tiles of `tile` pixels
    (clipped to the value), serpentine order. Plans follow the same grid."""
    return TileGrid(*hw, (min(tile, hw[0]), min(tile, hw[1])), order="serpentine")
