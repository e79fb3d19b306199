"""The plan of one pass: what one Executor run of a program over a tile grid stages, holds and dispatches
(`pass_plan`, for a `PassSpec`), and of the plain untiled run (`untiled_pass`). `make.make_plan` puts
passes together; `fast` makes fast mode's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ...locality.ops import OpKind
from ...locality.program import Program, SegmentKind
from ..devices import DeviceProfile
from ..run.segments import last_readers
from ..settings import Place
from .counts import Scope, segment_cost
from .memo import grid, query_bands, segments
from .op_costs import Cost, Setting, untiled_cost
from .records import Pass, PassKind, Stage

# Device bytes of the small tensors a segment's peak holds that the plan does not follow one by one: the
# finite checks' sums, the statistics' per-tile parts, the affines' float64 temporaries (counted: ~2 KiB
# on the narrow test VAE; a few tens of KiB at 512 channels).
SMALL_TENSORS = 64 << 10


@dataclass(frozen=True)
class PassSpec:
    """A pass to plan: what it runs (`kind`, `piece`), the program on an input of `shape` in tiles of
    `tile` reference pixels, the GroupNorms whose statistics are fixed, which tiles run (`tiles`, None:
    all) and how: `together` (fast mode's sampled tiles, op by op: working sets summed), in row bands
    (`banded`, where the setting bands), with `probes` (reference boxes whose statistics are kept: the
    low pass), on given `regions` (tile index -> boxes: the staged sampled tiles, `counts.segment_cost`),
    `streamed` (the output cores are emitted, never assembled: no output buffer, it returns nothing)."""

    kind: PassKind
    program: Program
    shape: tuple[int, ...]
    tile: int
    ref: str
    fixed: frozenset = frozenset()
    tiles: frozenset | None = None
    together: bool = False
    banded: bool = True
    probes: tuple = ()
    regions: dict | None = None
    streamed: bool = False
    piece: tuple[int, int] | None = None


def untiled_pass(p: Program, shape, s: Setting) -> Pass:
    """The plain untiled run as a pass: no staging; its peak is the live values of Program.run."""
    shapes, chans = p.shapes(tuple(shape[-2:])), p.channels()
    c = untiled_cost(p, shapes, chans, s)
    out_b = shape[0] * chans[p.output] * shapes[p.output][0] * shapes[p.output][1] * s.item
    return Pass(PassKind.UNTILED, p.name, (1, 1), 1, 1, (shape[0], chans[p.output], *shapes[p.output]), [],
                0, c.working, 0, 1.0, out_b, 0, c.working, flops=c.flops, launches=c.launches, syncs=c.syncs,
                h2d=c.h2d, d2h=c.d2h)


def pass_plan(spec: PassSpec, s: Setting, profile: DeviceProfile, full: int) -> Pass:
    """One Executor run of a `PassSpec`: staged values in allocation order, the staged peak, the per-tile
    working set (summed over its tiles when they run together), conv work (a fraction of `full`, the
    untiled program's), what it dispatches (`counts.segment_cost`), the peak on the device (a GPU plan:
    the most any segment holds, its staged values on the device and its own bytes; a CPU plan: the sum of
    those maxima), and the side-stream copies `profile` hides under compute."""
    p = spec.program
    walk = _Walk(spec, s, profile)
    for i, seg in enumerate(walk.segs):
        walk.segment(i, seg)
    on_device = walk.peak_staged if (s.run.staging is Place.DEVICE
                                     or (s.run.staging is Place.HOST and not s.gpu)) else 0
    cost = walk.cost
    peak = walk.gpu_peak if s.gpu else on_device + cost.working + walk.im2col + walk.attn + walk.out_b
    out_shape = (spec.shape[0], walk.chans[p.output], *walk.shapes[p.output])
    tiles = len(walk.grid) if spec.tiles is None else len(spec.tiles)
    return Pass(spec.kind, p.name, (walk.grid.rows, walk.grid.cols), tiles, len(walk.segs), out_shape,
                walk.stages, walk.peak_staged, cost.working, walk.attn, cost.work / full if full else 1.0,
                walk.out_b, 0, peak, flops=cost.flops, launches=cost.launches, syncs=cost.syncs, h2d=cost.h2d,
                d2h=cost.d2h, hidden=walk.hidden, ahead=cost.ahead, segment_bytes=walk.held,
                lifetimes=walk.lifetimes, readers={v: frozenset(r) for v, r in walk.readers.items()},
                piece=spec.piece)


@dataclass
class _Walk:
    """`pass_plan`'s walk over the segments: what is staged and alive, and what each segment holds."""

    spec: PassSpec
    s: Setting
    profile: DeviceProfile
    stages: list[Stage] = field(default_factory=list)
    alive: dict[str, int] = field(default_factory=dict)
    lifetimes: dict[str, tuple[int, int]] = field(default_factory=dict)
    readers: dict[str, set[int]] = field(default_factory=dict)  # staged value -> segments reading it
    held: list[int] = field(default_factory=list)  # device bytes each segment holds, staging apart
    cost: Cost = field(default_factory=Cost)
    peak_staged: int = 0
    gpu_peak: int = 0
    attn: int = 0
    kept: int = 0  # statistics and affines kept to the end of the run
    hidden: float = 0.0

    def __post_init__(self):
        spec, p = self.spec, self.spec.program
        self.shapes, self.chans = p.shapes(tuple(spec.shape[-2:])), p.channels()
        self.segs = segments(p, spec.fixed, self.s.run.attention, self.s.run.recompute)
        self.last = last_readers(self.segs, p.input)
        self.grid = grid(self.shapes[spec.ref], spec.tile)
        self.producer = {op.dst: op.name for op in p.ops}
        tracked: dict[str, set[int]] = {}  # values whose statistics an exact GroupNorm merges
        for op in p.ops:
            if op.kind is OpKind.GROUP_NORM and id(op) not in spec.fixed:
                tracked.setdefault(op.src[0], set()).add(op.groups)
        self.scope = Scope(p, self.shapes, self.chans, spec.ref, tracked, self.s)
        self.out_b = 0 if spec.streamed else self.nbytes(p.output)
        # CPU convolutions' im2col buffer: row bands of at most conv_workspace bytes (measured: a fast
        # encode at 1024 px planned at 210 MiB grew by 264 before this was counted)
        self.im2col = self.s.run.conv_workspace if any(op.kind is OpKind.CONV for op in p.ops) else 0
        self.made_out = next(i for i, seg in enumerate(self.segs) if p.output in seg.outputs)

    def nbytes(self, v: str) -> int:
        return self.spec.shape[0] * self.chans[v] * self.shapes[v][0] * self.shapes[v][1] * self.s.item

    def device_bytes(self, v: str) -> int:
        """Bytes of staged value v on the device: all of it, none, or a split value's first rows."""
        place = self.s.run.place(v)
        if place is Place.MIXED:
            return self.nbytes(v) // self.shapes[v][0] * min(self.s.run.device_rows[v], self.shapes[v][0])
        return self.nbytes(v) if place is Place.DEVICE else 0

    def segment(self, i: int, seg) -> None:
        """Segment i: its staged outputs made, what it dispatches and holds, the values it read last."""
        spec, s, b = self.spec, self.s, self.spec.shape[0]
        for v in seg.outputs:
            if v != spec.program.output and v not in seg.measured:
                shape = (b, self.chans[v], *self.shapes[v])
                self.stages.append(Stage(v, self.producer[v], shape, self.nbytes(v), s.run.place(v)))
                self.alive[v], self.lifetimes[v] = self.nbytes(v), (i, i)
        self.peak_staged = max(self.peak_staged, sum(self.alive.values()))
        for v in seg.inputs:
            if v in self.alive:
                self.readers.setdefault(v, set()).add(i)
        kv, seg_grid = 0, self.grid
        if seg.kind is SegmentKind.ATTENTION:
            kv = keys_values_bytes(seg.ops[0], self.shapes, self.chans, s, len(self.grid))
            self.attn = max(self.attn, kv)
            if s.run.query_rows and spec.tiles is None:
                seg_grid = query_bands(self.shapes[spec.ref], s.run.query_rows)
        c = segment_cost(seg, seg_grid, self.scope, spec.tiles, spec.together, spec.banded,
                         probes=list(spec.probes) or None, regions=spec.regions)
        self.cost.add(c)
        side = c.d2h_side + c.fetched - c.ahead  # (every tile's reads ahead but about the first tile's)
        self.hidden += self.profile.hidden(c.flops, c.launches, side, s.item < 4)
        out_now = self.out_b if i >= self.made_out else 0  # (the output: allocated by its own segment)
        self.kept += sum(b * (8 * self.chans[op.src[0]] + 16 * op.groups) for op in seg.ops
                         if op.kind is OpKind.GROUP_NORM and id(op) not in spec.fixed
                         and id(op) not in seg.again)
        self.held.append(c.working + c.ahead + kv + out_now + self.im2col + self.kept + SMALL_TENSORS)
        on_device = sum(self.device_bytes(v) for v in self.alive)
        self.gpu_peak = max(self.gpu_peak, self.held[-1] + on_device)
        for v in [v for v, j in self.last.items() if j == i]:
            if self.alive.pop(v, None) is not None:
                self.lifetimes[v] = (self.lifetimes[v][0], i)


def keys_values_bytes(op, shapes, chans, s: Setting, tiles: int) -> int:
    """Device bytes of a global attention's keys and values: their stores and one band of them being
    made (`attention.keys_values`), only that band when they are streamed from host memory; a CPU plan
    adds one query chunk's scores (its fused kernel holds them)."""
    src = op.src[0]
    h, w = shapes[src]
    tokens, unit = h * w, s.batch * s.item * chans[src]
    band = max(1, min(h, (s.run.kv_chunk or s.run.query_chunk) // max(w, 1))) * w
    if band < tokens or s.run.kv_chunk:
        made = 2 * min(band, tokens) * unit
    else:  # (one band, on a GPU plan: K and V are the stores; its input read from the host, its tokens)
        made = (1 + s.off(src)) * tokens * unit if s.gpu else 0
    if s.run.kv_chunk and s.gpu:
        return made
    scores = 0 if s.gpu else s.batch * op.heads * min(s.run.query_chunk, -(-tokens // tiles)) * tokens * 4
    return 2 * tokens * unit + made + scores


def conv_work(p: Program, shapes) -> int:
    """Multiply-adds of p's convolutions run untiled (per batch item)."""
    return sum(op.weight.shape[1] * op.weight.shape[0] * op.kernel[0] * op.kernel[1] * shapes[op.dst][0]
               * shapes[op.dst][1] for op in p.ops if op.kind is OpKind.CONV)
