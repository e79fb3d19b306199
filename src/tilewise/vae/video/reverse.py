"""The reverse of one causal step of a video tile program, tile by tile (issue #30; `video.gradient`).

Step s, with the gradients of its output frames and of the caches it leaves (carried from step s + 1):

1. its forward again, without autograd, from the caches entering it (kept by the forward), every staged
   value of the step kept (`_Recompute`: the 2-D `Executor(keep_staged)` of one step), and its GroupNorms'
   statistics merged over the tiles as the forward merged them;
2. its segments last to first, each tile by tile (`run.reverse.TileReverse`, as the 2-D reverse): the
   tile's unit recomputed with autograd on the forward's boxes, from crops (halos included) of the staged
   inputs and the tile's entering cache frames, which are leaves, with each GroupNorm's statistics of the
   step as leaves too; its output cores' gradients and its left caches' carried gradients backed in one
   `autograd.grad`; the crops' gradients summed into the whole gradients of the step's values (halo parts
   into the neighbours'), the cache leaves' gradients carried to step s - 1, the parameters' summed;
3. after a segment's last tile, its statistics' gradients into their input's (`norm_input_grad`); a global
   attention segment recomputes its keys and values from the staged normalised input, backs each tile's
   queries with them as leaves and their summed gradients through the projections once.

Held: the step's staged values and the gradients of the values staged across the segment being reversed,
one tile's recomputed graph, an attention segment's keys and values of the step, the caches kept by the
forward and the entering and left caches' gradients of the step.
"""

from __future__ import annotations

import torch

from ...locality.boxes import sub_tensor
from ...locality.program import SegmentKind, run_op
from ..run.reverse import NORM_ROWS_BYTES, TileReverse, norm_input_grad
from .executor import VideoExecutor, _VideoRun
from .stores import Store, VideoContext

__all__ = ["StepReverse"]


class _Recompute(_VideoRun):
    """A `_VideoRun` of one step at a time that keeps every staged value of the step and emits nothing."""

    def __init__(self, ex: VideoExecutor, x):
        super().__init__(ex, x, lambda t0, box, block: None)

    def reset(self, caches: dict) -> None:
        """Fresh staging and statistics, the step's entering caches (copied dicts: the run replaces them)."""
        self.caches = {key: dict(d) for key, d in caches.items()}
        self.store = Store(self.ex.staging, torch.device(self.ex.device))
        self.moments, self.merged = {}, set()
        self.ctx.step_stats.clear()
        self.ctx.affines.clear()

    def _free(self, i: int, k: int | None) -> None:
        """(Nothing freed: the reverse reads every staged value of the step.)"""


class StepReverse(TileReverse):
    """The state of one backward through a video run: the input's and the parameters' gradients, and the
    step being reversed (its recomputed staging, its values' gradients)."""

    def __init__(self, ex: VideoExecutor, x, states: list[dict], params: tuple, want_x: bool):
        self.ex, self.x, self.states, self.params, self.want_x = ex, x, states, params, want_x
        self.bar = None
        self.run = r = _Recompute(ex, x)
        self.shapes, self.chans, self.dtype = r.shapes, r.chans, x.dtype
        self.query_chunk = ex.query_chunk
        self.gx = torch.zeros_like(x) if want_x else None
        self.pgrads: list = [None] * len(params)
        self.step = 0
        self.grads: dict = {}

    def go(self, grad_out, bar):
        """(gradient of the input or None, [gradient of each parameter or None]) for the output's gradient."""
        self.bar, carry = bar, {}
        for s in reversed(range(len(self.run.chunks))):
            carry = self._step(s, grad_out, carry)
            self.states[s] = None  # (this step's kept caches are no longer needed)
        return self.gx, self.pgrads

    def _step(self, s: int, grad_out, carry: dict) -> dict:
        """Step s reversed (module doc): the gradients of the caches entering it."""
        r, p = self.run, self.run.program
        self.step = s
        r.reset(self.states[s])
        with torch.no_grad():
            r.step(s, self.bar)
        r.caches = {}
        t0, (a, b) = r.offsets[s], r.chunks[s]
        self.grads = {p.output: grad_out[:, :, t0 : t0 + r.frames[p.output][s]]}
        if self.want_x:
            self.grads[p.input] = self.gx[:, :, a:b]
        first = {}  # staged value -> the first segment reading it: freed once that one is reversed
        for i, seg in reversed(list(enumerate(r.segs))):
            first.update({u: i for u in seg.inputs if u != p.input})
        entering: dict = {}
        for i, seg in reversed(list(enumerate(r.segs))):
            self._segment(i, seg, carry, entering)
            for v in [v for v, j in first.items() if j == i]:
                r.store.drop(v, s)
        self.grads, r.store = {}, None
        return entering

    def _segment(self, i: int, seg, carry: dict, entering: dict) -> None:
        """Segment i of the step reversed: its inputs' gradients made, its tiles run, its outputs' dropped."""
        p = self.run.program
        for u in seg.inputs:
            if u not in self.grads and u != p.input:
                self.grads[u] = torch.zeros(self.run._step_shape(u, self.step), dtype=self.dtype,
                                            device=self.ex.device)
        if seg.kind is SegmentKind.ATTENTION:
            self._attention(seg)
            self.bar.update(len(self.run.grid))
        else:
            sums: dict = {}
            for tile in self.run.grid:
                hit = self.run.layout.get((i, tile.index))
                if hit is not None:
                    self._unit(i, seg, tile.index, hit, carry, entering, sums)
                self.bar.update(1)
            self._norms(i, sums)
        for v in seg.outputs:  # (read by later segments only: reversed already)
            self.grads.pop(v, None)

    def _unit(self, i: int, seg, tile: int, hit, carry: dict, entering: dict, sums: dict) -> None:
        """One tile of a segment: recomputed with autograd on the forward's boxes, backed (module doc)."""
        r, s = self.run, self.step
        cores, need = hit
        vals, crops = {}, {}
        for u in seg.inputs:
            t = self._read(u, need[u]).detach()
            if u in self.grads:
                crops[u] = t.requires_grad_(True)
            vals[u] = (t, need[u])
        kept = self.states[s].get((i, tile), {})
        caches = {op: (box, f.detach().requires_grad_(True)) for op, (box, f) in kept.items()}
        stats, leaves = {}, {}
        for op in r.norms[i]:
            pair = r.ctx.step_stats[id(op), s]
            if op.src[0] in self.grads:
                pair = leaves[id(op)] = tuple(t.detach().requires_grad_(True) for t in pair)
            stats[id(op), s] = pair
        ctx = VideoContext(query_chunk=self.ex.query_chunk, cache_device=r.ctx.cache_device, step=s,
                           last=s == len(r.chunks) - 1, caches=dict(caches), step_stats=stats)
        with torch.enable_grad():
            for j in range(len(seg.ops)):
                run_op(seg.ops, j, ctx, vals, need, self.shapes, r.lasts[i], keep=seg.outputs)
            outs = [(sub_tensor(*vals[v], b), self._crop(v, b)) for v, b in cores.items()]
        del vals
        roots, grads = [y for y, _ in outs if y.requires_grad], [g for y, g in outs if y.requires_grad]
        for op, (_, f) in ctx.caches.items():  # (the caches the tile leaves, with step s + 1's gradients)
            g = carry.get(((i, tile), op))
            if g is None:
                continue
            if op in caches and caches[op][1] is f:  # (left as it came in: the gradient passes through)
                _sum_into(entering, ((i, tile), op), g)
            elif f.requires_grad:
                roots.append(f)
                grads.append(g.to(f.device))
        ctx.caches = {}
        if not roots:
            return
        cache_leaves = [f for _, f in caches.values()]
        stat_leaves = [t for pair in leaves.values() for t in pair]
        wrt = [*crops.values(), *cache_leaves, *stat_leaves, *self.params]
        gs = torch.autograd.grad(roots, wrt, grads, allow_unused=True)
        del roots, grads, outs
        for u, g in zip(crops, gs, strict=False):
            if g is not None:
                self._add(u, need[u], g)
        k = len(crops)
        for op, g in zip(caches, gs[k : k + len(caches)], strict=True):
            if g is not None:
                _sum_into(entering, ((i, tile), op), g)
        k += len(caches)
        for j, key in enumerate(leaves):
            dm, dv = gs[k + 2 * j], gs[k + 2 * j + 1]
            acc = sums.setdefault(key, [0, 0])
            acc[0], acc[1] = acc[0] + (0 if dm is None else dm), acc[1] + (0 if dv is None else dv)
        self._params(gs[k + len(stat_leaves):])

    def _norms(self, i: int, sums: dict) -> None:
        """Segment i's GroupNorms' statistics' gradients into their inputs' (`norm_input_grad`), a band of
        rows of the staged input at a time; statistics of each frame (B t, groups) or of the step's frames
        (B, groups)."""
        r, s = self.run, self.step
        for op in r.norms[i]:
            if id(op) not in sums:
                continue
            u = op.src[0]
            (h, w), c, t = self.shapes[u], self.chans[u], r.frames[u][s]
            n = c // op.groups * h * w * (1 if op.per_frame else t)
            a, b = norm_input_grad(op, sums[id(op)], r.ctx.step_stats[id(op), s][0], n, c)
            if op.per_frame:  # (B t, C) -> (B, C, t, 1, 1)
                a, b = (v.view(-1, t, c).transpose(1, 2)[..., None, None] for v in (a, b))
            else:
                a, b = (v.view(-1, c, 1, 1, 1) for v in (a, b))
            rows = max(1, NORM_ROWS_BYTES // max(1, self.x.shape[0] * c * t * w * 8))
            for y in range(0, h, rows):
                box = (y, min(h, y + rows), 0, w)
                xs = self._read(u, box).to(torch.float64, copy=True)
                self._add(u, box, xs.mul_(a).add_(b))

    def _read(self, v: str, box):
        return self.run._read(v, self.step, box)

    def _cores(self, v: str) -> list:
        r = self.run
        i = next(j for j, seg in enumerate(r.segs) if v in seg.outputs)
        hits = [r.layout.get((i, t.index)) for t in r.grid]
        return [hit[0][v] for hit in hits if hit is not None and v in hit[0]]


def _sum_into(grads: dict, key, g) -> None:
    """Add g into grads[key] (set where absent; a view of a larger gradient, as a cache's is of its
    convolution's padded input's, copied: the view would hold all of it)."""
    if key in grads:
        grads[key] = grads[key] + g
    else:
        grads[key] = g.clone() if g.untyped_storage().nbytes() > g.numel() * g.element_size() else g
