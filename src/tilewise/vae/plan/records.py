"""The records of a TiledVAE plan: what a run will do (`Plan`), its passes and staged values, and what
the run takes from it (`Choices`); `plan` makes them, `settle` chooses among them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from .devices import DeviceProfile


class Choices(NamedTuple):
    """What a plan settles beyond tile and staging, as the run takes it (`Plan.choices`)."""

    band_bytes: int | None = None  # exact segments' big tiles in row bands of this
    on_device: frozenset = frozenset()  # "device+host": the values staged on the device
    staged_estimate: bool = False  # fast mode: sampled tiles staged segment by segment
    attention: tuple[int, int] = (0, 0)  # (kv_chunk, query_rows): streamed global attention
    read_ahead: bool = True  # host staging reads the next tile's inputs while a tile runs (copies.py)
    fast_cuts: tuple[int, ...] = ()  # fast mode: its estimated part in pieces cut there (fast.piece_cuts)
    low_tile: int = 0  # fast mode: the low pass's tile (0: the run's tile)


@dataclass
class Stage:
    """One staged full-size value of a plan."""

    value: str
    producer: str
    shape: tuple[int, ...]
    bytes: int
    where: str


@dataclass
class Pass:
    """One run over the tiles within a plan (fast mode has several)."""

    name: str
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
    hidden: float = 0.0  # ... less this: side-stream copies under their segment's compute (vae/copies.py)
    ahead: int = 0  # most device bytes of a tile's inputs read while the tile before runs
    segment_bytes: list[int] = field(default_factory=list)  # device bytes each segment holds, staging apart
    lifetimes: dict[str, tuple[int, int]] = field(default_factory=dict)  # staged value -> (made, last read)


@dataclass
class Plan:
    """What a tiled run will do: tiles, recomputation, staged bytes and where they live, the peak, and
    what it dispatches on the device it is made for."""

    kind: str
    input_shape: tuple[int, ...]
    output_shape: tuple[int, ...]
    tile_size: int
    grid: tuple[int, int]
    mode: str
    attention: str
    staging: str
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
    device: str = "cpu"  # the device kind it is shaped for
    profile: DeviceProfile | None = None  # ... and the constants of its time estimate
    band_bytes: int | None = None  # local segments' big tiles in row bands of this (None: whole tiles)
    untiled: bool = False  # one tile covers the latent: the plain untiled run (exact mode's decode)
    flops: int = 0
    launches: int = 0
    syncs: int = 0
    h2d: int = 0
    d2h: int = 0
    seconds: float = 0.0
    untiled_flops: int = 0  # FLOPs of the untiled run, for the ratio
    on_device: frozenset = frozenset()  # staging "device+host": the values staged on the device
    staged_estimate: bool = False  # fast mode: sampled tiles one at a time, staged (not all at once)
    segment_bytes: list[int] = field(default_factory=list)  # (its last pass's: see Pass)
    lifetimes: dict[str, tuple[int, int]] = field(default_factory=dict)
    kv_chunk: int = 0  # global attention's keys / values in host memory, streamed this many tokens a time
    query_rows: int = 0  # ... its queries in row bands of this many latent rows (0: in the tiles)
    read_ahead: bool = True  # host-staged inputs of the next tile read while a tile runs (GPU plans)
    fast_cuts: tuple[int, ...] = ()  # fast mode: its estimated part run in pieces cut there, the values
    # between them held whole (a GPU plan's choice: halos span a piece, not the part)
    low_tile: int = 0  # fast mode: the low pass's tile in its reference pixels (0: tile_size)

    def choices(self) -> Choices:
        """What the run takes from this plan beyond tile and staging."""
        return Choices(self.band_bytes, self.on_device, self.staged_estimate,
                       (self.kv_chunk, self.query_rows), self.read_ahead, self.fast_cuts, self.low_tile)

    def __str__(self) -> str:
        from ..memory import format_bytes as fb

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
                + (f", row bands of ~{fb(self.band_bytes)}" if self.band_bytes else ", whole tiles"),
                f"  staging: {self.staging}, {len(self.stages)} staged values, at most "
                f"{fb(self.staged_peak)} alive at once",
            ]
        if self.device != "cpu" and self.staging in ("host", "device+host") and not self.untiled:
            rows.append("    copies to the host on a side stream" + (", the next tile's inputs read while a "
                                                                     "tile runs" if self.read_ahead else ""))
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
        return "\n".join(rows)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.1f} ms" if seconds < 10 else f"{seconds:,.1f} s"
