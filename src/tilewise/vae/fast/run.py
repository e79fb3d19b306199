"""Fast mode, run: the named approximation of TiledVAE, pass by pass.

Fast mode with the sampled-tile estimator (`run_fast`) cuts the program where one value crosses
(`split.fast_split`): decode before the first upsampling, encode after the last downsampling. The
latent-resolution part runs exact; the high-resolution part's GroupNorm statistics are estimated from a
stratified sample of its real tiles (`estimators`), corrected by a `low` times smaller low pass over the
whole input, and its other tiles run end to end with them. The crop estimator (`crop_stats`, and
`color_fix`) estimates the statistics of the whole program from crops instead.
"""

from __future__ import annotations

import logging
from typing import Any

from ...distributed import broadcast, rank_world
from ...locality.boxes import map_box
from ...locality.ops import OpKind
from ...locality.program import Program
from ..run.executor import Executor
from ..run.options import Choices, RunOptions
from ..run.segments import tile_grid
from ..run.staging import trim_heap
from ..settings import Estimator, FastSettings, Job, Kind, Place
from .estimators import estimate_stats, sample_tiles, sampled_tile_stats, staged_tile_stats
from .split import fixed_ops, low_pass, piece_grid, recomputed_in, split_pieces, split_program

logger = logging.getLogger(__name__)

# Freed heap kept while fast mode's other tiles run whole with disk staging (their tile-sized buffers are
# mmapped and never reused from the heap). In-process at 1024 px, that pass with 192 / 64 / 32 MiB kept:
# decode 51 s / 376 MiB peak growth, 55 s / 265, 55 s / 265; encode 24 s / 366, 26 s / 270, 25 s / 270.
WHOLE_TILE_SLACK = 64 << 20


def crop_stats(job: Job, fast: FastSettings, x, tile: int, group) -> dict[int, Any]:
    """The crop estimator's statistics (rank 0 estimates, then broadcasts): id(GroupNorm) -> (mean, var)."""
    p = job.program
    ops = fixed_ops(p, job.kind, fast.color_fix)
    if not ops:
        return {}
    fixed = {}
    if rank_world(group)[0] == 0:
        fixed = estimate_stats(p, x, job.ref, fast.crop or tile, ops, fast.fraction(Estimator.CROPS))
    return broadcast_stats(fixed, p, group)


def run_fast(job: Job, fast: FastSettings, k: int, x, choices: Choices, options: RunOptions, emit, group):
    """Fast mode with the sampled-tile estimator: the latent-resolution part exact, the high-resolution
    part's GroupNorms estimated from a sample of its real tiles. Returns (output, most staged bytes).

    Decode runs 1 then 2-3; encode runs 2-3 then 1.
    1. The latent-resolution part (decode: post_quant_conv, conv_in, mid block with attention, the first
       up block's resnets; encode: the last down block, mid block, conv_out, quant_conv) runs in exact
       tiled mode. What crosses the cut is latent-sized (e.g. 512 x h x w) and is the only full-size
       value fast mode stages.
    2. A stratified `fast.sample` fraction of the tiles runs the high-resolution part together, op by
       op; every GroupNorm's statistics are merged over the regions those tiles hold (exact values
       given the earlier estimates, no crop padding), corrected by a `fast.low` times smaller low pass
       over the whole input (run in tiles of `choices.low_tile` reference pixels; 0: the tile), and
       their outputs are kept.
    3. The other tiles run the high-resolution part end to end with those statistics.
    With disk staging, or `choices.staged_estimate` (a GPU plan whose sampled tiles do not fit at once),
    step 2 runs the sampled tiles one at a time, segment by segment, their regions staged
    (`staged_tile_stats`; `choices.recompute`: the staged values its readers remake, and step 1's,
    each pass its own, `split.recomputed_in`). `choices.fast_cuts` (positions in the high-resolution
    part, `piece_cuts`; a GPU plan's choice) run steps 2-3 piece by piece, the value between two pieces
    whole on the device: every tile's halo then spans only its piece's receptive field, not the whole
    part's (the same values and statistics, less recomputation). `options`: how the exact passes run
    (the others follow them).
    """
    first, second = split_program(job.program, k)
    tile = choices.tile_size
    # host memory bounded by disk staging: the freed heap a pass leaves is returned before the next
    # (at 1024 px the sampled pass left ~190 MiB that the other tiles' larger buffers could not reuse)
    trim = options.staging is Place.DISK and x.device.type == "cpu"
    exact_peak = 0
    if job.kind is Kind.DECODE:
        own = options.replace(recompute=recomputed_in(first, choices.recompute))  # (the head's values)
        res = Executor(first, choices.head_tile or tile, first.input, own, x.device, group).run(x)
        part, ref, h, exact_peak = second, second.input, res.output, res.staged_peak
        del res  # (h is the only reference to the head's output: the first piece releases it)
        if trim:
            trim_heap(0)
    else:
        part, ref, h = first, first.output, x
    adjust = None
    if fast.low and rank_world(group)[0] == 0:  # (once for the whole part, whatever its pieces)
        adjust = _low_pass_stats(job, fast, part, h, ref, choices, options)
    held = [h]  # (the one reference to the part's input: its first piece releases it as it runs)
    del h
    out, h, staged_peak = _run_pieces(job, fast, part, ref, held, choices, options, emit, group, adjust)
    if job.kind is Kind.ENCODE:
        own = options.replace(recompute=recomputed_in(second, choices.recompute))  # (the tail's values)
        res = Executor(second, tile, second.output, own, x.device, group).run(h, emit=emit)
        out, exact_peak = res.output, res.staged_peak
    return out, max(exact_peak, staged_peak)


def _run_pieces(job: Job, fast: FastSettings, part: Program, ref: str, held: list, choices: Choices,
                options: RunOptions, emit, group, adjust: dict[int, Any] | None):
    """Steps 2-3 of `run_fast`, piece by piece, on the part's input `held` (a list of it alone, so that
    nothing else keeps it alive once the first piece has run), with the low pass's correction `adjust`:
    (decode's output or None, the part's output, most staged bytes of the pieces' passes)."""
    h = held.pop()
    trim = options.staging is Place.DISK and h.device.type == "cpu"
    shapes = part.shapes(tuple(h.shape[-2:]))
    pieces, staged_peak, out = split_pieces(part, choices.fast_cuts or ()), 0, None
    # the other tiles run end to end, whole: row bands would recompute the pointwise ops on the receptive
    # field's overlap rows (measured at 1024 px: decode 60 s instead of 51 for this pass). Their
    # whole-tile buffers come from mmap, not the heap, so less free heap is worth keeping.
    whole = options.replace(heap_slack=min(options.heap_slack, WHOLE_TILE_SLACK), band_bytes=None)
    for j, piece in enumerate(pieces):
        pref, ptile = piece_grid(piece, shapes, ref, choices.tile_size, job.kind)
        stats, done = {}, {}
        if rank_world(group)[0] == 0:  # with ranks: estimated once, on rank 0, then broadcast
            stats, done = _estimate(fast, piece, h, pref, ptile, options, choices, adjust)
        stats = broadcast_stats(stats, piece, group)
        if trim:
            trim_heap(0)
        ex = Executor(piece, ptile, pref, whole, h.device, group, fixed_stats=stats, done=done)
        if job.kind is Kind.DECODE and j == len(pieces) - 1:
            res = ex.run(h, emit=emit)
            out = res.output
        else:
            res = ex.run(h)  # (the piece's input is released here: only its output is held)
            h = res.output
        done.clear()  # (the sampled tiles' outputs are in h now)
        staged_peak = max(staged_peak, res.staged_peak)
        if trim and (job.kind is Kind.ENCODE or j < len(pieces) - 1):  # (before the next pass)
            trim_heap(0)
    return out, h, staged_peak


def tile_cores(fast: FastSettings, hw, tile: int, most: int = 0) -> list:
    """The cores of the sampled tiles of a grid of `tile` over a value of spatial shape hw (at most
    `most` rows and columns of them)."""
    return [t.core for t in sample_tiles(tile_grid(hw, tile), fast.fraction(Estimator.TILES), most)]


def _estimate(fast: FastSettings, part: Program, x, ref: str, tile: int, options: RunOptions,
              choices: Choices, adjust: dict[int, Any] | None):
    """Step 2 of `run_fast` on (a piece of) the part: (id(GroupNorm) -> (mean, var), sampled tile index
    -> output core); the plan's `choices` say how many tiles are sampled and whether they are staged."""
    rh, rw = part.shapes(tuple(x.shape[-2:]))[ref]
    fixed = {id(op) for op in part.ops if op.kind is OpKind.GROUP_NORM}
    tiles = sample_tiles(tile_grid((rh, rw), tile), fast.fraction(Estimator.TILES), choices.fast_most)
    if options.staging is Place.DISK or choices.staged_estimate:  # one tile's working set at a time,
        # the regions staged
        # (the plan's recomputed values: this piece's, `recomputed_in`)
        staged = options.replace(recompute=recomputed_in(part, choices.recompute))
        return staged_tile_stats(part, x, ref, tiles, fixed, staged, adjust)
    return sampled_tile_stats(part, x, ref, tiles, fixed, options, adjust)


def _low_pass_stats(job: Job, fast: FastSettings, part: Program, x, ref: str, choices: Choices,
                    options: RunOptions) -> dict[int, Any]:
    """Exact statistics of the high-resolution part run `fast.low` times smaller, over the whole image
    and over the sampled tiles' cores (for the difference / ratio correction).

    Decode: the reduction is taken out of the upsampling ops (nearest x2 becomes x1), so the low pass
    sees all of the latent-resolution content; what upsampling cannot absorb is average-pooled out of
    its input. Encode: the image is resized down (antialiased) and encoded by the same part, as the
    seed's fast mode does.
    """
    low, small, low_ref = low_pass(job.kind, part, x, ref, fast.low, job.factor)
    full = part.shapes(tuple(x.shape[-2:]))[ref]
    lo = low.shapes(tuple(small.shape[-2:]))[low_ref]
    cores = tile_cores(fast, full, choices.tile_size, choices.fast_most)
    own = options.replace(check_emitted=False, recompute=choices.low_recompute)  # (its own recomputed)
    ex = Executor(low, choices.low_tile or choices.tile_size, low_ref, own, x.device,
                  probes=tuple(map_box(c, full, lo) for c in cores))
    res = ex.run(small, emit=lambda box, value: None)
    return {id(op): (res.stats[id(op)], res.probe_stats[(op.src[0], op.groups)].result())
            for op in low.ops if op.kind is OpKind.GROUP_NORM}


def broadcast_stats(stats: dict[int, Any], program: Program, group) -> dict[int, Any]:
    """Rank 0's fast-mode statistics on every rank (keyed by op position: ids differ between processes)."""
    if group is None:
        return stats
    pos = {id(op): i for i, op in enumerate(program.ops)}
    by_pos = broadcast({pos[k]: v for k, v in stats.items()}, group, src=0)
    return {id(program.ops[i]): v for i, v in by_pos.items()}
