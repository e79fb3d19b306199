"""Halo exchange: the rows a rank's next tiles read, sent point to point by their owners, each pixel once."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from ..geometry import Box
from .groups import _comm_device, _global, rank_world


def _intersect(a: Box, b: Box) -> Box | None:
    y0, y1, x0, x1 = max(a[0], b[0]), min(a[1], b[1]), max(a[2], b[2]), min(a[3], b[3])
    return (y0, y1, x0, x1) if y0 < y1 and x0 < x1 else None


def exchange_plan(owned: Sequence[Sequence[Box]],
                  needed: Sequence[Sequence[Box]]) -> list[tuple[int, int, Box]]:
    """(src, dst, box) transfers that bring every needed pixel once from the rank that owns it.

    `owned[r]`: the boxes whose pixels rank r holds (disjoint across ranks: tile cores); `needed[r]`: the
    boxes rank r must read (cores plus halos; they may overlap). Deterministic, the same on every rank.
    """
    plan = []
    for dst, boxes in enumerate(needed):
        for src, mine in enumerate(owned):
            if src == dst:
                continue
            for ob in mine:
                cuts = [c for c in (_intersect(ob, nb) for nb in boxes) if c is not None]
                plan += [(src, dst, c) for c in _disjoint_union(cuts)]
    return plan


def _disjoint_union(rects: Sequence[Box]) -> list[Box]:
    """Disjoint boxes covering the union of `rects` (coordinate compression, row runs merged downwards)."""
    if len(rects) <= 1:
        return list(rects)
    ys = sorted({v for r in rects for v in r[:2]})
    xs = sorted({v for r in rects for v in r[2:]})
    out: list[list[int]] = []
    open_runs: dict[tuple[int, int], list[int]] = {}
    for y0, y1 in zip(ys, ys[1:], strict=False):
        cover = [any(r[0] <= y0 and y1 <= r[1] and r[2] <= x0 and x1 <= r[3] for r in rects)
                 for x0, x1 in zip(xs, xs[1:], strict=False)]
        runs, i = [], 0
        while i < len(cover):
            if cover[i]:
                j = i
                while j + 1 < len(cover) and cover[j + 1]:
                    j += 1
                runs.append((xs[i], xs[j + 1]))
                i = j + 1
            else:
                i += 1
        nxt = {}
        for run in runs:
            box = open_runs.get(run)
            if box is not None and box[1] == y0:
                box[1] = y1  # the same run continues: extend the box downwards
            else:
                box = [y0, y1, run[0], run[1]]
                out.append(box)
            nxt[run] = box
        open_runs = nxt
    return [(b[0], b[1], b[2], b[3]) for b in out]


def exchange_boxes(tensor: Any, owned: Sequence[Box], needed: Sequence[Box], group: Any) -> int:
    """Fill the `needed` boxes of a full-size (..., H, W) tensor, in place, from the ranks owning them.

    Halo exchange between tile-parallel segments (and, with needed = [whole image] on rank 0 only, the
    gather of an output): box lists are all-gathered, then each intersection goes point to point, in
    the same order on every rank. Returns the number of elements this rank received.
    """
    if group is None:
        return 0
    rank, world = rank_world(group)
    lists: list[Any] = [None] * world
    dist.all_gather_object(lists, ([tuple(b) for b in owned], [tuple(b) for b in needed]), group=group)
    plan = exchange_plan([o for o, _ in lists], [n for _, n in lists])
    device = _comm_device(group, tensor.device)
    received, pending = 0, []
    for tag, (src, dst, box) in enumerate(plan):
        sl = (..., slice(box[0], box[1]), slice(box[2], box[3]))
        if src == rank:
            buf = tensor[sl].contiguous().to(device)
            pending.append((dist.isend(buf, dst=_global(group, dst), group=group, tag=tag), buf, None))
        elif dst == rank:
            buf = torch.empty(tensor[sl].shape, dtype=tensor.dtype, device=device)
            pending.append((dist.irecv(buf, src=_global(group, src), group=group, tag=tag), buf, sl))
    for work, buf, sl in pending:
        work.wait()
        if sl is not None:  # a receive (sends keep their buffer alive until here)
            tensor[sl] = buf.to(tensor.device)
            received += buf.numel()
    return received
