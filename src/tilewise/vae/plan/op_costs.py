"""What one op costs on a box (conv work, FLOPs as torch.utils.flop_counter counts them, kernel launches,
host<->device bytes), the kernels of the executor's pieces made of several operators, and the untiled
run's reference cost (`untiled_cost`). `counts` adds them up over a pass's segments and tiles.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from ...locality.boxes import box_area, clip_box, zero_pad
from ...locality.ops import OpKind
from ...locality.program import last_use
from ..run.options import RunOptions
from ..settings import Attention, Place
from .live import lazy_input, lazy_output, pointwise_conv, untiled_peak

# kernels of the pieces made of several operators (counted with benchmarks/counting.py)
ATTENTION_TILE = 6  # queries: to_q, scores (one fused kernel a query chunk), heads back, to_out, residual
ATTENTION_COPY = 1  # ... plus one copy when the tile's box is not contiguous in its tensor
KEYS_VALUES = 4  # to_k and to_v of one band of tokens (matmul and bias each)
KV_STORE = 2  # ... written into their stores when there are several bands (a copy each)
PROJECT_INTO = 2  # ... or projected straight into them (plain Linear layers: one addmm each)
STREAMED = 2  # streamed attention (locality.streamed_attention), once a query box: o, lse (half: a cast)
STREAMED_CHUNK = 6  # ... and per key chunk: the fused kernel, the log-sum-exp merge and the output's
MERGE = 5  # GroupStats: the tiles' moments merged (stack, two mv, deviation; float32 ones widened: 1 more)
AFFINE = 6  # a GroupNorm's per-channel affine from its statistics (once per run)
ADJUST = 5  # fast mode: sample statistics corrected by the low pass's (estimators.adjusted)
CHECK = 6  # the segment's finite check (stack, sum, isfinite), and one host sync
MOMENTS = 13  # GroupNorm moments in chunks: the fixed kernels ...
MOMENTS_CHUNK = 8  # ... and those of every chunk
WELFORD = 1  # one torch.var_mean pass (stats_chunk=0), float32 values; a half-precision copy adds one


@dataclass
class Cost:
    """What a pass (or a segment of it) dispatches; `working` is a per-tile (or per-band) maximum."""

    work: int = 0  # conv multiply-adds per batch item
    flops: int = 0
    launches: int = 0
    syncs: int = 0  # reads back to the host (finite checks)
    h2d: int = 0  # bytes host -> device
    d2h: int = 0
    working: int = 0
    d2h_side: int = 0  # ... of them copied on a side stream (host staging's stores: vae/copies.py)
    ahead: int = 0  # device bytes of the next tile's inputs, read while a tile runs (a maximum)
    fetched: int = 0  # host -> device bytes of such reads ahead, every tile's (a sum)

    def add(self, other: Cost, together: bool = False, times: int = 1) -> None:
        """Add `other` (`times` times: tiles that count alike)."""
        n = times
        self.work, self.flops = self.work + n * other.work, self.flops + n * other.flops
        self.launches, self.syncs = self.launches + n * other.launches, self.syncs + n * other.syncs
        self.h2d, self.d2h = self.h2d + n * other.h2d, self.d2h + n * other.d2h
        self.d2h_side += n * other.d2h_side
        self.ahead, self.fetched = max(self.ahead, other.ahead), self.fetched + n * other.fetched
        self.working = self.working + n * other.working if together else max(self.working, other.working)


@dataclass(frozen=True)
class Setting:
    """How a pass runs as its count sees it: the options its executor is given (`run`), on a GPU-shaped
    plan or not, for an element size and a batch."""

    run: RunOptions = field(default_factory=RunOptions)
    gpu: bool = False  # a GPU plan: staged host / disk values cross the link
    item: int = 4  # bytes per element
    batch: int = 1

    @property
    def global_attention(self) -> bool:
        return self.run.attention is Attention.GLOBAL

    def off(self, v: str) -> bool:
        """Whether staged value v lives across the link, all of it or its rows past a split (its reads and
        writes there are transfers)."""
        return self.gpu and self.run.place(v) is not Place.DEVICE

    def host_area(self, v: str, box) -> int:
        """Pixels of v's box that live across the link (a split value's: its rows past the split)."""
        if not self.off(v):
            return 0
        rows = self.run.device_rows.get(v)
        if rows is None:
            return box_area(box)
        return box_area((max(box[0], rows), box[1], box[2], box[3])) if box[1] > rows else 0

    def joins(self, v: str, box) -> bool:
        """Whether a read of v's box joins device rows to host rows (a split value's box over its split)."""
        rows = self.run.device_rows.get(v) if self.off(v) else None
        return rows is not None and box[0] < rows < box[1]

    def with_run(self, **changes) -> Setting:
        """The same count with some run options changed."""
        return replace(self, run=self.run.replace(**changes))


def op_cost(ops, i: int, box, need, shapes, chans, s: Setting, last, keep, fixed) -> Cost:
    """Work, FLOPs and launches of ops[i] on `box` (run_op; a conv in im2col row bands on a CPU plan)."""
    op = ops[i]
    cost = Cost()
    if op.kind is OpKind.CONV:
        lazy = lazy_input(ops, i, last, keep)
        whole = pointwise_conv(op) and not lazy  # (run on its whole input box: a bigger one where another
        # op reads that input on a bigger halo, a chain's value recomputed beside a shortcut)
        macs = op.weight.shape[1] * op.weight.shape[0] * op.kernel[0] * op.kernel[1] \
            * box_area(need[op.src[0]] if whole else box)
        cost.work, cost.flops = macs, 2 * macs * s.batch
        if whole:
            cost.launches = 1
            return cost
        rows = box[1] - box[0]
        per_row = (box[3] - box[2]) * op.weight.shape[1] * op.kernel[0] * op.kernel[1] * 4
        step = max(1, s.run.conv_workspace // max(per_row, 1)) if s.run.conv_workspace else rows
        step = min(step, rows)
        shape = shapes[op.src[0]]
        for y in range(box[0], box[1], step):
            part = (y, min(y + step, box[1]), box[2], box[3])
            want = op.input_boxes(part)[0]
            inner = clip_box(want, shape)
            padded = not op.pads_itself(want, inner) and any(zero_pad(want, inner)[0])
            cost.launches += 1 + padded + lazy  # conv, pad (unless the conv pads), the upsampled band
        if step < rows:
            cost.launches += -(-rows // step)  # every band copied into the one output
        return cost
    if op.kind is OpKind.RESAMPLE:
        cost.launches = 0 if lazy_output(ops, i, last, keep) else 1
    elif op.kind is OpKind.POINTWISE:
        cost.launches = op.kernels  # (the lowering says how many)
    elif op.kind is OpKind.ADD:
        cost.launches = 1 + (op.scale != 1.0)
    elif op.kind is OpKind.GROUP_NORM:
        cost.launches = 1  # GroupNorm's affine in one kernel (statistics known: executor)
    elif op.kind is OpKind.ATTENTION:
        cost.add(attention_tile(op, box, need, shapes, chans, s))
    elif op.kind is OpKind.MODULE:  # (a module placed by its measured locality: the calls it makes;
        cost.launches = op.calls  # its FLOPs are not counted)
    elif op.kind is OpKind.WHOLE:  # (a box of the output made once: `_segment_once`)
        cost.launches = 0
    else:
        cost.launches = 1
    return cost


def attention_tile(op, box, need, shapes, chans, s: Setting) -> Cost:
    """The queries of one box attending to all tokens (global) or to the box's own (tile)."""
    src = op.src[0]
    c = chans[src]
    nq = box_area(box)
    h, w = shapes[src]
    nk = h * w if s.global_attention else nq
    chunks = max(1, -(-nq // s.run.query_chunk))
    d = c // op.heads
    proj = 2 * nq * c * c * 2  # to_q and to_out
    if not s.global_attention:
        proj += 2 * nq * c * c * 2  # the box's own keys and values
    flops = s.batch * (proj + 4 * op.heads * nq * nk * d)
    launches = ATTENTION_TILE + (chunks - 1) + (chunks > 1)  # one fused kernel a chunk, then joined
    h2d = 0
    if s.run.kv_chunk and s.global_attention:  # the online softmax over key chunks, all read once per box
        launches = ATTENTION_TILE - 1 + STREAMED + (s.item < 4) + STREAMED_CHUNK * -(-nk // s.run.kv_chunk)
        h2d = 2 * s.batch * nk * c * s.item if s.gpu else 0
    if not (box[2] == 0 and box[3] == w) and box[1] - box[0] > 1:
        launches += ATTENTION_COPY
    if not s.global_attention:
        launches += KEYS_VALUES
    return Cost(flops=flops, launches=launches, h2d=h2d)


def moments(core, c: int, s: Setting) -> int:
    """Kernels of one GroupStats.add of a core with c channels (stats.moments)."""
    if s.run.stats_chunk == 0:
        return WELFORD + (s.item < 4)
    h, w = core[1] - core[0], core[3] - core[2]
    rows = max(1, min(h, s.run.stats_chunk // max(s.batch * c * w * 4, 1)))
    return MOMENTS + MOMENTS_CHUNK * -(-h // rows)


def untiled_cost(program, shapes, chans, s: Setting) -> Cost:
    """The plain untiled run (`Program.run`: what a TiledVAE does when one tile covers the latent) and
    its finite check; `working` is its peak of live values (`untiled_peak`)."""
    full = {v: (0, h, 0, w) for v, (h, w) in shapes.items()}
    last = last_use(program.ops, [program.output])
    cost = Cost()
    one = s.with_run(conv_workspace=0)
    for i, op in enumerate(program.ops):
        if op.kind is OpKind.GROUP_NORM:
            cost.launches += 1  # torch's own GroupNorm
        elif op.kind is OpKind.ATTENTION:
            q = attention_tile(op, full[op.dst], full, shapes, chans, one)
            cost.flops += q.flops + s.batch * 2 * 2 * box_area(full[op.dst]) * chans[op.src[0]] ** 2
            cost.launches += q.launches + KEYS_VALUES
        else:
            cost.add(op_cost(program.ops, i, full[op.dst], full, shapes, chans, one, last, (), set()))
    cost.launches += 5  # the finite check of the output (sum, isfinite)
    cost.syncs += 1
    cost.working = untiled_peak(program, shapes, chans, s.batch * s.item)
    return cost


def streamed(s: Setting) -> tuple[int, int] | None:
    """(key chunk, bytes per element) of streamed global attention, or None."""
    return (s.run.kv_chunk, s.item) if s.run.kv_chunk and s.global_attention else None


def stats_copy(v: str, core, chans, s: Setting, tracked) -> int:
    """Bytes a core's statistics hold while computed: a half-precision core read as float32 (one
    var_mean pass), or the float32 rows of one chunk of moments."""
    if v not in tracked:
        return 0
    n = box_area(core) * chans[v] * s.batch * 4
    if s.run.stats_chunk == 0:
        return n if s.item < 4 else 0
    return min(n, s.run.stats_chunk)
