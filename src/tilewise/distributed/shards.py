"""Which tiles a rank runs: a deterministic partition of the items by key, balanced by cost (pure Python)."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import TypeVar

T = TypeVar("T")


def shard(
    items: Sequence[T],
    rank: int,
    world: int,
    key: Callable[[T], Hashable] | None = None,
    cost: Callable[[T], float] | None = None,
    strategy: str = "greedy",
) -> list[T]:
    """The items rank `rank` of `world` runs, in their given order; the shards partition `items`.

    Assignment depends only on the items (sorted by `key`), never on their order in the list:
    "greedy" is longest-processing-time first (items by decreasing `cost`, each to the least loaded rank,
    ties to the lowest rank), so equal costs give a round-robin over the sorted items and counts that
    differ by at most one; "contiguous" cuts the sorted items into `world` runs of near-equal cost (row
    bands: the fewest shard boundaries, for halo exchange).
    """
    if not isinstance(world, int) or world < 1:
        raise ValueError(f"world size must be a positive int, got {world!r}")
    if not isinstance(rank, int) or not 0 <= rank < world:
        raise ValueError(f"rank must be an int in [0, {world}), got {rank!r}")
    if strategy not in ("greedy", "contiguous"):
        raise ValueError(f"strategy must be 'greedy' or 'contiguous', got {strategy!r}")
    key = key or (lambda item: item)
    cost = cost or (lambda item: 1.0)
    keys = [key(it) for it in items]
    if len(set(keys)) != len(keys):
        raise ValueError(f"shard keys must be unique, got {len(keys) - len(set(keys))} duplicates")
    costs = [float(cost(it)) for it in items]
    if any(not c >= 0 for c in costs):
        raise ValueError(f"item costs must be >= 0, got {[c for c in costs if not c >= 0][:5]}")
    order = sorted(range(len(items)), key=lambda i: keys[i])
    owner = _greedy(order, costs, world) if strategy == "greedy" else _contiguous(order, costs, world)
    return [it for i, it in enumerate(items) if owner[i] == rank]


def _greedy(order: list[int], costs: list[float], world: int) -> dict[int, int]:
    """LPT (Graham 1969): decreasing cost, each item to the rank with the least load so far."""
    load = [0.0] * world
    count = [0] * world
    owner = {}
    for i in sorted(order, key=lambda i: -costs[i]):  # stable: equal costs keep the key order
        r = min(range(world), key=lambda r: (load[r], count[r], r))
        owner[i] = r
        load[r] += costs[i]
        count[r] += 1
    return owner


def _contiguous(order: list[int], costs: list[float], world: int) -> dict[int, int]:
    """Sorted items cut into `world` consecutive runs: item j goes to the rank whose cost band holds it."""
    total = sum(costs) or float(len(order)) or 1.0
    weights = costs if sum(costs) > 0 else [1.0] * len(costs)
    owner, before = {}, 0.0
    for i in order:
        mid = before + weights[i] / 2
        owner[i] = min(world - 1, int(mid * world / total))
        before += weights[i]
    return owner
