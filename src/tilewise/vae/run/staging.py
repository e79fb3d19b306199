"""Where full-size values live between segments: on the device, in host memory, or in disk files; and
which of those a plan may choose (`candidates`, `admits`).

Disk staging stores channels-last files read and written with positional I/O (one contiguous run per row
of a tile's box), so staged data lives in the kernel's page cache and never in this process's resident
memory. Being the memory-bounded staging, it also returns freed heap to the OS (glibc `malloc_trim`) once
more than its heap slack is free: tile-sized buffers otherwise stay resident after they die.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import math
import os
import tempfile
from typing import Any

import torch

from ...geometry import Box
from ..settings import Place
from . import copies

STAGINGS = ("device", "host", "disk")

# Disk staging (the memory-bounded staging) returns freed heap to the OS once this much of it is free, checked
# after every op and tile: the default heap slack (TiledVAE lowers it to fit a memory_budget). Freed pages
# that stay resident are reused without a page fault; trimming earlier bounds the resident set tighter but
# re-faults them. Measured in-process at 1024 px (SD-architecture VAE, CPU, fast mode, disk staging), time /
# peak RSS growth: decode 96 MiB 158 s / 259 MiB, 192 MiB 155 s / 321, 288 MiB 148 s / 409, never
# 145 s / 556; encode (disk reads overwritten in place) 128 MiB 79 s / 265, 192 MiB 76 s / 354, 256 MiB
# 71 s / 431.
TRIM_FREE = 192 << 20

_LIBC = None
_MALLINFO2 = None
_FLOOR = 0  # the heap's free bytes after the last trim, lowered as they are reused (trim_heap)


def trim_heap(min_free: int = 0) -> None:
    """Return freed heap memory to the OS (glibc malloc_trim): tile-sized buffers otherwise stay resident.

    With min_free, only once at least that many bytes were freed since the last trim (glibc mallinfo2:
    the free bytes above their lowest since then): freed pages that are reused soon cost a page fault each
    after a trim, so the per-op trims of disk staging act only once fragmentation has grown. The free bytes
    a trim leaves (pages returned to the OS still count as free) are the floor: without it a fragmented
    heap, a long-lived process's, trimmed on every op, each trim walking the whole heap (measured: 1.2 GB
    of scattered free chunks, 123 ms a trim, 3,326 trims of two small disk-staged runs 409 s)."""
    global _LIBC, _MALLINFO2, _FLOOR
    if _LIBC is None:
        try:
            _LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            _LIBC.malloc_trim.argtypes = [ctypes.c_size_t]
        except (OSError, AttributeError):
            _LIBC = False
        try:
            _MALLINFO2 = _LIBC.mallinfo2
            _MALLINFO2.restype = _mallinfo2_struct()
        except AttributeError:  # not glibc >= 2.33: trim unconditionally
            _MALLINFO2 = None
    if not _LIBC:
        return
    if min_free and _MALLINFO2 is not None:
        free = _MALLINFO2().fordblks
        _FLOOR = min(_FLOOR, free)
        if free - _FLOOR < min_free:
            return
    _LIBC.malloc_trim(0)
    if _MALLINFO2 is not None:
        _FLOOR = _MALLINFO2().fordblks


def _mallinfo2_struct():
    names = ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
             "keepcost")

    class MallInfo2(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in names]

    return MallInfo2


WRITE_CHUNK = 8 << 20  # bytes of a disk write's channels-last copy at a time


def rows_per_write(row_bytes: int) -> int:
    """Rows of a box a disk write copies channels-last at a time (WRITE_CHUNK bytes, at least one row of
    `row_bytes`: every sample's, every frame's)."""
    return max(1, WRITE_CHUNK // max(1, row_bytes))


class DiskValue:
    """One staged value in a file, channels-last: a (B, C, H, W) value as (B, H, W, C), a video's (B, C, T, H,
    W) as (B, T, H, W, C), so a box is one contiguous run per (sample, frame) and row.

    Read and written with positional I/O (os.preadv / os.pwritev): the data lives in the page cache, the
    kernel writes it back when it likes, and nothing of it is mapped into this process (a mapped file's
    touched pages count as resident and, on current kernels, come in folios much larger than a tile's
    row run: a 64 MiB tile box mapped ~230 MiB of resident pages).
    """

    def __init__(self, path: str, shape: tuple[int, ...], dtype):
        self.path, self.shape, self.dtype = path, tuple(shape), dtype
        self.itemsize = torch.empty((), dtype=dtype).element_size()
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        os.ftruncate(self.fd, self.nbytes())  # sparse: unwritten parts read as zeros

    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize

    def _planes(self) -> int:
        """The (sample, frame) planes of the value: B, or B T of a video."""
        return self.shape[0] * math.prod(self.shape[2:-2])

    def _runs(self, y0: int, y1: int, x0: int, x1: int):
        """(plane, row of the box, byte offset) of each row run of a box."""
        c, h, w = self.shape[1], self.shape[-2], self.shape[-1]
        for i in range(self._planes()):
            for y in range(y0, y1):
                yield i, y - y0, ((i * h + y) * w + x0) * c * self.itemsize

    def read(self, y0: int, y1: int, x0: int, x1: int):
        """The box as a new (B, C, [T,] h, w) tensor in channels-last memory."""
        b, c, *mid = self.shape[:-2]
        out = torch.empty((b, *mid, y1 - y0, x1 - x0, c), dtype=self.dtype)
        raw = out.view(torch.uint8).numpy().reshape(self._planes(), y1 - y0, -1)
        want = (x1 - x0) * c * self.itemsize
        for i, r, off in self._runs(y0, y1, x0, x1):
            if want and os.preadv(self.fd, [raw[i, r]], off) != want:
                raise OSError(f"short read from the staging file {self.path}")
        return out.permute(0, out.ndim - 1, *range(1, out.ndim - 1))

    def write(self, y0: int, y1: int, x0: int, x1: int, value) -> None:
        """Write a (B, C, [T,] h, w) tensor into the box, a few rows at a time (`rows_per_write`)."""
        c = self.shape[1]
        want = (x1 - x0) * c * self.itemsize
        step = rows_per_write(self._planes() * want)
        for r0 in range(0, y1 - y0, step):
            part = value[..., r0 : r0 + step, :].detach().to("cpu", self.dtype)
            rows = part.shape[-2]
            last = part.permute(0, *range(2, part.ndim), 1).contiguous()
            raw = last.view(torch.uint8).numpy().reshape(self._planes(), rows, -1)
            for i, r, off in self._runs(y0 + r0, y0 + r0 + rows, x0, x1):
                if want and os.pwritev(self.fd, [raw[i, r]], off) != want:
                    raise OSError(f"short write to the staging file {self.path} (disk full?)")

    def close(self) -> None:
        os.close(self.fd)
        os.unlink(self.path)


class SplitValue:
    """One staged value held split at a row: rows [0, rows) on the device (`top`), the rest in host memory
    (`bottom`, pinned on CUDA). A box is read and written on both where it straddles the split row: its
    device rows a view, its host rows copied across (a straddling read joins the two, one `cat`)."""

    def __init__(self, shape: tuple[int, ...], dtype, device, rows: int):
        h = shape[-2]
        if not 0 <= rows <= h:
            raise ValueError(f"a split value of {h} rows keeps 0 to {h} of them on the device, got {rows}")
        self.shape, self.dtype, self.rows = tuple(shape), dtype, rows
        pin = torch.device(device).type == "cuda"
        self.top = torch.empty((*shape[:-2], rows, shape[-1]), dtype=dtype, device=device)
        self.bottom = torch.empty((*shape[:-2], h - rows, shape[-1]), dtype=dtype, pin_memory=pin)

    def host_box(self, box: Box) -> Box | None:
        """The part of a box in host memory, in the value's rows (None: all of it on the device)."""
        y0, y1, x0, x1 = box
        return (max(y0, self.rows), y1, x0, x1) if y1 > self.rows else None

    def device_view(self, box: Box):
        """The device rows of a box (a view of `top`)."""
        y0, y1, x0, x1 = box
        return self.top[..., y0 : min(y1, self.rows), x0:x1]

    def host_view(self, box: Box):
        """The host rows of a box (a view of `bottom`)."""
        y0, y1, x0, x1 = box
        return self.bottom[..., max(y0, self.rows) - self.rows : y1 - self.rows, x0:x1]


class Staging:
    """Full-size tensors between segments, held on the device, in host memory or in disk files.

    `heap_slack`: freed heap that disk staging keeps resident for reuse (see `trim`). `on_device`: values
    held on the device whatever `where` says (a GPU plan's "device+host" staging); `split`: value -> rows,
    values held with those first rows on the device and the rest in host memory (`SplitValue`)."""

    def __init__(self, where: str | Place, device, directory: str | None = None, heap_slack: int = TRIM_FREE,
                 on_device=frozenset(), split: dict[str, int] | None = None):
        if where not in STAGINGS:
            raise ValueError(f"staging must be one of {STAGINGS}, got {where!r}")
        self.where = Place(where)
        self.device, self.heap_slack, self.on_device = device, heap_slack, on_device
        self.split = dict(split or {})
        if self.split and self.where is not Place.HOST:
            raise ValueError(f"split values {sorted(self.split)} keep their other rows in host memory: "
                             f"staging must be 'host' (with on_device / split), got {self.where.value!r}")
        self.dir = None
        if self.where is Place.DISK:
            self.dir = tempfile.TemporaryDirectory(prefix="tilewise-stage-", dir=directory)
        self.lane = copies.copy_lane(device, where)  # device -> host copies (a side stream on CUDA)
        self.fetched: dict = {}  # (value, box) -> lane handles of boxes read ahead (`prefetch`), oldest
        # first (two tiles in a row may need the same box: a chain's halo clipped to the whole value)
        self.given: set[str] = set()  # values staged as given (`put`: the program input)
        self.tensors: dict[str, Any] = {}  # value -> tensor (device / host) or DiskValue
        self.offsets: dict[str, int] = {}  # first stored row of values held as a band of rows
        self.sizes: dict[str, int] = {}  # bytes of each allocated staged tensor
        self.peak = 0  # most allocated staged bytes alive at once

    def alloc(self, name: str, shape: tuple[int, ...], dtype, rows: tuple[int, int] | None = None) -> None:
        """Allocate a staged tensor; with `rows` = (lo, hi) only those rows of the value (a rank's band)."""

        if rows is not None:
            self.offsets[name] = rows[0]
            shape = (*shape[:-2], rows[1] - rows[0], shape[-1])
        size = torch.empty((), dtype=dtype).element_size()
        self.sizes[name] = size * math.prod(shape)
        self.peak = max(self.peak, sum(self.sizes.values()))
        if name in self.split and rows is None and len(shape) == 4:
            self.tensors[name] = SplitValue(shape, dtype, self.device, self.split[name])
        elif self.where is Place.DEVICE or name in self.on_device:
            self.tensors[name] = torch.empty(shape, dtype=dtype, device=self.device)
        elif self.where is Place.HOST or len(shape) != 4:
            pin = torch.device(self.device).type == "cuda"
            self.tensors[name] = torch.empty(shape, dtype=dtype, pin_memory=pin)
        else:
            path = os.path.join(self.dir.name, f"{name.replace('/', '_')}.bin")
            self.tensors[name] = DiskValue(path, shape, dtype)

    def put(self, name: str, tensor) -> None:
        """Stage an existing full tensor (the program input) without copying."""
        self.tensors[name] = tensor
        self.given.add(name)

    def info(self, name: str) -> tuple[tuple[int, ...], Any, Any]:
        """(stored shape, dtype, device) of a staged value."""
        t = self.tensors[name]
        if isinstance(t, DiskValue):

            return t.shape, t.dtype, torch.device("cpu")
        if isinstance(t, SplitValue):
            return t.shape, t.dtype, t.top.device
        return tuple(t.shape), t.dtype, t.device

    def read(self, name: str, box: Box):
        """The box of a staged tensor, on the device (from disk: a new tensor in channels-last memory)."""
        y0, y1, x0, x1 = box
        off = self.offsets.get(name, 0)
        t = self.tensors[name]
        if isinstance(t, DiskValue):
            return t.read(y0 - off, y1 - off, x0, x1).to(self.device, non_blocking=True)
        if isinstance(t, SplitValue):
            return self._read_split(name, t, tuple(box))
        handle = self._take((name, tuple(box)))
        if handle is not None:
            return self.lane.take(handle)
        self.lane.ready(name)
        return t[..., y0 - off : y1 - off, x0:x1].to(self.device, non_blocking=True)

    def _read_split(self, name: str, t: SplitValue, box: Box):
        """A box of a split value: its device rows a view, its host rows copied (or read ahead), joined."""
        lo = t.host_box(box)
        if lo is None:
            return t.device_view(box)
        handle = self._take((name, lo))
        if handle is not None:
            bottom = self.lane.take(handle)
        else:
            self.lane.ready(name)
            bottom = t.host_view(box).to(self.device, non_blocking=True)
        if lo[0] == box[0]:  # (every row in host memory)
            return bottom
        return torch.cat([t.device_view(box), bottom], dim=-2)

    def prefetches(self, name: str) -> bool:
        """Whether boxes of `name` are read ahead (`prefetch`): host-staged values, with a lane that does."""
        return (self.lane.prefetch and self.where is Place.HOST and name not in self.on_device | self.given
                and not isinstance(self.tensors.get(name), DiskValue | None))

    def prefetch(self, name: str, box: Box) -> None:
        """Start reading a box of a host-staged value onto the device; `read(name, box)` takes it."""
        y0, y1, x0, x1 = box
        off = self.offsets.get(name, 0)
        t = self.tensors[name]
        if isinstance(t, SplitValue):  # (its host rows only; none: the box is a view on the device)
            lo = t.host_box(tuple(box))
            if lo is not None:
                self.fetched.setdefault((name, lo), []).append(self.lane.fetch(name, t.host_view(box),
                                                                               self.device))
            return
        src = t[..., y0 - off : y1 - off, x0:x1]
        self.fetched.setdefault((name, tuple(box)), []).append(self.lane.fetch(name, src, self.device))

    def _take(self, key):
        """The oldest handle read ahead for (value, box), or None (each tile takes the one read for it)."""
        handles = self.fetched.get(key)
        if not handles:
            return None
        handle = handles.pop(0)
        if not handles:
            del self.fetched[key]
        return handle

    def drop_fetched(self) -> None:
        """Forget boxes read ahead that no tile took."""
        self.fetched.clear()

    def reads_copy(self, name: str, box: Box | None = None) -> bool:
        """Whether read(name, box) returns a new tensor of its own (disk, or host memory read onto an
        accelerator; a split value's box with host rows), not a view of staged memory (without `box`:
        any box)."""
        t = self.tensors.get(name)
        if isinstance(t, DiskValue):
            return True
        if isinstance(t, SplitValue):  # (a straddling box is joined: a copy; one in host rows, across)
            across = t.bottom.device.type != torch.device(self.device).type
            if box is None:
                return 0 < t.rows or across
            lo = t.host_box(tuple(box))
            return lo is not None and (lo[0] > box[0] or across)

        return t is not None and t.device.type != torch.device(self.device).type

    def write(self, name: str, box: Box, value) -> None:
        """Write value into the box of a staged tensor."""
        y0, y1, x0, x1 = box
        off = self.offsets.get(name, 0)
        t = self.tensors[name]
        if isinstance(t, DiskValue):
            t.write(y0 - off, y1 - off, x0, x1, value)
        elif isinstance(t, SplitValue):  # its device rows, then its host rows through the lane
            k = max(0, min(y1, t.rows) - y0)
            if k:
                t.device_view(box).copy_(value[..., :k, :], non_blocking=True)
            if k < y1 - y0:
                self.lane.copy(name, t.host_view(box), value[..., k:, :])
        elif self.where is Place.HOST and name not in self.on_device:  # into host memory: the lane's copy
            self.lane.copy(name, t[..., y0 - off : y1 - off, x0:x1], value)
        else:
            t[..., y0 - off : y1 - off, x0:x1].copy_(value, non_blocking=True)

    def trim(self) -> None:
        """Disk staging (the memory-bounded one) keeps at most heap_slack bytes of freed heap resident:
        called after every op and tile. Host and device staging never trim (re-faulting the trimmed
        pages cost ~7% of a decode)."""
        if self.where is Place.DISK:
            trim_heap(self.heap_slack)

    def free(self, name: str) -> None:
        """Drop a staged tensor (and its file)."""
        self.lane.ready(name)
        t = self.tensors.pop(name, None)
        self.offsets.pop(name, None)
        self.sizes.pop(name, None)
        if isinstance(t, DiskValue):
            t.close()

    def close(self) -> None:
        """Free everything (after every copy into it has been made)."""
        self.lane.finish()
        for name in list(self.tensors):
            self.free(name)
        if self.dir is not None:
            self.dir.cleanup()


def candidates(asked: Place | None, gpu: bool, mixed: bool) -> tuple[Place, ...]:
    """The stagings a plan tries, nearest first: the one asked for, or ("auto") device, host, disk, and
    on a GPU plan that may mix them (`mixed`: exact mode, one process) device+host after device."""
    if asked is not None:
        return (asked,)
    if gpu and mixed:
        return (Place.DEVICE, Place.MIXED, Place.HOST, Place.DISK)
    return (Place.DEVICE, Place.HOST, Place.DISK)


def admits(staging: Place, asked: Place | None, staged_bytes: int, host_bytes: int) -> bool:
    """Whether a GPU plan may stage `staged_bytes` with `staging` given the host memory there is: host
    staging only where host memory holds them; disk, unless asked for, only where it does not."""
    if staging is Place.DISK and asked is None:
        return staged_bytes > host_bytes
    if staging in (Place.HOST, Place.MIXED):
        return staged_bytes <= host_bytes
    return True
