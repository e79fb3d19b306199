"""The backward's plan (issue #30): what the reverse tile program (`run.reverse`) will hold and do.

Walked from the same boxes as the run: the forward keeps every staged value; the reverse then runs the
segments last to first (a staged value freed once its first reader is reversed), each holding the
gradients of the values staged across it (its inputs' and the outputs' of earlier segments read later)
and, per tile, the recomputed graph of the tile's boxes and the gradients flowing through it (about
twice the boxes' bytes); a global attention holds every token's normalised input, keys and values, their
gradients and one query tile's scores (the softmax's backward keeps them). Fast mode's crop estimator
cuts the program as its run does (its fixed GroupNorms cut nothing). Convolution FLOPs count the
recomputation and the two products of each backward (input and weight gradients): three times the
forward's multiply-adds over the boxes, two FLOPs each.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ...locality.boxes import box_area, box_empty, map_box
from ...locality.ops import OpKind
from ...locality.program import SegmentKind, back_propagate
from ...memory import format_bytes
from ..fast.split import fixed_ops
from ..run.options import Choices
from ..run.reverse import NORM_ROWS_BYTES
from ..run.segments import cut, tile_grid
from ..settings import Job, Mode, Place, Settings


@dataclass(frozen=True)
class BackwardPlan:
    """What a backward through the tiled run holds and does (the module docstring's walk)."""

    tile_size: int
    tiles: int  # tile recomputations (every segment's tiles)
    segments: int
    staged: int  # the forward's staged values, all kept for the reverse (where the staging puts them)
    grads: int  # most gradient bytes of staged values alive at once
    working: int  # largest tile's recomputed graph and its gradients
    attention_bytes: int  # global attention: tokens, keys, values, their gradients, one tile's scores
    output_bytes: int  # the output and its gradient, the parameters' gradients, a band of `_norms`
    peak: int  # output + the largest (staged values still kept + gradients alive + working) of a segment;
    # staged values count where they are in the device's memory (device staging; host staging on a CPU
    # plan), not on disk or, for a GPU plan, in host memory
    flops: int  # convolution FLOPs: recompute + input and weight gradients
    untiled_flops: int  # the same for the untiled backward

    def __str__(self) -> str:
        fb = format_bytes
        ratio = f" ({self.flops / self.untiled_flops:.3f}x untiled)" if self.untiled_flops else ""
        return "\n".join([
            f"  backward: {self.tiles} tile recomputations over {self.segments} segments (tile "
            f"{self.tile_size} latent px), reversed last to first",
            f"    staged values kept {fb(self.staged)}, gradients alive at most {fb(self.grads)}, "
            f"tile graph ~{fb(self.working)}, attention {fb(self.attention_bytes)}, output, its "
            f"gradient and the parameters' {fb(self.output_bytes)}",
            f"    conv work {self.flops / 1e9:,.1f} GFLOP{ratio}; estimated backward peak {fb(self.peak)}",
        ])


def backward_plan(job: Job, shape: tuple[int, ...], choices: Choices, settings: Settings) -> BackwardPlan:
    """The backward of the job on an input of `shape` run with `choices` (module doc)."""
    p = job.program
    shapes, chans = p.shapes(tuple(shape[-2:])), p.channels()
    unit = shape[0] * job.item
    size = {v: chans[v] * math.prod(shapes[v]) * unit for v in shapes}
    fixed = fixed_ops(p, job.kind, settings.fast.color_fix) if settings.mode is Mode.FAST else set()
    segs = cut(p, dict.fromkeys(fixed), settings.attention)  # (fast mode's crop estimator: fixed ones cut
    # nothing, its tiles run end to end)
    grid = tile_grid(shapes[job.ref], choices.tile_size)
    first = {}  # staged value -> its first reader: the reverse frees it once that segment is done
    for i, seg in reversed(list(enumerate(segs))):
        first.update({u: i for u in seg.inputs if u != p.input})
    staged = sum(size[v] for v in first)

    def resident(v: str) -> bool:  # a staged value in the memory the peak counts (the device's)
        place = Place.DEVICE if v in choices.on_device or v in dict(choices.split) else choices.staging.home
        # (a split value counted whole: its device rows are an upper bound)
        return place is Place.DEVICE or (place is Place.HOST and not job.gpu)
    live, grads, top, work, attn, tiles, macs = {p.output}, 0, 0, 0, 0, 0, 0
    for i, seg in reversed(list(enumerate(segs))):
        live |= set(seg.inputs)
        held = sum(size[v] for v in live if v != p.output)
        grads = max(grads, held)
        held += sum(size[v] for v, j in first.items() if j <= i and resident(v))  # (staged, still kept)
        if seg.kind is SegmentKind.ATTENTION:
            a = _attention_bytes(seg.ops[0], shapes, chans, grid, job.ref, unit)
            attn, seg_work = max(attn, a), a
            tiles += len(grid)
        else:
            seg_work = 0
            for tile in ([None] if seg.kind is SegmentKind.WHOLE else list(grid)):
                ref = shapes[job.ref]
                core = (0, ref[0], 0, ref[1]) if tile is None else tile.core
                cores = {v: map_box(core, ref, shapes[v]) for v in seg.outputs}
                need = back_propagate(seg.ops, {v: b for v, b in cores.items() if not box_empty(b)}, shapes)
                seg_work = max(seg_work, 2 * sum(box_area(b) * chans[v] * unit for v, b in need.items()))
                macs += _conv_macs(seg.ops, need, chans)
                tiles += 1
        work = max(work, seg_work)
        top = max(top, held + seg_work)
        live -= set(seg.outputs)
    full = {v: (0, h, 0, w) for v, (h, w) in shapes.items()}
    untiled = _conv_macs(p.ops, full, chans)
    out = 2 * size[p.output] + 2 * NORM_ROWS_BYTES + _param_bytes(p.ops)  # (+ a band of `_norms`, and the
    # parameters' gradients)
    return BackwardPlan(choices.tile_size, tiles, len(segs), staged, grads, work, attn, out, out + top,
                        6 * macs * shape[0], 6 * untiled * shape[0])


def _attention_bytes(op, shapes, chans, grid, ref: str, unit: int) -> int:
    """A global attention's backward: the normalised input, keys and values of every token and their
    gradients (x2), and the largest query tile's scores and their gradient."""
    n = math.prod(shapes[op.src[0]])
    c = chans[op.src[0]]
    q = max(box_area(map_box(t.core, shapes[ref], shapes[op.src[0]])) for t in grid)
    return 2 * 3 * n * c * unit + 2 * op.heads * q * n * unit


def _param_bytes(ops) -> int:
    """Bytes of the tensors the ops hold as attributes (weights and biases; attention's projections):
    what the parameters' gradients take at most."""
    seen: dict[int, int] = {}
    for op in ops:
        for name in ("weight", "bias", "to_q", "to_k", "to_v", "to_out"):
            a = getattr(op, name, None)
            tensors = a.parameters() if isinstance(a, torch.nn.Module) else [a]
            for t in tensors:
                if isinstance(t, torch.Tensor):
                    seen[id(t)] = t.numel() * t.element_size()
    return sum(seen.values())


def _conv_macs(ops, need, chans) -> int:
    """Multiply-adds of the convolutions of `ops` over their boxes `need`."""
    total = 0
    for op in ops:
        if op.kind is OpKind.CONV and op.dst in need:
            kh, kw = op.kernel
            total += box_area(need[op.dst]) * chans[op.dst] * (op.weight.shape[1]) * kh * kw
    return total
