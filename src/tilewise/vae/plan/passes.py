"""The plan of one pass: what one Executor run of a program over a tile grid stages, holds and dispatches
(`pass_plan`), and of the plain untiled run (`untiled_pass`). `plan.make_plan` puts passes together;
`plan_fast` makes fast mode's.
"""

from __future__ import annotations

from ..locality.program import Program
from .attention import query_grid
from .counts import Cost, Setting, segment_cost, untiled_cost
from .devices import device_profile
from .executor import Executor
from .plan_records import Pass, Stage

# Device bytes of the small tensors a segment's peak holds that the plan does not follow one by one: the
# finite checks' sums, the statistics' per-tile parts, the affines' float64 temporaries (counted: ~2 KiB
# on the narrow test VAE; a few tens of KiB at 512 channels).
SMALL_TENSORS = 64 << 10


def untiled_pass(tv, p: Program, shape, tile: int, s: Setting) -> Pass:
    """The plain untiled run as a pass: no staging; its peak is the live values of Program.run."""
    shapes, chans = p.shapes(tuple(shape[-2:])), p.channels()
    c = untiled_cost(p, shapes, chans, s)
    out_b = shape[0] * chans[p.output] * shapes[p.output][0] * shapes[p.output][1] * s.item
    q = Pass("untiled", p.name, (1, 1), 1, 1, (shape[0], chans[p.output], *shapes[p.output]), [], 0,
             c.working, 0, 1.0, out_b, 0, c.working)
    count_into(q, c)
    return q


def count_into(q: Pass, c: Cost) -> None:
    """q's FLOPs, launches, syncs and transfers from what its run dispatches (`c`)."""
    q.flops, q.launches, q.syncs, q.h2d, q.d2h = c.flops, c.launches, c.syncs, c.h2d, c.d2h


def pass_seconds(prof, q: Pass, half: bool) -> float:
    """q's estimated time on device profile `prof`, less its side-stream copies hidden under compute."""
    return prof.seconds(q.flops, q.launches, q.h2d + q.d2h, half) - q.hidden


def with_held(q: Pass, held: int) -> Pass:
    """q with `held` bytes of earlier passes' results alive during it."""
    q.held, q.peak = held, q.peak + held
    return q


def pass_plan(tv, name: str, p: Program, shape, tile: int, s: Setting, ref: str, fixed: set[int],
              full: int, tiles: set[int] | None = None, together: bool = False,
              banded: bool = True, probes: list | None = None,
              regions: dict[int, dict] | None = None, streamed: bool = False) -> Pass:
    """One Executor run of p on an input of `shape`: staged values in allocation order, the staged peak,
    the per-tile working set (summed over `tiles` when they run together), conv work, what it
    dispatches (`counts.segment_cost`), the peak on the device (a GPU plan: the most any segment holds,
    its staged values on the device and its own bytes; a CPU plan: the sum of those maxima). `regions`:
    the tiles' boxes, given (`counts.segment_cost`); `streamed`: the output cores are emitted, never
    assembled (no output buffer; the pass returns nothing)."""
    b = shape[0]
    shapes, chans = p.shapes(tuple(shape[-2:])), p.channels()
    ex = Executor(p, tile, ref, attention=tv.attention, staging="device",
                  fixed_stats={i: None for i in fixed})
    segs = ex.segments()

    def nbytes(v):
        return b * chans[v] * shapes[v][0] * shapes[v][1] * s.item

    def where(v):
        return "device" if s.staging == "device+host" and v in s.on_device else s.staging.split("+")[-1]

    producer = {op.dst: op.name for op in p.ops}
    tracked: dict[str, set[int]] = {}  # values whose statistics an exact GroupNorm merges
    for op in p.ops:
        if op.kind == "group_norm" and id(op) not in fixed:
            tracked.setdefault(op.src[0], set()).add(op.groups)
    stages, alive, peak_staged = [], {}, 0
    last = ex._last_reader(segs)
    grid = ex._grid(shapes)
    out_b = 0 if streamed else nbytes(p.output)
    # CPU convolutions' im2col buffer: row bands of at most conv_workspace bytes (measured: a fast encode
    # at 1024 px planned at 210 MiB grew by 264 before this was counted)
    im2col = s.conv_workspace if any(op.kind == "conv" for op in p.ops) else 0
    cost, attn, held, lifetimes, gpu_peak, kept, hidden = Cost(), 0, [], {}, 0, 0, 0.0
    prof = device_profile(tv)
    made_out = next(i for i, seg in enumerate(segs) if p.output in seg.outputs)
    for i, seg in enumerate(segs):
        for v in seg.outputs:
            if v != p.output:
                stages.append(Stage(v, producer[v], (b, chans[v], *shapes[v]), nbytes(v), where(v)))
                alive[v], lifetimes[v] = nbytes(v), (i, i)
        peak_staged = max(peak_staged, sum(alive.values()))
        kv, seg_grid = 0, grid
        if seg.kind == "attention":
            kv = keys_values_bytes(seg.ops[0], shapes, chans, s, len(grid))
            attn = max(attn, kv)
            if s.query_rows and tiles is None:
                seg_grid = query_grid(shapes[ref], s.query_rows)
        c = segment_cost(seg, seg_grid, shapes, chans, ref, p, tracked, s, tiles, together, banded,
                         probes=probes, regions=regions)
        cost.add(c)
        side = c.d2h_side + c.fetched - c.ahead  # (every tile's reads ahead but about the first tile's)
        hidden += prof.hidden(c.flops, c.launches, side, s.item < 4)
        out_now = out_b if i >= made_out else 0  # (the output: allocated by its own segment)
        kept += sum(b * (8 * chans[op.src[0]] + 16 * op.groups) for op in seg.ops  # statistics, affines
                    if op.kind == "group_norm" and id(op) not in fixed)  # (kept to the end of the run)
        held.append(c.working + c.ahead + kv + out_now + im2col + kept + SMALL_TENSORS)
        gpu_peak = max(gpu_peak, held[-1] + sum(n for v, n in alive.items() if where(v) == "device"))
        for v in [v for v, j in last.items() if j == i]:
            if alive.pop(v, None) is not None:
                lifetimes[v] = (lifetimes[v][0], i)
    on_device = peak_staged if (s.staging == "device" or (s.staging == "host" and not s.gpu)) else 0
    peak = gpu_peak if s.gpu else on_device + cost.working + im2col + attn + out_b
    q = Pass(name, p.name, (grid.rows, grid.cols), len(grid) if tiles is None else len(tiles),
             len(segs), (b, chans[p.output], *shapes[p.output]), stages, peak_staged, cost.working, attn,
             cost.work / full if full else 1.0, out_b, 0, peak)
    q.segment_bytes, q.lifetimes, q.hidden, q.ahead = held, lifetimes, hidden, cost.ahead
    count_into(q, cost)
    return q


def keys_values_bytes(op, shapes, chans, s: Setting, tiles: int) -> int:
    """Device bytes of a global attention's keys and values: their stores and one band of them being
    made (`attention.keys_values`), only that band when they are streamed from host memory; a CPU plan
    adds one query chunk's scores (its fused kernel holds them)."""
    src = op.src[0]
    h, w = shapes[src]
    tokens, unit = h * w, s.batch * s.item * chans[src]
    band = max(1, min(h, (s.kv_chunk or s.query_chunk) // max(w, 1))) * w
    if band < tokens or s.kv_chunk:
        made = 2 * min(band, tokens) * unit
    else:  # (one band, on a GPU plan: K and V are the stores; its input read from the host, its tokens)
        made = (1 + s.off(src)) * tokens * unit if s.gpu else 0
    if s.kv_chunk and s.gpu:
        return made
    scores = 0 if s.gpu else s.batch * op.heads * min(s.query_chunk, -(-tokens // tiles)) * tokens * 4
    return 2 * tokens * unit + made + scores


def conv_work(p: Program, shapes) -> int:
    """Multiply-adds of p's convolutions run untiled (per batch item)."""
    return sum(op.weight.shape[1] * op.weight.shape[0] * op.kernel[0] * op.kernel[1] * shapes[op.dst][0]
               * shapes[op.dst][1] for op in p.ops if op.kind == "conv")
