"""The records of a TiledVAE plan: what a run will do (`Plan`), its passes (`Pass`, `PassKind`) and staged
values (`Stage`), and what the run takes from it (`Plan.choices`, a `run.options.Choices`). `make` and
`passes` build them whole, `settle` chooses among them; none is changed once built.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from ...memory import format_bytes as fb
from ...vocabulary import Vocabulary
from ..devices import DeviceProfile
from ..run.options import Choices
from ..settings import Attention, Kind, Mode, Place


class PassKind(Vocabulary):
    """What a pass of a plan runs (fast mode has several; its sampled tiles' pass staged segment by
    segment where they do not fit at once)."""

    UNTILED = "untiled"
    TILED = "tiled"
    HEAD = "exact latent-resolution head"
    LOW = "low pass"
    SAMPLED = "sampled tiles"
    SAMPLED_STAGED = "sampled tiles, staged"
    OTHER = "other tiles"
    TAIL = "exact latent-resolution tail"


@dataclass(frozen=True)
class Stage:
    """One staged full-size value of a plan."""

    value: str
    producer: str
    shape: tuple[int, ...]
    bytes: int
    where: Place


@dataclass(frozen=True)
class Pass:
    """One run over the tiles within a plan (fast mode has several)."""

    kind: PassKind
    program: str
    grid: tuple[int, int]
    tiles: int  # tiles it runs
    segments: int
    output_shape: tuple[int, ...]
    stages: list[Stage] = field(default_factory=list)
    staged_peak: int = 0
    working: int = 0  # per-tile working set (all of its tiles' when they run together)
    attention_bytes: int = 0
    work: float = 0.0  # conv multiply-adds as a fraction of the untiled program's
    output_bytes: int = 0  # what it returns (and later passes hold)
    held: int = 0  # results of earlier passes alive during it
    peak: int = 0
    flops: int = 0  # as torch.utils.flop_counter counts them (convolutions, attention)
    launches: int = 0  # kernel launches: operators that write memory (views and allocations apart)
    syncs: int = 0  # reads back to the host
    h2d: int = 0  # bytes host -> device
    d2h: int = 0  # bytes device -> host
    seconds: float = 0.0  # estimated on the plan's device profile (devices.DeviceProfile.seconds)
    hidden: float = 0.0  # ... less this: side-stream copies under their segment's compute (run/copies.py)
    ahead: int = 0  # most device bytes of a tile's inputs read while the tile before runs
    segment_bytes: list[int] = field(default_factory=list)  # device bytes each segment holds, staging apart
    lifetimes: dict[str, tuple[int, int]] = field(default_factory=dict)  # staged value -> (made, last read)
    readers: dict[str, frozenset[int]] = field(default_factory=dict)  # staged value -> segments reading it
    piece: tuple[int, int] | None = None  # fast mode in pieces: (j, n), the j-th of n

    @property
    def name(self) -> str:
        """What it runs, as the plan prints it (with its piece: "other tiles (piece 1 of 2)")."""
        return self.kind.value + (f" (piece {self.piece[0]} of {self.piece[1]})" if self.piece else "")

    def replace(self, **changes) -> Pass:
        """A copy with some figures changed."""
        return replace(self, **changes)

    def with_held(self, held: int) -> Pass:
        """This pass with `held` bytes of earlier passes' results alive during it."""
        return replace(self, held=held, peak=self.peak + held)

    def timed(self, profile: DeviceProfile, half: bool) -> Pass:
        """This pass with its estimated time on `profile`, less its side-stream copies hidden under
        compute."""
        seconds = profile.seconds(self.flops, self.launches, self.h2d + self.d2h, half) - self.hidden
        return replace(self, seconds=seconds)


@dataclass(frozen=True)
class Plan:
    """What a tiled run will do: tiles, recomputation, staged bytes and where they live, the peak, and
    what it dispatches on the device it is made for. Its `choices` are what the run follows; tile_size,
    staging, band_bytes, on_device, kv_chunk, query_rows, read_ahead, fast_cuts, low_tile, tile_batch
    and staged_estimate read them."""

    kind: Kind
    input_shape: tuple[int, ...]
    output_shape: tuple[int, ...]
    mode: Mode
    attention: Attention
    choices: Choices
    profile: DeviceProfile  # the device kind it is shaped for, and the constants of its time estimate
    grid: tuple[int, int]
    segments: int
    halo_overhead: float  # extra conv work (halos; fast mode: also its estimation passes) / untiled work
    stages: list[Stage] = field(default_factory=list)
    staged_peak: int = 0  # most staged bytes alive at once
    working: int = 0  # per-tile working set estimate (largest segment)
    attention_bytes: int = 0  # keys and values of a global attention, plus one query chunk's scores
    output_bytes: int = 0
    peak: int = 0  # estimated peak on the device (staged on the device + working + output + heap slack)
    passes: list[Pass] = field(default_factory=list)  # fast mode (sampled tiles): its passes, in order
    heap_slack: int = 0  # disk staging on the CPU: freed heap kept for reuse (within memory_budget)
    untiled: bool = False  # one tile covers the latent: the plain untiled run (exact mode's decode)
    flops: int = 0
    launches: int = 0
    syncs: int = 0
    h2d: int = 0
    d2h: int = 0
    seconds: float = 0.0
    untiled_flops: int = 0  # FLOPs of the untiled run, for the ratio
    segment_bytes: list[int] = field(default_factory=list)  # (its last pass's: see Pass)
    lifetimes: dict[str, tuple[int, int]] = field(default_factory=dict)
    readers: dict[str, frozenset[int]] = field(default_factory=dict)  # (its last pass's: see Pass)
    staging_floor: int | None = None  # exact tiled plans within a budget: `staging_floor`'s bytes
    backward: Any = None  # `plan.backward.BackwardPlan` when asked for (`TiledVAE.plan(backward=True)`)

    @property
    def device(self) -> str:
        """The device kind the plan is shaped for ("cpu", "cuda")."""
        return self.profile.kind

    @property
    def tile_size(self) -> int:
        return self.choices.tile_size

    @property
    def staging(self) -> Place:
        return self.choices.staging

    @property
    def band_bytes(self) -> int | None:
        """Local segments' big tiles in row bands of this (None: whole tiles)."""
        return self.choices.band_bytes

    @property
    def on_device(self) -> frozenset:
        """Staging "device+host": the values staged on the device."""
        return self.choices.on_device

    @property
    def kv_chunk(self) -> int:
        """Global attention's keys / values in host memory, streamed this many tokens at a time."""
        return self.choices.kv_chunk

    @property
    def query_rows(self) -> int:
        """... its queries in row bands of this many latent rows (0: in the tiles)."""
        return self.choices.query_rows

    @property
    def read_ahead(self) -> bool:
        """Host-staged inputs of the next tile read while a tile runs (GPU plans)."""
        return self.choices.read_ahead

    @property
    def fast_cuts(self) -> tuple[int, ...]:
        """Fast mode: its estimated part run in pieces cut there, the values between them held whole (a
        GPU plan's choice: halos span a piece, not the part)."""
        return self.choices.fast_cuts

    @property
    def low_tile(self) -> int:
        """Fast mode: the low pass's tile in its reference pixels (0: tile_size)."""
        return self.choices.low_tile

    @property
    def tile_batch(self) -> int:
        """Same-shape tiles of a local segment run this many at a time (1: tile by tile)."""
        return self.choices.tile_batch

    @property
    def staged_estimate(self) -> bool:
        """Fast mode: sampled tiles one at a time, staged (not all at once)."""
        return self.choices.staged_estimate

    def __str__(self) -> str:
        rows = [
            f"TiledVAE {self.kind} plan: {self.input_shape} -> {self.output_shape}, mode={self.mode}, "
            f"attention={self.attention}",
            f"  planned for: {self.device} ({self.profile.name if self.profile else 'default constants'})",
        ]
        if self.untiled:
            rows.append(f"  one tile of {self.tile_size} latent px covers the input: the plain untiled run")
        else:
            rows += [
                f"  tiles: {self.grid[0]}x{self.grid[1]} of {self.tile_size} latent px, "
                f"{self.segments} segments, "
                f"halo overhead {100 * self.halo_overhead:.1f}% extra conv work"
                + (f", row bands of ~{fb(self.band_bytes)}" if self.band_bytes else ", whole tiles")
                + (f", same-shape tiles in batches of <= {self.tile_batch}" if self.tile_batch > 1 else ""),
                f"  staging: {self.staging}, {len(self.stages)} staged values, at most "
                f"{fb(self.staged_peak)} alive at once",
            ]
        if self.device != "cpu" and self.staging in (Place.HOST, Place.MIXED) and not self.untiled:
            rows.append("    copies to the host on a side stream" + (", the next tile's inputs read while a "
                                                                     "tile runs" if self.read_ahead else ""))
        if self.choices.recompute or self.choices.low_recompute:
            n = len(self.choices.recompute) + len(self.choices.low_recompute)  # (fast: the low pass too)
            rows.append(f"    {n} GroupNorm inputs recomputed by their readers "
                        "from staged values, not staged (their makers take their statistics)")
        if self.staging_floor is not None:
            moved = self.h2d + self.d2h
            ratio = f" ({moved / self.staging_floor:.2f}x)" if self.staging_floor else ""
            own = ", of the values it stages" if self.choices.recompute else ""
            rows.append(f"    staging floor at this budget{own} {fb(self.staging_floor)} host<->device "
                        f"(what cannot stay on the device: out once, back at each segment reading it); "
                        f"this plan moves "
                        f"{fb(moved)}{ratio}")
        for s in self.stages[:6]:
            rows.append(f"    {s.producer:<40} {str(s.shape):<22} {fb(s.bytes):>10} on {s.where}")
        if len(self.stages) > 6:
            rows.append(f"    ... {len(self.stages) - 6} more")
        rows.append(f"  per-tile working set ~{fb(self.working)}, attention K/V + scores "
                    f"{fb(self.attention_bytes)}, output buffer {fb(self.output_bytes)}")
        if self.kv_chunk:
            rows.append(f"  attention keys and values in host memory, streamed {self.kv_chunk:,} tokens at a "
                        f"time (online softmax, exact); queries in "
                        + (f"row bands of {self.query_rows} latent rows" if self.query_rows else "the tiles"))
        if self.fast_cuts:
            rows.append(f"  fast mode's estimated part in {len(self.fast_cuts) + 1} pieces (halos span a "
                        "piece), the values between them held whole on the device")
        if self.low_tile:
            rows.append(f"  low pass in one tile of {self.low_tile} px (tiles' halos would cost launches)")
        if self.choices.fast_most:
            rows.append(f"  sampled tiles: at most {self.choices.fast_most} rows and columns of them (their "
                        "statistics on the device, not staged across the link)")
        if self.choices.head_tile:
            rows.append(f"  exact latent-resolution head in tiles of {self.choices.head_tile} px")
        for q in self.passes:
            rows.append(f"  pass {q.name}: {q.tiles} tiles, {q.segments} segments, {len(q.stages)} staged "
                        f"values (at most {fb(q.staged_peak)}), working ~{fb(q.working)}, "
                        f"{100 * q.work:.0f}% of the untiled conv work, returns {fb(q.output_bytes)}, "
                        f"holds {fb(q.held)}, peak ~{fb(q.peak)}")
            rows.append(f"    {q.flops / 1e9:,.1f} GFLOP, {q.launches:,} kernel launches, "
                        f"{fb(q.h2d + q.d2h)} host<->device, ~{_ms(q.seconds)}")
        if self.heap_slack:
            rows.append(f"  heap slack {fb(self.heap_slack)} (freed memory kept for reuse, disk staging)")
        ratio = f" ({self.flops / self.untiled_flops:.3f}x untiled)" if self.untiled_flops else ""
        rows.append(f"  work: {self.flops / 1e9:,.1f} GFLOP{ratio}, {self.launches:,} kernel launches, "
                    f"{self.syncs} host syncs, host->device {fb(self.h2d)}, device->host {fb(self.d2h)}")
        rows.append(f"  estimated time ~{_ms(self.seconds)} on {self.device} (FLOPs / throughput + launches "
                    f"x launch cost + transfers / link bandwidth)")
        rows.append(f"  estimated device peak {fb(self.peak)}")
        if self.backward is not None:
            rows.append(str(self.backward))
        return "\n".join(rows)


def staging_floor(budget: int, held: list[int], lifetimes: dict[str, tuple[int, int]],
                  sizes: dict[str, int], readers: dict[str, frozenset[int]] | None = None) -> int:
    """The host<->device bytes no placement of a pass's staged values avoids within `budget`: at each
    segment the values alive beyond the room beside what it holds (`held`) must be off the device.

    A byte ever off the device goes out once and comes back at least once; one off the device at a
    segment that reads it (`readers`: value -> segments) is read back there, so a byte off at k of its
    readers costs at least 1 + max(1, k). Summed over bytes, any placement moves at least
    out + max(out, reads), where out, the least bytes ever off, is a covering of the segments' excess by
    the values' lifetimes (intervals), which the greedy scan covering each segment's shortfall with the
    values alive longest solves exactly, and reads, the least bytes off at the segments reading them, is
    each segment's excess beyond what the values it does not read can take (`tests/test_counting.py`
    checks both against linear programs; out + reads where a value has no reader, whose bytes need not
    come back). Without `readers`: 2 x out (one read a byte). Segment by segment, as the plan's working
    sets are: a lower bound for runs that stage every value they are given (a plan's own staged set: one
    that recomputes some has a floor of the others)."""
    off = dict.fromkeys(sizes, 0)
    reads = 0
    for i, h in enumerate(held):
        alive = sorted((v for v, (a, z) in lifetimes.items() if a <= i <= z), key=lambda v: -lifetimes[v][1])
        excess = sum(sizes[v] for v in alive) - (budget - h)
        if readers is not None:
            reads += max(0, excess - sum(sizes[v] for v in alive if i not in readers.get(v, ())))
        short = excess - sum(off[v] for v in alive)
        for v in alive:
            if short <= 0:
                break
            more = min(sizes[v] - off[v], short)
            off[v] += more
            short -= more
    out = sum(off.values())
    if readers is None:
        return 2 * out
    return out + (max(out, reads) if all(readers.get(v) for v in sizes) else reads)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.1f} ms" if seconds < 10 else f"{seconds:,.1f} s"
