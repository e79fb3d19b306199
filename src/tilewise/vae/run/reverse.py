"""The reverse of a tile program: exact gradients of a tiled run, segment by segment, last to first.

The forward (`Executor` with `keep_staged`) leaves every staged value (the segments' inputs) and the
GroupNorm statistics it applied. The reverse walks the segments backwards; each one, tile by tile:

1. recompute the segment's ops with autograd on the tile's boxes (`back_propagate` of its cores: the
   halo included), from the staged inputs' crops, which are leaves, and with each GroupNorm's whole-image
   statistics (mean, var) as leaves too;
2. backward the cores of its outputs with the same crops of their gradients, and sum the crops' input
   gradients into the whole gradient of each input (halo parts land in the neighbours' rows: a
   convolution's transpose), the statistics' gradients over all tiles, and the parameters' gradients;
3. after the last tile, the statistics' gradients become the input's pointwise, streamed over the staged
   input: dx += dmean / N + dvar 2 (x - mean) / N per (batch, group) (`_norms`: the transposed sync
   point of the forward's merged moments).

A global attention segment recomputes the keys and values of every token from the staged normalised
input, attends each tile's queries with them as leaves (their gradients summed over the tiles), then
backs them through the key and value projections once (`_attention`). Each segment's outputs' gradients
die when it is done; what the reverse holds is the staged values, the gradients of the values staged
across the segment, and one tile's recomputed graph. The 3-D causal VAEs' reverse (`video.reverse`) runs
each causal step this way on the same pieces: `TileReverse` (the gradients' crops, the parameters', a
global attention segment) and `norm_input_grad` (the statistics' gradients as their input's).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ...locality.boxes import box_empty, map_box, sub_tensor
from ...locality.ops import OpKind, RunContext
from ...locality.program import SegmentKind, back_propagate
from .executor import Executor, tile_grid
from .staging import Staging

__all__ = ["TileReverse", "backward", "norm_affine", "norm_input_grad"]

NORM_ROWS_BYTES = 1 << 20  # bytes of float64 rows one step of `_norms` holds


def backward(ex: Executor, stage: Staging, stats: dict[int, Any], x, grad_out, params, want_x: bool):
    """(gradient of the input or None, [gradient of each of `params` or None]) of the run of `ex` on x
    whose kept staging and statistics are given, for the output gradient `grad_out`."""
    return _Reverse(ex, stage, stats, x, tuple(params), want_x).go(grad_out)


def norm_affine(op, stats, x):
    """GroupNorm's per-channel affine (a, s) of statistics (mean, var) (float64 (B, groups)), differentiable
    (`ops.group_norm_affine`'s values: r and r mean in float64, rounded once to float32 or wider)."""
    mean, var = stats
    cg = x.shape[1] // op.groups
    dt = torch.promote_types(x.dtype, torch.float32)
    r = torch.rsqrt(var + op.eps)
    rc, rmc = (t.repeat_interleave(cg, dim=1).to(dt) for t in (r, r * mean))
    if op.weight is None:
        a, s = rc, -rmc
    else:
        a, s = rc * op.weight, -rmc * op.weight
        s = s if op.bias is None else s + op.bias
    return a.view(-1, x.shape[1], 1, 1), s.view(-1, x.shape[1], 1, 1)


def norm_input_grad(op, sums, mean, n: int, c: int):
    """(a, b), float64 (rows, C): GroupNorm's statistics' gradients (dmean, dvar), summed over the tiles, as
    its input's, dx = a x + b = dmean / N + dvar 2 (x - mean) / N (the biased variance over the N elements
    of each row of the statistics: (batch, group), or (batch frame, group)); the transposed sync point of
    the forward's merged moments."""
    dm, dv = (torch.as_tensor(g, dtype=torch.float64, device=mean.device) + torch.zeros_like(mean)
              for g in sums)
    a = dv * (2 / n)
    b = dm / n - a * mean
    cg = c // op.groups
    return a.repeat_interleave(cg, dim=1), b.repeat_interleave(cg, dim=1)


@dataclass
class _GradContext(RunContext):
    """RunContext of a recomputed tile: GroupNorms apply the forward's statistics (this tile's leaves of
    them where given) through a differentiable affine."""

    leaves: dict[int, Any] = field(default_factory=dict)  # id(GroupNorm) -> (mean, var) leaves

    def group_affine(self, op, x, box, shape):
        stats = self.leaves.get(id(op)) or self.stats.get(id(op))
        if stats is None:
            raise AssertionError(f"statistics of {op.name} are not ready: a segment cut is missing")
        return norm_affine(op, stats, x)


class TileReverse:
    """What every reverse tile program does with gradients: crops of the staged values' whole gradients
    (`grads`) added into, the parameters' gradients summed (`pgrads`), and a global attention segment
    reversed (`_attention`). A subclass says where staged values are read (`_read`) and which tile cores
    an attention's queries come in (`_cores`)."""

    grads: dict[str, Any]
    pgrads: list
    params: tuple
    shapes: dict
    dtype: Any
    query_chunk: int = 4096

    def _read(self, v: str, box):
        raise NotImplementedError

    def _cores(self, v: str) -> list:
        raise NotImplementedError

    # -- global attention ---------------------------------------------------------------------------

    def _attention(self, seg) -> None:
        """Global attention: every token's keys and values recomputed, each tile's queries backwarded with
        them as leaves, then the summed key and value gradients through their projections."""
        op = seg.ops[0]
        n_v = op.src[0]
        h, w = self.shapes[n_v]
        with torch.enable_grad():
            n_all = self._read(n_v, (0, h, 0, w)).detach().requires_grad_(True)
            k, v = op.keys_values(n_all)
        kl, vl = k.detach().requires_grad_(True), v.detach().requires_grad_(True)
        ctx = _GradContext(kv={id(op): (kl, vl)}, query_chunk=self.query_chunk)
        out = op.dst
        dk = dv = None
        for core in self._cores(out):
            ins = [self._read(s, core).detach().requires_grad_(s in self.grads) for s in op.src]
            with torch.enable_grad():
                y = op.run(ctx, ins, [core] * len(ins), core, [self.shapes[s] for s in op.src])
            gs = torch.autograd.grad(y, [*ins, kl, vl, *self.params], self._crop(out, core),
                                     allow_unused=True)
            for s, g in zip(op.src, gs, strict=False):
                if g is not None and s in self.grads:
                    self._add(s, core, g)
            m = len(ins)
            dk = gs[m] if dk is None else dk + gs[m]
            dv = gs[m + 1] if dv is None else dv + gs[m + 1]
            self._params(gs[m + 2:])
        if dk is None:
            return
        gs = torch.autograd.grad([k, v], [n_all, *self.params], [dk, dv], allow_unused=True)
        if n_v in self.grads:
            self._add(n_v, (0, h, 0, w), gs[0])
        self._params(gs[1:])

    # -- accumulation -------------------------------------------------------------------------------

    def _crop(self, v: str, box):
        """The box of value v's gradient."""
        return self.grads[v][..., box[0] : box[1], box[2] : box[3]]

    def _add(self, v: str, box, g) -> None:
        """Add g into the box of value v's gradient."""
        self._crop(v, box).add_(g.to(self.dtype))

    def _params(self, gs) -> None:
        """Add the parameters' gradients of one backward (None: not used there)."""
        for i, g in enumerate(gs):
            if g is None:
                continue
            if self.pgrads[i] is None:
                self.pgrads[i] = g  # (a new tensor of autograd's: ours to add into)
            else:
                self.pgrads[i].add_(g)


class _Reverse(TileReverse):
    """The state of one backward: the gradients of the staged values, of the parameters, and the
    statistics' gradients of the segment being reversed."""

    def __init__(self, ex: Executor, stage: Staging, stats, x, params: tuple, want_x: bool):
        p = ex.program
        if ex.options.recompute:  # (a measured value's gradient would flow only through its statistics)
            raise ValueError(f"recomputed values {ex.options.recompute} are for forward runs, not gradients")
        self.ex, self.stage, self.stats, self.params, self.want_x = ex, stage, stats, params, want_x
        self.shapes, self.chans = p.shapes(tuple(x.shape[-2:])), p.channels()
        self.segs = ex.segments()
        self.grid = tile_grid(self.shapes[ex.ref], ex.tile_size)
        self.batch, self.dtype, self.device = x.shape[0], x.dtype, x.device
        self.grads: dict[str, Any] = {}  # value -> the gradient of all of it
        self.pgrads: list = [None] * len(params)
        self.query_chunk = ex.options.query_chunk

    def _read(self, v: str, box):
        return self.stage.read(v, box)

    def _cores(self, v: str) -> list:
        ref = self.shapes[self.ex.ref]
        cores = [map_box(t.core, ref, self.shapes[v]) for t in self.grid]
        return [b for b in cores if not box_empty(b)]

    def go(self, grad_out):
        p = self.ex.program
        self.grads[p.output] = grad_out
        first = {}  # staged value -> the first segment reading it: freed once that one is reversed
        for i, seg in reversed(list(enumerate(self.segs))):
            first.update({u: i for u in seg.inputs if u != p.input})
        for i, seg in reversed(list(enumerate(self.segs))):
            if any(v in self.grads for v in seg.outputs):
                self._segment(seg)
            for v in [v for v, j in first.items() if j == i]:
                self.stage.free(v)
        return self.grads.get(p.input), self.pgrads

    def _segment(self, seg) -> None:
        """One segment reversed: its inputs' gradients made, its tiles run, its outputs' gradients dropped."""
        p = self.ex.program
        for u in seg.inputs:
            if u not in self.grads and (u != p.input or self.want_x):
                full = (self.batch, self.chans[u], *self.shapes[u])
                self.grads[u] = torch.zeros(full, dtype=self.dtype, device=self.device)
        if seg.kind is SegmentKind.ATTENTION:
            self._attention(seg)
        else:
            self._local(seg)
        for v in seg.outputs:  # (read by later segments only: reversed already)
            self.grads.pop(v, None)

    # -- local segments -----------------------------------------------------------------------------

    def _local(self, seg) -> None:
        """A local (or whole-module) segment, tile by tile, then its statistics' gradients."""
        ref = self.shapes[self.ex.ref]
        tiles = [(0, ref[0], 0, ref[1])] if seg.kind is SegmentKind.WHOLE else [t.core for t in self.grid]
        sums: dict[int, list] = {}
        for core in tiles:
            cores = {v: map_box(core, ref, self.shapes[v]) for v in seg.outputs if v in self.grads}
            cores = {v: b for v, b in cores.items() if not box_empty(b)}
            if cores:
                self._tile(seg, cores, sums)
        self._norms(seg, sums)

    def _tile(self, seg, cores: dict, sums: dict) -> None:
        """One tile of a segment: recompute its boxes with autograd, backward its cores (module doc)."""
        need = back_propagate(seg.ops, cores, self.shapes)
        vals, crops = {}, {}
        for u in seg.inputs:
            if u in need:
                t = self._read(u, need[u]).detach()
                if u in self.grads:
                    crops[u] = t.requires_grad_(True)
                vals[u] = (t, need[u])
        leaves = {}
        for op in seg.ops:
            if op.kind is OpKind.GROUP_NORM and op.dst in need and id(op) not in self.ex.fixed_stats \
                    and op.src[0] in self.grads:
                leaves[id(op)] = tuple(s.detach().requires_grad_(True) for s in self.stats[id(op)])
        ctx = _GradContext(stats=self.stats, leaves=leaves, query_chunk=self.ex.options.query_chunk)
        with torch.enable_grad():
            for op in seg.ops:
                if op.dst in need:
                    ins, have = [vals[s][0] for s in op.src], [vals[s][1] for s in op.src]
                    y = op.run(ctx, ins, have, need[op.dst], [self.shapes[s] for s in op.src])
                    vals[op.dst] = (y, need[op.dst])
            outs = [(sub_tensor(*vals[v], b), self._crop(v, b)) for v, b in cores.items()]
        outs = [(y, g) for y, g in outs if y.requires_grad]
        if not outs:
            return
        stat_leaves = [s for pair in leaves.values() for s in pair]
        wrt = [*crops.values(), *stat_leaves, *self.params]
        gs = torch.autograd.grad([y for y, _ in outs], wrt, [g for _, g in outs], allow_unused=True)
        del vals, outs
        for u, g in zip(crops, gs, strict=False):
            if g is not None:
                self._add(u, need[u], g)
        k = len(crops)
        for j, key in enumerate(leaves):
            dm, dv = gs[k + 2 * j], gs[k + 2 * j + 1]
            acc = sums.setdefault(key, [0, 0])
            acc[0], acc[1] = acc[0] + (0 if dm is None else dm), acc[1] + (0 if dv is None else dv)
        self._params(gs[k + len(stat_leaves):])

    def _norms(self, seg, sums: dict) -> None:
        """The statistics' gradients summed over the tiles, into their input's gradient (`norm_input_grad`),
        a band of rows of the staged input at a time."""
        for op in seg.ops:
            if id(op) not in sums:
                continue
            u = op.src[0]
            h, w = self.shapes[u]
            c = self.chans[u]
            a, b = norm_input_grad(op, sums[id(op)], self.stats[id(op)][0], c // op.groups * h * w, c)
            a, b = a.view(-1, c, 1, 1), b.view(-1, c, 1, 1)
            rows = max(1, NORM_ROWS_BYTES // max(1, self.batch * c * w * 8))
            for y in range(0, h, rows):
                box = (y, min(h, y + rows), 0, w)
                xs = self._read(u, box).to(torch.float64, copy=True)
                self._add(u, box, xs.mul_(a).add_(b))

