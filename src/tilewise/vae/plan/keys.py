"""What a segment's count reads (`memo_key`): the key `counts.segment_cost` remembers its counts by,
within one `memo.remembered()`.
"""

from __future__ import annotations

from dataclasses import replace

from ...locality.ops import OpKind
from ..settings import Attention, Place
from .memo import recall
from .op_costs import Setting


def memo_key(seg, grid, scope, tiles, together, banded, fixed, probes, rows: bool = True,
             places: bool = True) -> tuple:
    """What a segment's count reads: its ops, its values' (and the reference's) shapes and channels, the
    grid's cores, its program's input and output (not the program: fast mode's pieces are made anew for
    each choice tried), the statistics its values' readers merge, and of the setting what the segment can
    see (the placement of its own values; attention's options only where it has an attention op). `rows`
    False: its split values' device rows apart; `places` False: its values' places apart (`counts.
    _class_cost`)."""
    mine = set(seg.inputs) | set(seg.outputs)
    values = sorted(mine | {v for op in seg.ops for v in (op.dst, *op.src)} | {scope.ref})
    tracked = tuple(sorted((v, tuple(sorted(g))) for v, g in scope.tracked.items() if v in mine))
    return (scope.program.input, scope.program.output, tuple(id(op) for op in seg.ops), tuple(seg.inputs),
            tuple(seg.outputs), tuple((v, scope.shapes[v], scope.chans[v]) for v in values), seg.kind,
            tuple(seg.measured), seg.again, tuple(t.core for t in grid), scope.ref, tracked,
            _shared(scope.s), _own(seg, scope, mine, rows) if places else None, _attention(seg, scope.s.run),
            None if tiles is None else frozenset(tiles), together, banded, frozenset(fixed),
            tuple(probes or ()))


def _shared(s: Setting) -> Setting:
    """What every segment's count sees alike of a setting, once per setting: its run options but those
    each segment sees of its own (`_own`) and those no count reads (the segment says what it recomputes)."""
    def make():
        run = s.run.replace(staging=Place.DEVICE, on_device=frozenset(), split=(), read_ahead=False,
                            kv_chunk=0, query_rows=0, query_chunk=0, attention=Attention.GLOBAL,
                            progress=True, stage_dir=None, heap_slack=0, check_emitted=True, recompute=())
        return replace(s, run=run)

    return recall(("setting", id(s)), make, s)


def _own(seg, scope, mine: set[str], rows: bool = True) -> tuple:
    """Where one segment's count sees its own values beside `_shared`: their places (a device+host staging
    without a split value of its own places them as host staging with the same values on the device
    does), and the tiles' reads ahead only where it reads a value across the link."""
    s, run = scope.s, scope.s.run
    split = tuple((v, r if rows else 0) for v, r in run.split if v in mine)
    ahead = run.read_ahead and any(s.off(v) for v in seg.inputs if v != scope.program.input)
    return run.staging if split else run.staging.home, frozenset(v for v in run.on_device if v in mine), \
        split, ahead


def _attention(seg, run) -> tuple | None:
    """Attention's run options, where the segment has an attention op."""
    if any(op.kind is OpKind.ATTENTION for op in seg.ops):
        return run.kv_chunk, run.query_rows, run.query_chunk, run.attention
    return None
