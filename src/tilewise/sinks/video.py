"""Streaming video sinks: frames written block by block, never the whole video in memory.

One signature head, ``Sink(path, frames, height, width, channels, bits)``, one contract, that of the
image sinks (`tilewise.sinks`) with a time axis:

- use it as a context manager; ``write(t0, y0, x0, block)`` puts a block of consecutive frames t0,
  t0 + 1, ... whose top-left pixel is (y0, x0): a torch ``(C, t, h, w)`` or ``(1, C, t, h, w)`` tensor
  whose floats are mapped from ``value_range`` (default ``(-1, 1)``, a VAE decode's) to the integer
  range, or numpy ``(t, h, w, C)`` pixels already in the sink's dtype;
- ``close()`` checks that every pixel of every frame was written and publishes the file(s) under their
  names (written under temporary names first; a frame sequence's files all at once, when every frame is
  complete: `atomic.publish_all`); an exception inside the ``with`` block removes the temporaries and
  never a file that was there before; ``replace=False`` refuses (at once, and again when publishing) to
  replace any existing target.

- :class:`FrameSequenceSink`: one image per frame, ``pattern.format(t)`` (``"out/f{:04d}.png"``), each an
  image sink (`tilewise.sinks.open_sink`: PNG, TIFF, .npy) opened at the frame's first block and
  completed under its temporary name at its last. A PNG frame takes its blocks in row-major tile order.
  Holds the open frames' row buffers. `existing` lists the targets that are there (and will be replaced).
- :class:`NpyStackSink`: one ``(T, H, W, C)`` ``.npy`` through a memmap; blocks in any order.
- :class:`TIFFStackSink`: a multi-page BigTIFF, one page per frame in frame order (tifffile); a frame is
  held in memory from its first block until it and every frame before it are complete.

``random_access`` says whether blocks may come in any order of frames (a tile-major run), or should
come frame after frame (`tilewise.vae` then runs its causal steps outermost). ``open_video_sink`` picks
the sink by the path (also `tw.open_video_sink`).

tifffile (~30 ms after numpy) is imported by the sink that writes TIFF stacks, so that only those pay for it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from ..atomic import check_target, name_target, publish, publish_all, temporary_path
from ..errors import BadRequest
from . import open_sink, sink_for
from .arrays import allocate
from .coverage import first_gap
from .pixels import check_range, to_hwc_uint

DTYPES = {8: "uint8", 16: "uint16", 32: "float32"}
IMAGE_CHANNELS = (1, 2, 3, 4)  # grey, grey+alpha, RGB, RGBA: what PNG and TIFF frames hold


class VideoSink:
    """Base of the video sinks: frames, height, width, channels, bits; per-frame coverage."""

    random_access = False

    channels_allowed: tuple[int, ...] | None = None  # None: any number of channels

    def __init__(self, path: str | os.PathLike, frames: int, height: int, width: int, channels: int = 3,
                 bits: int = 8, *, value_range: tuple[float, float] = (-1.0, 1.0), replace: bool = True):
        for name, v in (("frames", frames), ("height", height), ("width", width), ("channels", channels)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r} (video {frames!r} frames of "
                                 f"{height!r}x{width!r}x{channels!r})")
        if bits not in DTYPES:
            raise ValueError(f"bits must be 8, 16 or 32 (float32), got {bits!r}")
        if self.channels_allowed is not None and channels not in self.channels_allowed:
            raise ValueError(f"{type(self).__name__} holds frames of {self.channels_allowed} channels (grey, "
                             f"grey+alpha, RGB, RGBA), got channels={channels}")
        if not isinstance(replace, bool):
            raise ValueError(f"replace must be True or False, got {replace!r}")
        self.path, self.frames, self.height, self.width = os.fspath(path), frames, height, width
        self.channels, self.bits, self.dtype = channels, bits, DTYPES[bits]
        self.value_range, self.replace = check_range(value_range), replace
        self._boxes: list[list[tuple[int, int, int, int]]] = [[] for _ in range(frames)]
        self._area = [0] * frames
        self.closed = False

    def __enter__(self) -> VideoSink:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.abort() if exc_type is not None else self.close()

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({self.path!r}, {self.frames}, {self.height}, {self.width}, "
                f"{self.channels})")

    def write(self, t0: int, y0: int, x0: int, block: Any) -> None:
        """Write frames t0.. of `block` with their top-left pixel at (y0, x0)."""
        if self.closed:
            raise ValueError(f"{self!r} is closed")
        frames = self._frames(block)
        t, h, w = len(frames), frames[0].shape[0], frames[0].shape[1]
        if t0 < 0 or t0 + t > self.frames or y0 < 0 or x0 < 0 or y0 + h > self.height or x0 + w > self.width:
            raise ValueError(f"block of {t} frames of {h}x{w} at (t0={t0}, y0={y0}, x0={x0}) does not fit "
                             f"inside {self.frames} frames of {self.height}x{self.width}")
        for i, pixels in enumerate(frames):
            f = t0 + i
            self._put(f, y0, x0, pixels)
            self._boxes[f].append((y0, y0 + h, x0, x0 + w))
            self._area[f] += h * w
            if self._area[f] >= self.height * self.width and first_gap(self.height, self.width,
                                                                       self._boxes[f]) is None:
                self._complete(f)

    def _frames(self, block: Any) -> list[np.ndarray]:
        """(h, w, C) pixels of every frame of the block, in the sink's dtype."""
        if hasattr(block, "detach"):  # torch (C, t, h, w) or (1, C, t, h, w)
            x = block.detach()
            x = x[0] if x.dim() == 5 and x.shape[0] == 1 else x
            if x.dim() != 4 or x.shape[0] != self.channels:
                raise ValueError(f"torch blocks are (C, t, h, w) or (1, C, t, h, w) with C={self.channels}, "
                                 f"got shape {tuple(block.shape)}")
            if self.bits == 32:
                return list(x.float().permute(1, 2, 3, 0).cpu().numpy())
            return [to_hwc_uint(x[:, i], self.bits, self.value_range) for i in range(x.shape[1])]
        a = np.asarray(block)
        if a.ndim != 4 or a.shape[3] != self.channels or a.dtype != self.dtype:
            raise ValueError(f"numpy blocks are (t, h, w, C={self.channels}) pixels of dtype {self.dtype}, "
                             f"got shape {a.shape}, dtype {a.dtype}")
        return list(a)

    def close(self) -> None:
        """Check every frame is complete, then finish and publish."""
        if self.closed:
            return
        try:
            for f in range(self.frames):
                gap = first_gap(self.height, self.width, self._boxes[f])
                if gap is not None:
                    raise ValueError(f"{self!r}: frame {f}, pixels (y {gap[0]}..{gap[1]}, "
                                     f"x {gap[2]}..{gap[3]}) were never written")
            self._finish()
        except BaseException:
            self.abort()
            raise
        self.closed = True

    def abort(self) -> None:
        """Discard everything written; nothing is left under the path(s)."""
        if not self.closed:
            self.closed = True
            self._discard()

    def _put(self, f: int, y0: int, x0: int, pixels: np.ndarray) -> None:
        raise NotImplementedError

    def _complete(self, f: int) -> None:
        pass

    def _finish(self) -> None:
        pass

    def _discard(self) -> None:
        pass


class FrameSequenceSink(VideoSink):
    """One image file per frame: ``path.format(t)`` through `tilewise.sinks.open_sink`, all published
    together when every frame is complete."""

    def __init__(self, path, frames, height, width, channels=3, bits=8, **kw):
        super().__init__(path, frames, height, width, channels, bits, **kw)
        self.targets = frame_targets(self.path, frames)
        cls, _ = sink_for(self.targets[0], bits)
        if cls.__name__ != "MemmapSink" and channels not in IMAGE_CHANNELS:
            raise ValueError(f"{cls.__name__} frames hold {IMAGE_CHANNELS} channels, got channels={channels}")
        for target in {os.path.dirname(t): t for t in reversed(self.targets)}.values():  # each folder's first
            check_target(target, "frame")
        self.existing = [t for t in self.targets if os.path.lexists(t)]
        if self.existing and not self.replace:
            raise BadRequest(f"{len(self.existing)} of the {frames} frames of {self.path!r} exist (the first "
                             f"{self.existing[0]!r}) and replacing them was refused (--no-clobber); remove "
                             "them or choose another pattern")
        self._open: dict[int, Any] = {}
        self._done: dict[int, str] = {}  # frame -> its complete file under a temporary name

    def _put(self, f, y0, x0, pixels):
        if f not in self._open:
            self._open[f] = open_sink(self.targets[f], self.height, self.width, self.channels, self.bits)
        self._open[f].write(y0, x0, pixels)

    def _complete(self, f):
        self._done[f] = self._open.pop(f).complete()

    def _finish(self):
        publish_all([(self._done[f], self.targets[f]) for f in range(self.frames)], replace=self.replace)
        self._done.clear()

    def _discard(self):
        for sink in self._open.values():
            sink.abort()
        for tmp in self._done.values():  # temporaries only: a file the user had is never touched
            if os.path.exists(tmp):
                os.unlink(tmp)
        self._open.clear()
        self._done.clear()


def frame_targets(pattern: str, frames: int) -> list[str]:
    """The file of every frame of a pattern with one {} field (``"f{:04d}.png"``); BadRequest when it is
    not one, or when two frames would share a file."""
    try:
        targets = [pattern.format(t) for t in range(frames)]
    except (IndexError, KeyError, ValueError) as e:
        raise BadRequest(f"{pattern!r} is not a frame pattern with one {{}} field for the frame number "
                         f"({e}); e.g. 'frames/f{{:04d}}.png'") from None
    if frames > 1 and targets[0] == targets[1]:
        raise BadRequest(f"a frame sequence needs a pattern with a {{}} field for the frame number, e.g. "
                         f"'frames/f{{:04d}}.png', got {pattern!r}")
    if len(set(targets)) != frames:
        twice = next(t for i, t in enumerate(targets) if t in targets[:i])
        raise BadRequest(f"pattern {pattern!r} names two of its {frames} frames {twice!r}: give a field that "
                         "tells every frame number apart, e.g. {:04d}")
    return targets


class NpyStackSink(VideoSink):
    """A (T, H, W, C) ``.npy`` through a numpy memmap; blocks in any order."""

    random_access = True

    def __init__(self, path, frames, height, width, channels=3, bits=8, **kw):
        super().__init__(path, frames, height, width, channels, bits, **kw)
        check_target(self.path, "output", replace=self.replace)
        self._tmp = temporary_path(self.path)
        try:
            self._array = np.lib.format.open_memmap(self._tmp, mode="w+", dtype=self.dtype,
                                                    shape=(frames, height, width, channels))
            allocate(self._tmp)  # (a full disk is an error now, not a bus error while writing)
        except BaseException as e:
            name_target(e, self.path)
            self._array = None
            self.abort()
            raise

    def _put(self, f, y0, x0, pixels):
        self._array[f, y0:y0 + pixels.shape[0], x0:x0 + pixels.shape[1]] = pixels

    def _release(self):
        mm = getattr(self._array, "_mmap", None)
        self._array = None
        if mm is not None:
            mm.close()

    def _finish(self):
        self._array.flush()
        self._release()
        publish(self._tmp, self.path, replace=self.replace)

    def _discard(self):
        self._release()
        if os.path.exists(self._tmp):
            os.unlink(self._tmp)


class TIFFStackSink(VideoSink):
    """A multi-page BigTIFF, one page per frame, pages written in frame order."""

    channels_allowed = IMAGE_CHANNELS

    def __init__(self, path, frames, height, width, channels=3, bits=8, **kw):
        import tifffile

        super().__init__(path, frames, height, width, channels, bits, **kw)
        check_target(self.path, "output", replace=self.replace)
        self._tmp = temporary_path(self.path)
        self._tif = tifffile.TiffWriter(self._tmp, bigtiff=True)
        self._held: dict[int, np.ndarray] = {}
        self._complete_frames: set[int] = set()
        self._next = 0

    def _put(self, f, y0, x0, pixels):
        if f < self._next:
            raise ValueError(f"frame {f} is already written to {self.path}")
        if f not in self._held:
            self._held[f] = np.zeros((self.height, self.width, self.channels), dtype=self.dtype)
        self._held[f][y0:y0 + pixels.shape[0], x0:x0 + pixels.shape[1]] = pixels

    def _complete(self, f):
        self._complete_frames.add(f)
        while self._next in self._complete_frames:
            page = self._held.pop(self._next)
            photometric = "rgb" if self.channels in (3, 4) else "minisblack"
            self._tif.write(page[:, :, 0] if self.channels == 1 else page, photometric=photometric,
                            metadata=None)
            self._next += 1

    def _finish(self):
        self._tif.close()
        publish(self._tmp, self.path, replace=self.replace)

    def _discard(self):
        self._tif.close()
        self._held.clear()
        if os.path.exists(self._tmp):
            os.unlink(self._tmp)


def video_sink_for(path: str | os.PathLike, bits: int = 8) -> type[VideoSink]:
    """The video sink class for `path` and `bits`: the checks of `open_video_sink`, made before any work
    (BadRequest naming the path or the bits and what is valid). A pattern with a {} field -> one image
    per frame (its frames' suffix and bits as `sink_for` takes them), .npy -> a (T, H, W, C) stack,
    .tif / .tiff -> a multi-page TIFF stack; 8, 16 or 32 (float32) bits."""
    path = os.fspath(path)
    if "{" in path:
        sink_for(frame_targets(path, 2)[0], bits)
        return FrameSequenceSink
    cls = {".npy": NpyStackSink, ".tif": TIFFStackSink, ".tiff": TIFFStackSink}.get(Path(path).suffix.lower())
    if cls is None:
        raise BadRequest(f"cannot choose a video sink for {path!r}: use a frame pattern such as "
                         f"'f{{:04d}}.png', a .npy stack or a .tif stack")
    if bits not in DTYPES:
        raise BadRequest(f"bits must be 8, 16 or 32 (float32), got {bits!r}")
    return cls


def open_video_sink(path: str | os.PathLike, frames: int, height: int, width: int, channels: int = 3,
                    bits: int = 8, **options: Any) -> VideoSink:
    """The video sink for `path` (`video_sink_for`: a frame pattern, a .npy or a .tif stack)."""
    return video_sink_for(path, bits)(path, frames, height, width, channels, bits, **options)
