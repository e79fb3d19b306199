"""Run a tile program over a tile grid, segment by segment, with staging on device, host or disk.

Exact mode: the program is cut at every sync op whose input is produced in the current segment. Each
segment runs per tile (serpentine order) on exactly the region it needs, read from the staged
full-size inputs, and writes the tile's core of its outputs into the next staged tensors, while the
exact per-(batch, group) statistics of every value a later GroupNorm normalises are merged over the
tile cores (float64, Chan et al. pairwise update). A global attention op is a segment of its own: keys
and values of all tokens first, then the queries of each tile in chunks. GroupNorms given fixed
statistics (fast mode) are pointwise and cut nothing, so a run of them executes tile by tile end to end.
Fast-mode statistics come from `sampled_tile_stats` (a stratified subset of the real tiles, run op by op
together; their outputs are kept and the tiled pass skips them). Disk staging stores channels-last
memmaps so the pages a tile touches are its own data.
"""

from __future__ import annotations

import logging
import mmap
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .locality.program import (
    Box,
    Op,
    Program,
    RunContext,
    Segment,
    back_propagate,
    box_empty,
    last_use,
    split_segments,
    sub_tensor,
)

logger = logging.getLogger(__name__)

STAGINGS = ("device", "host", "disk")


class NonFiniteError(FloatingPointError):
    """A NaN or inf appeared in a stage's output."""


def map_box(box: Box, ref: tuple[int, int], shape: tuple[int, int]) -> Box:
    """Map a box on the reference grid to a value of another resolution (floor of the scaled edges)."""
    y0, y1, x0, x1 = box
    return y0 * shape[0] // ref[0], y1 * shape[0] // ref[0], x0 * shape[1] // ref[1], x1 * shape[1] // ref[1]


def _trim_heap() -> None:
    """Return freed heap memory to the OS (glibc malloc_trim): tile-sized buffers otherwise stay resident."""
    global _LIBC
    if _LIBC is None:
        import ctypes
        import ctypes.util

        try:
            _LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            _LIBC.malloc_trim.argtypes = [ctypes.c_size_t]
        except (OSError, AttributeError):
            _LIBC = False
    if _LIBC:
        _LIBC.malloc_trim(0)


_LIBC = None


class GroupStats:
    """Exact per-(batch, group) mean and variance merged over disjoint tiles (Chan et al. 1979)."""

    def __init__(self, groups: int):
        self.groups = groups
        self.n = 0
        self.mean = None
        self.m2 = None

    def add(self, x) -> None:
        """Merge the statistics of tile x (B, C, h, w): shifted two-pass moments, then the Chan update."""
        nb = x[0].numel() // self.groups
        if nb == 0:
            return
        mb, m2b = _moments(x.detach(), self.groups)
        if self.mean is None:
            self.n, self.mean, self.m2 = nb, mb, m2b
            return
        n = self.n + nb
        delta = mb - self.mean
        self.mean = self.mean + delta * (nb / n)
        self.m2 = self.m2 + m2b + delta.square() * (self.n * nb / n)
        self.n = n

    def result(self):
        """(mean, biased variance) as float64 (B, groups) tensors, as torch's GroupNorm uses."""
        return self.mean, self.m2 / self.n


def _moments(x, groups: int, chunk: int = 1 << 20):
    """Per-(batch, group) mean and sum of squared deviations of x (B, C, h, w) as float64, in two passes:
    per-channel cascade sums of x, then of (x - m)^2 shifted by the float32 group mean m, a band of rows
    at a time through one buffer in x's memory layout (NCHW or channels-last, read without a copy).

    torch.var_mean's Welford reduction is scalar on CPU (~10x slower than these vectorised sums) and a
    whole-tile temporary costs page faults; the shift keeps float32 sums accurate (no E[x^2] - E[x]^2).
    """
    import torch

    b, c, h, w = x.shape
    cg = c // groups
    n = cg * h * w
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    m = x.sum((2, 3), dtype=acc).view(b, groups, cg).sum(-1) / n  # (B, G)
    mc = m.repeat_interleave(cg, dim=1).view(b, c, 1, 1)
    rows = max(1, min(h, chunk // max(b * c * w * 4, 1)))
    fmt = torch.channels_last if x.dim() == 4 and not x.is_contiguous() and x.is_contiguous(
        memory_format=torch.channels_last) else torch.contiguous_format
    buf = torch.empty((b, c, rows, w), dtype=acc, device=x.device, memory_format=fmt)
    s1 = s2 = 0
    for y in range(0, h, rows):
        xs = x[:, :, y : y + rows]
        d = torch.sub(xs, mc, out=buf[:, :, : xs.shape[2]])
        s1 = s1 + d.sum((2, 3)).to(torch.float64)
        s2 = s2 + d.square_().sum((2, 3)).to(torch.float64)
    s1, s2 = s1.view(b, groups, cg).sum(-1), s2.view(b, groups, cg).sum(-1)
    return m.to(torch.float64) + s1 / n, s2 - s1.square() / n


class Staging:
    """Full-size tensors between segments, held on the device, in host memory or in disk files."""

    def __init__(self, where: str, device, directory: str | None = None):
        if where not in STAGINGS:
            raise ValueError(f"staging must be one of {STAGINGS}, got {where!r}")
        self.where, self.device = where, device
        self.dir = None
        if where == "disk":
            self.dir = tempfile.TemporaryDirectory(prefix="tilewise-stage-", dir=directory)
        self.tensors: dict[str, Any] = {}
        self.maps: dict[str, Any] = {}

    def alloc(self, name: str, shape: tuple[int, ...], dtype) -> None:
        """Allocate a staged tensor."""
        import numpy as np
        import torch

        if self.where == "device":
            self.tensors[name] = torch.empty(shape, dtype=dtype, device=self.device)
        elif self.where == "host":
            pin = torch.device(self.device).type == "cuda"
            self.tensors[name] = torch.empty(shape, dtype=dtype, pin_memory=pin)
        else:
            size = torch.empty((), dtype=dtype).element_size()
            path = os.path.join(self.dir.name, f"{name.replace('/', '_')}.bin")
            # channels-last on disk: a tile's box is one contiguous run per row, so the pages a tile
            # touches (resident until release_pages) hold its own data, not whole image rows per channel
            last = (*shape[:-3], *shape[-2:], shape[-3]) if len(shape) >= 3 else shape
            arr = np.memmap(path, dtype={1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}[size],
                            mode="w+", shape=last)
            self.maps[name] = arr
            t = torch.from_numpy(arr).view(dtype)
            self.tensors[name] = t.movedim(-1, -3) if len(shape) >= 3 else t

    def put(self, name: str, tensor) -> None:
        """Stage an existing full tensor (the program input) without copying."""
        self.tensors[name] = tensor

    def read(self, name: str, box: Box):
        """The box of a staged tensor, on the device."""
        y0, y1, x0, x1 = box
        t = self.tensors[name][..., y0:y1, x0:x1]
        if name in self.maps:  # a private copy (the mapped pages can be dropped) in the file's layout:
            import torch  # channels-last rows copy at memory speed, a transpose to NCHW cost ~2x more

            t = t.contiguous(memory_format=torch.channels_last) if t.dim() == 4 else t.contiguous()
            self._drop(name)
        return t.to(self.device, non_blocking=True)

    def write(self, name: str, box: Box, value) -> None:
        """Write value into the box of a staged tensor."""
        y0, y1, x0, x1 = box
        self.tensors[name][..., y0:y1, x0:x1].copy_(value, non_blocking=True)
        if name in self.maps:
            self._drop(name)

    def _drop(self, name: str) -> None:
        """Unmap the pages of one disk-staged tensor that a read or write touched (the data stays in the
        page cache): a tile holds its private copies, not those pages too."""
        mm = getattr(self.maps[name], "_mmap", None)
        if mm is not None:
            mm.madvise(mmap.MADV_DONTNEED)

    def release_pages(self) -> None:
        """Disk staging: drop mapped pages from this process's memory (MADV_DONTNEED on a shared file
        mapping keeps written data in the page cache, where the kernel writes it back: no msync wait)."""
        for arr in self.maps.values():
            mm = getattr(arr, "_mmap", None)
            if mm is not None:
                mm.madvise(mmap.MADV_DONTNEED)

    def free(self, name: str) -> None:
        """Drop a staged tensor (and its file)."""
        self.tensors.pop(name, None)
        arr = self.maps.pop(name, None)
        if arr is not None:
            path = arr.filename
            del arr
            os.unlink(path)

    def close(self) -> None:
        """Free everything."""
        for name in list(self.tensors):
            self.free(name)
        if self.dir is not None:
            self.dir.cleanup()


@dataclass
class ExecContext(RunContext):
    """RunContext of the executor: GroupNorm statistics are looked up, never computed on a tile."""

    def group_stats(self, op, x, box, shape):
        stats = self.stats.get(id(op))
        if stats is None:
            raise AssertionError(f"statistics of {op.name} are not ready: a segment cut is missing")
        return stats


@dataclass
class Executor:
    """Runs a program over a tile grid on a reference value (the latent), segment by segment."""

    program: Program
    tile_size: int
    ref: str  # the value whose pixels tile_size counts (decoder input / encoder output latent)
    attention: str = "global"
    staging: str = "device"
    device: Any = "cpu"
    fixed_stats: dict[int, Any] = field(default_factory=dict)  # id(GroupNorm op) -> (mean, var)
    query_chunk: int = 4096
    progress: bool = True
    check_finite: bool = True
    stage_dir: str | None = None
    conv_workspace: int = 32 << 20  # convs on bigger tiles run in row bands (bounds CPU im2col buffers)
    done: dict[int, Any] = field(default_factory=dict)  # tile index -> its output core, computed already
    probes: list[Box] = field(default_factory=list)  # reference-grid boxes whose own statistics are kept
    probe_stats: dict[tuple[str, int], Any] = field(default_factory=dict)  # (value, groups) -> GroupStats
    last_stats: dict[int, Any] = field(default_factory=dict)  # id(GroupNorm) -> (mean, var) of the last run

    def is_global(self, op: Op) -> bool:
        """Barrier ops: GroupNorms without fixed statistics, and attention when global."""
        if op.kind == "group_norm":
            return id(op) not in self.fixed_stats
        if op.kind == "attention":
            return self.attention == "global"
        return op.sync

    def segments(self) -> list[Segment]:
        """The program cut at its barriers."""
        return split_segments(self.program, self.is_global)

    def run(self, x, emit: Callable | None = None):
        """Run on x (B, C, H, W); returns the output tensor, or streams its tile cores to emit(box, value)."""
        import torch

        shapes = self.program.shapes(tuple(x.shape[-2:]))
        self._shapes = shapes
        chans = self.program.channels()
        segs = self.segments()
        ctx = ExecContext(stats=dict(self.fixed_stats), query_chunk=self.query_chunk,
                          conv_workspace=self.conv_workspace)
        trackers = self._trackers(segs)
        stage = Staging(self.staging, self.device, self.stage_dir)
        out = None
        try:
            stage.put(self.program.input, x)
            self._finish_stats(ctx, trackers, self.program.input, x)
            last = self._last_reader(segs)
            bar = self._bar(len(segs) * len(self._grid(shapes)))
            for i, seg in enumerate(segs):
                for v in seg.outputs:
                    if v == self.program.output:
                        if emit is None:
                            size = (x.shape[0], chans[v], *shapes[v])
                            out = torch.empty(size, dtype=x.dtype, device=x.device)
                    else:
                        stage.alloc(v, (x.shape[0], chans[v], *shapes[v]), x.dtype)
                if seg.kind == "attention":
                    self._prepare_attention(seg, stage, shapes, ctx)
                self._run_segment(seg, stage, shapes, ctx, trackers, out, emit, bar)
                for v in seg.outputs:
                    if v in trackers:
                        self._finish_stats(ctx, trackers, v, None)
                ctx.kv.clear()
                for v in [v for v, j in last.items() if j == i]:
                    stage.free(v)
            bar.close()
        finally:
            stage.close()
        self.last_stats = ctx.stats
        return out

    # -- pieces ----------------------------------------------------------------------------------

    def _grid(self, shapes):
        from .geometry import TileGrid

        h, w = shapes[self.ref]
        return TileGrid(h, w, (min(self.tile_size, h), min(self.tile_size, w)), order="serpentine")

    def _bar(self, total: int):
        from tqdm.auto import tqdm

        return tqdm(total=total, desc="tiles", unit="tile", disable=not self.progress, leave=False)

    def _trackers(self, segs: list[Segment]) -> dict[str, dict[int, GroupStats]]:
        """Values whose statistics a later exact GroupNorm needs: value -> groups -> accumulator."""
        out: dict[str, dict[int, GroupStats]] = {}
        for seg in segs:
            for op in seg.ops:
                if op.kind == "group_norm" and id(op) not in self.fixed_stats:
                    out.setdefault(op.src[0], {})[op.groups] = GroupStats(op.groups)
        return out

    def _finish_stats(self, ctx, trackers, value: str, full) -> None:
        """Publish the merged statistics of value to every exact GroupNorm reading it."""
        if value not in trackers:
            return
        for g, acc in trackers[value].items():
            if full is not None:
                acc.add(full)
            for op in self.program.ops:
                if op.kind == "group_norm" and op.src[0] == value and op.groups == g:
                    if id(op) not in self.fixed_stats:
                        ctx.stats[id(op)] = acc.result()

    def _last_reader(self, segs: list[Segment]) -> dict[str, int]:
        """Index of the last segment reading each staged value."""
        last: dict[str, int] = {}
        for i, seg in enumerate(segs):
            for v in seg.inputs:
                last[v] = i
        last.pop(self.program.input, None)
        return last

    def _prepare_attention(self, seg: Segment, stage: Staging, shapes, ctx) -> None:
        """Keys and values of every token, computed band by band from the staged normalised input."""
        import torch

        op = seg.ops[0]
        n_name = op.src[0]
        h, w = shapes[n_name]
        band = max(1, min(h, self.query_chunk // max(w, 1)))
        ks, vs = [], []
        for y0 in range(0, h, band):
            k, v = op.keys_values(stage.read(n_name, (y0, min(h, y0 + band), 0, w)))
            ks.append(k)
            vs.append(v)
        ctx.kv[id(op)] = (torch.cat(ks, dim=2), torch.cat(vs, dim=2))

    def _run_segment(self, seg, stage, shapes, ctx, trackers, out, emit, bar) -> None:
        """Every tile of the grid: read the needed regions, run the ops, write the cores."""
        ref = shapes[self.ref]
        last = last_use(seg.ops, seg.outputs)
        for tile in self._grid(shapes):
            cores = {v: map_box(tile.core, ref, shapes[v]) for v in seg.outputs}
            cores = {v: b for v, b in cores.items() if not box_empty(b)}
            if cores and tile.index in self.done and list(cores) == [self.program.output]:
                vals = {self.program.output: (self.done[tile.index], cores[self.program.output])}
                for v, core in cores.items():
                    self._store(v, core, vals, stage, trackers, out, emit, seg)
            elif cores:
                vals = self._run_tile(seg, stage, shapes, ctx, cores, last)
                for v, core in cores.items():
                    self._store(v, core, vals, stage, trackers, out, emit, seg)
            vals = None  # this tile's values die now, not while the next tile runs
            if stage.where == "disk":  # the memory-bounded staging: nothing of this tile stays resident
                stage.release_pages()
                _trim_heap()  # (not per tile otherwise: re-faulting the freed heap cost ~7% of a decode)
            bar.update(1)

    def _run_tile(self, seg, stage, shapes, ctx, cores, last) -> dict[str, Any]:
        """The segment's ops on one tile, each on the box it needs (back-propagated from the cores)."""
        need = back_propagate(seg.ops, cores, shapes)
        vals = {v: (stage.read(v, need[v]), need[v]) for v in seg.inputs if v in need}
        for i, op in enumerate(seg.ops):
            if op.dst not in need:
                continue
            ins = [vals[s][0] for s in op.src]
            have = [vals[s][1] for s in op.src]
            vals[op.dst] = (op.run(ctx, ins, have, need[op.dst], [shapes[s] for s in op.src]), need[op.dst])
            for s in op.src:
                if last.get(s) == i and s not in cores:
                    del vals[s]
        return vals

    def _store(self, v, core, vals, stage, trackers, out, emit, seg) -> None:
        """Write the core of value v to its staged tensor (or the output), merging its statistics."""
        t, have = vals[v]
        c = sub_tensor(t, have, core)
        if self.check_finite and not _all_finite(c):
            producer = next((op.name for op in seg.ops if op.dst == v), v)
            raise NonFiniteError(
                f"NaN or inf in the output of {producer!r} (dtype {c.dtype}); in float16 this is the known "
                "SD-VAE overflow: run the VAE in float32 (vae.to(torch.float32)) or use an fp16-fixed VAE")
        for acc in trackers.get(v, {}).values():
            acc.add(c)
        for pb in self.probes if v in trackers else ():
            b = map_box(pb, self._shapes[self.ref], self._shapes[v])
            b = (max(b[0], core[0]), min(b[1], core[1]), max(b[2], core[2]), min(b[3], core[3]))
            if not box_empty(b):
                for g in trackers[v]:
                    self.probe_stats.setdefault((v, g), GroupStats(g)).add(sub_tensor(t, have, b))
        if v == self.program.output:
            if emit is not None:
                emit(core, c)
            else:
                y0, y1, x0, x1 = core
                out[..., y0:y1, x0:x1] = c
        else:
            stage.write(v, core, c)


def _all_finite(c) -> bool:
    """True when c has no NaN or inf: a finite sum proves it (one vectorised pass), else check each value."""
    import torch

    s = c.sum(dtype=torch.float32) if c.dtype in (torch.float16, torch.bfloat16) else c.sum()
    return bool(s.isfinite()) or bool(c.isfinite().all())


@dataclass
class _PooledContext(RunContext):
    """Estimation pass over a batch of k crops: GroupNorm statistics pooled over the crop interiors."""

    k: int = 1
    interiors: list[Box] = field(default_factory=list)  # per crop, in crop-local reference pixels
    crop: tuple[int, int] = (1, 1)
    record: dict[int, Any] = field(default_factory=dict)

    def group_stats(self, op, x, box, shape):
        b = x.shape[0] // self.k
        acc = GroupStats(op.groups)
        for i, inner in enumerate(self.interiors):
            acc.add(sub_tensor(x[i * b : (i + 1) * b], box, map_box(inner, self.crop, shape)))
        mean, var = acc.result()
        self.record[id(op)] = (mean, var)
        return mean.repeat(self.k, 1), var.repeat(self.k, 1)


def _crop_starts(n: int, c: int, k: int) -> list[int]:
    """k crops of size c spread over n pixels: stratified centres (i + 1/2) n / k."""
    return sorted({min(max(0, round((i + 0.5) * n / k - c / 2)), n - c) for i in range(k)})


def estimate_stats(program: Program, x, ref: str, crop: int, fixed: set[int], sample: float = 0.25,
                   min_per_axis: int = 2):
    """Fast-mode GroupNorm statistics from stratified crops of the real input, pooled over crop interiors.

    Crops of `crop` reference pixels are cut at stratified positions (at least `min_per_axis` per axis
    where they fit) covering about `sample` of the area, run as one batch in which every GroupNorm
    uses statistics pooled over all crops, excluding a quarter-crop margin on sides that are not the
    image border (where the crop's zero padding distorts values).
    Returns id(op) -> (mean, var) for the GroupNorm ops in `fixed`.
    """
    import torch

    shapes = program.shapes(tuple(x.shape[-2:]))
    rh, rw = shapes[ref]
    ch, cw = min(rh, crop), min(rw, crop)
    ky = max(min(min_per_axis, -(-rh // ch)), round(rh / ch * sample**0.5), 1)
    kx = max(min(min_per_axis, -(-rw // cw)), round(rw / cw * sample**0.5), 1)
    boxes = [(y, y + ch, x0, x0 + cw) for y in _crop_starts(rh, ch, ky) for x0 in _crop_starts(rw, cw, kx)]
    my, mx = ch // 4, cw // 4
    interiors = [(0 if b[0] == 0 else my, ch - (0 if b[1] == rh else my),
                  0 if b[2] == 0 else mx, cw - (0 if b[3] == rw else mx)) for b in boxes]
    ins = [map_box(b, (rh, rw), shapes[program.input]) for b in boxes]
    batch = torch.cat([x[..., b[0] : b[1], b[2] : b[3]] for b in ins])
    upto = max(i for i, op in enumerate(program.ops) if id(op) in fixed)
    head = Program(ops=program.ops[: upto + 1], input=program.input, output=program.ops[upto].dst,
                   in_channels=program.in_channels, name=program.name)
    ctx = _PooledContext(k=len(boxes), interiors=interiors, crop=(ch, cw))
    head.run(batch, ctx)
    logger.info("fast mode: statistics of %d GroupNorms from %d crops of %dx%d",
                len(fixed), len(boxes), ch, cw)
    return {i: s for i, s in ctx.record.items() if i in fixed}


def sample_tiles(grid, fraction: float) -> list:
    """Stratified subset of a tile grid: about `fraction` of the rows times the columns, evenly spread."""
    ky = max(1, min(grid.rows, round(grid.rows * fraction**0.5)))
    kx = max(1, min(grid.cols, round(grid.cols * fraction**0.5)))
    rows = {int((i + 0.5) * grid.rows / ky) for i in range(ky)}
    cols = {int((i + 0.5) * grid.cols / kx) for i in range(kx)}
    return [t for t in grid.tiles if t.row in rows and t.col in cols]


def sampled_tile_stats(program: Program, x, ref: str, tiles: list, fixed: set[int], query_chunk: int = 4096,
                       conv_workspace: int = 32 << 20, adjust: dict[int, Any] | None = None):
    """Fast-mode statistics from a sample of the real tiles, run layer-synchronously (no crop padding).

    Each sampled tile runs on exactly the regions its core needs (back-propagated through the whole
    program, zero padding only at the image border), so every value it computes is the one the tiled
    run computes with the same statistics. All sampled tiles advance op by op together; at each
    GroupNorm in `fixed` the statistics are merged (Chan) over the regions the sampled tiles hold, then
    applied. Returns (id(op) -> (mean, var), tile index -> output core): the sampled tiles' outputs are
    final, so the tiled pass skips them. Memory: the sampled tiles' working sets at once.
    """
    shapes = program.shapes(tuple(x.shape[-2:]))
    out_v = program.output
    needs = [back_propagate(program.ops, {out_v: map_box(t.core, shapes[ref], shapes[out_v])}, shapes)
             for t in tiles]
    vals = []
    for need in needs:
        y0, y1, x0, x1 = need[program.input]
        vals.append({program.input: x[..., y0:y1, x0:x1]})
    ctx = RunContext(query_chunk=query_chunk, conv_workspace=conv_workspace)
    last = last_use(program.ops, [out_v])
    for i, op in enumerate(program.ops):
        if op.kind == "group_norm" and id(op) in fixed:
            acc = GroupStats(op.groups)
            for t, need, v in zip(tiles, needs, vals, strict=True):
                core = map_box(t.core, shapes[ref], shapes[op.dst])
                if op.dst in need and not box_empty(core):
                    acc.add(sub_tensor(v[op.src[0]], need[op.src[0]], core))
            ctx.stats[id(op)] = _adjusted(acc.result(), (adjust or {}).get(id(op)))
        for need, v in zip(needs, vals, strict=True):
            if op.dst not in need:
                continue
            ins = [v[s] for s in op.src]
            v[op.dst] = op.run(ctx, ins, [need[s] for s in op.src], need[op.dst], [shapes[s] for s in op.src])
            for s in op.src:
                if last.get(s) == i:
                    del v[s]
    done = {t.index: v[out_v] for t, v in zip(tiles, vals, strict=True)}
    logger.info("fast mode: statistics of %d GroupNorms from %d of the tiles", len(fixed), len(tiles))
    return {i: s for i, s in ctx.stats.items() if i in fixed}, done


def _adjusted(sample, low):
    """Difference / ratio estimator: sample statistics moved by (global - sample) of a cheap full pass.

    low = ((mean, var) over the whole image, (mean, var) over the sampled regions) of the low-resolution
    pass: mean = m_s + (M_low - m_low), var = v_s * V_low / v_low.
    """
    if low is None:
        return sample
    (mg, vg), (ms, vs) = low
    return sample[0] + (mg - ms), sample[1] * vg / vs.clamp_min(1e-12)
