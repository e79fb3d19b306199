"""What a plan's search makes many times over, remembered within one `settle` (`remembered`): segment
counts and classes of tiles (`counts`), the program's cuts (`segments`), tile grids (`grid`,
`query_bands`), the untiled run's FLOPs (`make`).
Each is a function of what its key holds; ids in a key stay theirs while their objects are kept with it.
"""

from __future__ import annotations

import contextlib
from contextvars import ContextVar

from ..run.attention import query_grid
from ..run.segments import cut, tile_grid
from ..settings import Attention

_REMEMBERED: ContextVar[dict | None] = ContextVar("plan_memo", default=None)


@contextlib.contextmanager
def remembered():
    """Counts remembered inside: a plan's search counts the same segment over the same grid in the same
    setting many times (each staging placement, key chunk or query band it tries changes a few segments'
    counts, not the others'), and cuts the same program with the same values recomputed."""
    token = _REMEMBERED.set({})
    try:
        yield
    finally:
        _REMEMBERED.reset(token)


def table() -> dict | None:
    """The table remembered in (None outside `remembered()`)."""
    return _REMEMBERED.get()


def recall(key, make, *keep):
    """make()'s result for `key`, made once inside `remembered()` (each time outside it); `keep`: the
    objects whose ids `key` holds, kept alive beside it."""
    memo = _REMEMBERED.get()
    if memo is None:
        return make()
    if key not in memo:
        memo[key] = (make(), keep)
    return memo[key][0]


def segments(program, fixed, attention: Attention, recomputed=()) -> list:
    """`run.segments.cut`, once per program, fixed statistics, attention and recomputed values (the
    segments are read, never changed, by the plans that share them)."""
    key = ("cut", id(program), frozenset(fixed), attention, tuple(recomputed))
    return recall(key, lambda: cut(program, fixed, attention, recomputed), program)


def grid(hw: tuple[int, int], tile: int):
    """`run.segments.tile_grid`, once per shape and tile (a grid is read, never changed)."""
    return recall(("grid", tuple(hw), tile), lambda: tile_grid(hw, tile))


def query_bands(hw: tuple[int, int], rows: int):
    """`run.attention.query_grid`, once per shape and query band."""
    return recall(("query grid", tuple(hw), rows), lambda: query_grid(hw, rows))
