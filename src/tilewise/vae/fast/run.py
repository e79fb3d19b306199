"""Fast mode: the named approximation of TiledVAE, pass by pass.

Fast mode with the sampled-tile estimator (`run_fast`) cuts the program where one value crosses
(`fast_split`): decode before the first upsampling, encode after the last downsampling. The
latent-resolution part runs exact; the high-resolution part's GroupNorm statistics are estimated from a
stratified sample of its real tiles (`estimators`), corrected by a `fast_low` times smaller low pass
over the whole input, and its other tiles run end to end with them. The crop estimator (`crop_stats`,
and `color_fix`) estimates the statistics of the whole program from crops instead. Functions take the
`TiledVAE` whose settings they follow as `tv`.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from ..locality.ops import map_box
from ..locality.program import Program
from .devices import device_options, device_profile
from .estimators import estimate_stats, sample_tiles, sampled_tile_stats, staged_tile_stats
from .executor import Executor
from .staging import trim_heap

logger = logging.getLogger(__name__)

FAST_SAMPLE = {"tiles": 0.5, "crops": 0.25}  # fast_sample=None: the default of each estimator
# Freed heap kept while fast mode's other tiles run whole with disk staging (their tile-sized buffers are
# mmapped and never reused from the heap). In-process at 1024 px, that pass with 192 / 64 / 32 MiB kept:
# decode 51 s / 376 MiB peak growth, 55 s / 265, 55 s / 265; encode 24 s / 366, 26 s / 270, 25 s / 270.
WHOLE_TILE_SLACK = 64 << 20


def sample_fraction(tv, estimator: str) -> float:
    """fast_sample, or the estimator's default: half of the tiles (decode: sampled tiles are final
    output, so sampling more costs no convolutions, only their staging), a quarter of the area in
    crops (encode: crops are extra work)."""
    if tv.fast_sample is not None:
        return tv.fast_sample
    return FAST_SAMPLE[estimator]


def fixed_ops(tv, p: Program, kind: str) -> set[int]:
    """GroupNorms whose statistics fast mode estimates (color_fix: only before the first downsampling)."""
    ops = set()
    for op in p.ops:
        if kind == "encode" and tv.color_fix and op.kind == "conv" and op.stride[0] > 1:
            break
        if op.kind == "group_norm":
            ops.add(id(op))
    return ops


def fast_split(tv, p: Program, kind: str) -> int | None:
    """Where fast mode with the sampled-tile estimator cuts the program (None: the crop estimator).

    Decode: before the first upsampling (the latent-resolution head runs exact, the high-resolution
    tail is estimated). Encode: after the last downsampling (the high-resolution head is estimated, the
    latent-resolution tail with the mid-block attention runs exact); not with color_fix, which
    estimates only before the first downsampling. The cut needs one value crossing it, GroupNorms and no
    attention in the estimated part.
    """
    if tv.mode != "fast" or tv.fast_estimator != "tiles" or (kind == "encode" and tv.color_fix):
        return None
    if kind == "decode":
        k = next((i for i, op in enumerate(p.ops) if op.kind == "resample"), None)
        late = True
    else:
        down = [i for i, op in enumerate(p.ops) if op.kind == "conv" and op.stride[0] > 1]
        k = down[-1] + 1 if down else None
        late = False
    if k is None or k == 0 or k >= len(p.ops) or len(_crossing(p, k)) != 1:
        return None
    part = p.ops[k:] if late else p.ops[:k]
    if any(op.kind == "attention" for op in part) or not any(op.kind == "group_norm" for op in part):
        return None
    return k


def crop_stats(tv, p: Program, kind: str, x, ref: str, tile: int, group) -> dict[int, Any]:
    """The crop estimator's statistics (rank 0 estimates, then broadcasts): id(GroupNorm) -> (mean, var)."""
    ops = fixed_ops(tv, p, kind)
    if not ops:
        return {}
    fixed = {}
    if _rank(group) == 0:
        fixed = estimate_stats(p, x, ref, tv.fast_crop or tile, ops, sample_fraction(tv, "crops"))
    return broadcast_stats(fixed, p, group)


def run_fast(tv, kind: str, p: Program, k: int, x, tile: int, staging: str, emit, slack: int, group,
             staged: bool = False, cuts: tuple[int, ...] = (), low_tile: int = 0):
    """Fast mode with the sampled-tile estimator: the latent-resolution part exact, the high-resolution
    part's GroupNorms estimated from a sample of its real tiles. Returns (output, most staged bytes).

    Decode runs 1 then 2-3; encode runs 2-3 then 1.
    1. The latent-resolution part (decode: post_quant_conv, conv_in, mid block with attention, the first
       up block's resnets; encode: the last down block, mid block, conv_out, quant_conv) runs in exact
       tiled mode. What crosses the cut is latent-sized (e.g. 512 x h x w) and is the only full-size
       value fast mode stages.
    2. A stratified `fast_sample` fraction of the tiles runs the high-resolution part together, op by
       op; every GroupNorm's statistics are merged over the regions those tiles hold (exact values
       given the earlier estimates, no crop padding), corrected by a `fast_low` times smaller low pass
       over the whole input (run in tiles of `low_tile` reference pixels; 0: `tile`), and their outputs
       are kept.
    3. The other tiles run the high-resolution part end to end with those statistics.
    With disk staging, or `staged` (a GPU plan whose sampled tiles do not fit at once), step 2 runs the
    sampled tiles one at a time, segment by segment, their regions staged (`staged_tile_stats`).
    `cuts` (positions in the high-resolution part, `piece_cuts`; a GPU plan's choice) run steps 2-3 piece
    by piece, the value between two pieces whole on the device: every tile's halo then spans only its
    piece's receptive field, not the whole part's (the same values and statistics, less recomputation).
    """
    first, second = split_program(p, k)
    kw = dict(attention=tv.attention, staging=staging, device=x.device, query_chunk=tv.query_chunk,
              progress=tv.progress, stage_dir=tv.stage_dir, group=group, heap_slack=slack,
              band_bytes=device_profile(tv).band_bytes, **device_options(tv))
    # host memory bounded by disk staging: the freed heap a pass leaves is returned before the next
    # (at 1024 px the sampled pass left ~190 MiB that the other tiles' larger buffers could not reuse)
    trim = staging == "disk" and x.device.type == "cpu"
    if kind == "decode":
        exact = Executor(first, tile, first.input, **kw)
        h = exact.run(x)
        if trim:
            trim_heap(0)
        part, ref = second, second.input
    else:
        part, ref, h = first, first.output, x
    shapes = part.shapes(tuple(h.shape[-2:]))
    adjust = None
    if tv.fast_low and _rank(group) == 0:  # (once for the whole part, whatever its pieces)
        cores = [t.core for t in sample_tiles(tile_grid(shapes[ref], tile), sample_fraction(tv, "tiles"))]
        adjust = _low_pass_stats(tv, kind, part, h, ref, low_tile or tile, staging, cores, slack)
    pieces, staged_peak = split_pieces(part, cuts), 0
    for j, piece in enumerate(pieces):
        pref, ptile = piece_grid(piece, shapes, ref, tile, kind)
        stats, done = {}, {}
        if _rank(group) == 0:  # with ranks: estimated once, on rank 0, then broadcast
            stats, done = _estimate(tv, piece, h, pref, ptile, staging, slack, staged, adjust)
        stats = broadcast_stats(stats, piece, group)
        if trim:
            trim_heap(0)
        # the other tiles run end to end, whole: row bands would recompute the pointwise ops on the
        # receptive field's overlap rows (measured at 1024 px: decode 60 s instead of 51 for this pass).
        # Their whole-tile buffers come from mmap, not the heap, so less free heap is worth keeping.
        ex = Executor(piece, ptile, pref, fixed_stats=stats, done=done,
                      **{**kw, "heap_slack": min(slack, WHOLE_TILE_SLACK), "band_bytes": None})
        if kind == "decode" and j == len(pieces) - 1:
            out = ex.run(h, emit=emit)
        else:
            h = ex.run(h)  # (the piece's input is released here: only its output is held)
        done.clear()  # (the sampled tiles' outputs are in h now)
        staged_peak = max(staged_peak, ex.staged_peak)
        if trim and (kind == "encode" or j < len(pieces) - 1):  # (before the next pass)
            trim_heap(0)
    if kind == "encode":
        exact = Executor(second, tile, second.output, **kw)
        out = exact.run(h, emit=emit)
    return out, max(exact.staged_peak, staged_peak)


def piece_cuts(tv, p: Program, kind: str) -> tuple[int, ...]:
    """Where fast mode's estimated part may be cut into pieces (positions in it): at its resolution
    changes, on the lower-resolution side (decode: before an upsampling; encode: after a downsampling),
    where one value crosses. () without the sampled-tile estimator."""
    k = fast_split(tv, p, kind)
    if k is None:
        return ()
    first, second = split_program(p, k)
    if kind == "decode":
        part = second
        found = [i for i, op in enumerate(part.ops) if op.kind == "resample" and i > 0]
    else:
        part = first
        found = [i + 1 for i, op in enumerate(part.ops[:-1]) if op.kind == "conv" and op.stride[0] > 1]
    return tuple(i for i in found if len(_crossing(part, i)) == 1)


def split_pieces(part: Program, cuts: tuple[int, ...]) -> list[Program]:
    """part cut before each position in `cuts` (increasing; one value crossing each)."""
    import dataclasses

    pieces, rest, at = [], part, 0
    for c in cuts:
        head, rest = split_program(rest, c - at)
        pieces.append(head)
        at = c
    pieces.append(rest)
    if len(pieces) == 1:
        return pieces
    return [dataclasses.replace(q, name=f"{part.name}[piece {j + 1} of {len(pieces)}]")
            for j, q in enumerate(pieces)]


def piece_grid(piece: Program, shapes, ref: str, tile: int, kind: str) -> tuple[str, int]:
    """A piece's reference value, its lower-resolution end (decode: its input; encode: its output), and
    the tile in its pixels: the part's tile scaled by that value's size over the part's reference."""
    v = piece.input if kind == "decode" else piece.output
    return v, tile * shapes[v][0] // shapes[ref][0]


def tile_grid(hw, tile: int):
    """The tile grid a fast-mode pass runs over a reference value of spatial shape hw (the executor's:
    serpentine order), which its plan follows too."""
    from ..geometry import TileGrid

    return TileGrid(*hw, (min(tile, hw[0]), min(tile, hw[1])), order="serpentine")


def _estimate(tv, part: Program, x, ref: str, tile: int, staging: str, slack: int, staged: bool,
              adjust: dict[int, Any] | None):
    """Step 2 of `run_fast` on (a piece of) the part: (id(GroupNorm) -> (mean, var), sampled tile index
    -> output core)."""
    rh, rw = part.shapes(tuple(x.shape[-2:]))[ref]
    fixed = {id(op) for op in part.ops if op.kind == "group_norm"}
    tiles = sample_tiles(tile_grid((rh, rw), tile), sample_fraction(tv, "tiles"))
    opts = device_options(tv)
    if staging == "disk" or staged:  # one tile's working set at a time, the sampled regions staged
        return staged_tile_stats(part, x, ref, tiles, fixed, staging, x.device, tv.stage_dir,
                                 tv.query_chunk, adjust=adjust, heap_slack=slack,
                                 band_bytes=device_profile(tv).band_bytes, **opts)
    return sampled_tile_stats(part, x, ref, tiles, fixed, tv.query_chunk, adjust=adjust, **opts)


def _low_pass_stats(tv, kind: str, part: Program, x, ref: str, tile: int, staging: str,
                    cores: list, slack: int) -> dict[int, Any]:
    """Exact statistics of the high-resolution part run `fast_low` times smaller, over the whole image
    and over the sampled tiles' cores (for the difference / ratio correction).

    Decode: the reduction is taken out of the upsampling ops (nearest x2 becomes x1), so the low pass
    sees all of the latent-resolution content; what upsampling cannot absorb is average-pooled out of
    its input. Encode: the image is resized down (antialiased) and encoded by the same part, as the
    seed's fast mode does.
    """
    low, small, low_ref = low_pass(tv, kind, part, x, ref)
    full = part.shapes(tuple(x.shape[-2:]))[ref]
    lo = low.shapes(tuple(small.shape[-2:]))[low_ref]
    ex = Executor(low, tile, low_ref, attention=tv.attention, staging=staging, device=x.device,
                  query_chunk=tv.query_chunk, progress=tv.progress, stage_dir=tv.stage_dir,
                  probes=[map_box(c, full, lo) for c in cores], heap_slack=slack, check_emitted=False,
                  band_bytes=device_profile(tv).band_bytes, **device_options(tv))
    ex.run(small, emit=lambda box, value: None)  # only its statistics are wanted
    return {id(op): (ex.last_stats[id(op)], ex.probe_stats[(op.src[0], op.groups)].result())
            for op in low.ops if op.kind == "group_norm"}


def low_pass(tv, kind: str, part: Program, x, ref: str):
    """(program, input, reference value) of the low pass; x may be a shape (planning)."""
    import torch
    import torch.nn.functional as F

    tensor = isinstance(x, torch.Tensor)
    shape = tuple(x.shape) if tensor else tuple(x)
    if kind == "decode":
        low, left = _low_program(part, tv.fast_low)
        size = (-(-shape[-2] // left), -(-shape[-1] // left))  # avg_pool2d with ceil_mode
        if tensor and left > 1:
            x = F.avg_pool2d(x, left, ceil_mode=True)
        return low, (x if tensor else (*shape[:2], *size)), low.input
    f = tv.factor("encode")
    size = tuple(max(f, round(d / tv.fast_low / f) * f) for d in shape[-2:])
    if tensor:
        x = F.interpolate(x, size=size, mode="bilinear", antialias=True, align_corners=False)
    return part, (x if tensor else (*shape[:2], *size)), ref


def _crossing(p: Program, k: int) -> set[str]:
    """Values made before op k (or p's input) that ops from k on read."""
    made = {op.dst for op in p.ops[:k]} | {p.input}
    return {s for op in p.ops[k:] for s in op.src if s in made}


def split_program(p: Program, k: int) -> tuple[Program, Program]:
    """p cut before op k, where one value crosses (decode: the first upsampling's input, between the
    latent-resolution head and the high-resolution tail; encode: the last downsampling's output)."""
    (cut,) = _crossing(p, k)
    head = Program(ops=p.ops[:k], input=p.input, output=cut, in_channels=p.in_channels,
                   name=p.name + ("[low-res]" if p.ops[k].kind == "resample" else "[high-res]"))
    tail = Program(ops=p.ops[k:], input=cut, output=p.output, in_channels=head.channels()[cut],
                   name=p.name + ("[high-res]" if p.ops[k].kind == "resample" else "[low-res]"))
    return head, tail


def _low_program(tail: Program, factor: int) -> tuple[Program, int]:
    """The tail run `factor` times smaller: upsamplings reduced (nearest x2 -> x1) as far as they absorb
    the factor; returns it and the factor left over (by which its input is average-pooled).

    (Stopping it before the last upsampling saves a third of its time, but the GroupNorms after it then
    lack the correction: measured at 1024 px with half the tiles sampled, max error 0.028 -> 0.039 on
    the SD-architecture VAE, 0.30 -> 1.40 on the narrow test model; so the whole tail runs.)
    """
    import dataclasses

    left, ops = factor, []
    for op in tail.ops:
        if op.kind == "resample" and left > 1:
            d = math.gcd(op.scale, left)
            left //= d
            op = dataclasses.replace(op, scale=op.scale // d)
        ops.append(op)
    low = Program(ops=ops, input=tail.input, output=tail.output, in_channels=tail.in_channels,
                  name=tail.name + "[low pass]")
    return low, left


def _rank(group) -> int:
    """This process's rank in group (0 without one)."""
    from ..distributed import rank_world

    return rank_world(group)[0]


def broadcast_stats(stats: dict[int, Any], program: Program, group) -> dict[int, Any]:
    """Rank 0's fast-mode statistics on every rank (keyed by op position: ids differ between processes)."""
    if group is None:
        return stats
    from ..distributed import broadcast

    pos = {id(op): i for i, op in enumerate(program.ops)}
    by_pos = broadcast({pos[k]: v for k, v in stats.items()}, group, src=0)
    return {id(program.ops[i]): v for i, v in by_pos.items()}
