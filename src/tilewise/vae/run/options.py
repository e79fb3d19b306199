"""How a run runs: the choices a plan settles (`Choices`), and how each of its passes runs (`RunOptions`).

A plan (`vae.plan`) settles a run's `Choices` (tile, staging, row bands, streamed attention, reads ahead,
fast mode's pieces) within the memory budget; each pass of the run then gets its `RunOptions`, made from
those choices, the user's settings and the device profile (`pass_options`). The executor follows them,
and the plan's counts read the same record, so what is counted is what runs.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..devices import BAND_BYTES, DeviceProfile
from ..settings import Attention, Place, Settings
from .staging import TRIM_FREE


@dataclass(frozen=True)
class Choices:
    """What a plan settles beyond the settings, as the run takes it (`Plan.choices`). Given to `make_plan`
    as a request, `fast_cuts` None asks it to choose the pieces; the plan's own choices say what it chose."""

    tile_size: int
    staging: Place
    band_bytes: int | None = None  # exact segments' big tiles in row bands of this
    on_device: frozenset = frozenset()  # MIXED staging: the values staged on the device
    split: tuple[tuple[str, int], ...] = ()  # MIXED staging: (value, rows) held split, its first rows on
    # the device, the rest in host memory (`staging.SplitValue`)
    kv_chunk: int = 0  # streamed global attention: keys / values read this many tokens at a time ...
    query_rows: int = 0  # ... by queries in row bands of this many latent rows (0: in the tiles)
    read_ahead: bool = True  # host staging reads the next tile's inputs while a tile runs (`copies`)
    fast_cuts: tuple[int, ...] | None = ()  # fast mode: its estimated part in pieces cut there
    low_tile: int = 0  # fast mode: the low pass's tile (0: the run's tile)
    staged_estimate: bool = False  # fast mode: the sampled tiles staged segment by segment
    fast_most: int = 0  # fast mode: at most this many rows and columns of sampled tiles (0: no cap)
    head_tile: int = 0  # fast mode: decode's exact latent-resolution head's tile (0: the run's tile)
    tile_batch: int = 1  # same-shape tiles of a local segment run this many at a time (`batches`)
    recompute: tuple[str, ...] = ()  # staged values their readers recompute instead (`program.recompute`)
    low_recompute: tuple[str, ...] = ()  # fast mode: the low pass's (its program reuses the part's names)

    def __post_init__(self):
        object.__setattr__(self, "staging", Place.parse(self.staging, "staging"))
        _check_batch(self.tile_batch)
        _check_split(self.split, self.staging)

    def replace(self, **changes) -> Choices:
        """A copy with some choices changed."""
        return replace(self, **changes)


@dataclass(frozen=True)
class RunOptions:
    """How a pass runs (defaults: a CPU run with everything staged on the device)."""

    attention: Attention = Attention.GLOBAL  # global (exact) or tile-local attention
    staging: Place = Place.DEVICE  # where staged values live (MIXED: `on_device` there, the rest host)
    on_device: frozenset = frozenset()  # MIXED: the values staged on the device
    split: tuple[tuple[str, int], ...] = ()  # MIXED: (value, rows) with its first rows on the device
    band_bytes: int | None = BAND_BYTES  # local segments stream bigger tiles in row bands (None: whole)
    kv_chunk: int = 0  # global attention: keys / values in host memory, streamed this many tokens a time
    query_rows: int = 0  # global attention: queries in row bands of this many reference rows (0: tiles)
    read_ahead: bool = True  # host staging: the next tile's inputs read while a tile runs (where it can)
    query_chunk: int = 4096  # queries attended at a time
    conv_workspace: int = 32 << 20  # convs on bigger tiles run in row bands (bounds CPU im2col buffers)
    stats_chunk: int = 1 << 20  # bytes of one pass of GroupNorm moments (0: one Welford pass, GPU plans)
    check_finite: bool = True  # NaN / inf checks of the stored values, one host sync a segment
    check_emitted: bool = True  # each emitted core checked before it leaves for the sink (one sync a
    # core; False for a sink that discards them: with the segment's other checks, one sync a segment)
    heap_slack: int = TRIM_FREE  # disk staging: freed heap kept resident for reuse (bytes, at most)
    stage_dir: str | None = None  # disk staging's folder (None: the system's temporary folder)
    progress: bool = True  # a progress bar over the tiles
    keep_staged: bool = False  # keep every staged value and hand the staging over (`RunResult.staging`):
    # the reverse program's checkpoints (`reverse`); the caller closes it
    tile_batch: int = 1  # same-shape tiles of a local segment stacked and run this many at a time
    # (`batches`; 1: tile by tile)
    recompute: tuple[str, ...] = ()  # staged values recomputed by their readers, not stored (`locality.
    # program.recompute`: exact runs on one process)

    def __post_init__(self):
        object.__setattr__(self, "attention", Attention.parse(self.attention, "attention"))
        object.__setattr__(self, "staging", Place.parse(self.staging, "staging"))
        _check_batch(self.tile_batch)
        _check_split(self.split, self.staging)

    def replace(self, **changes) -> RunOptions:
        """A copy with some options changed."""
        return replace(self, **changes)

    def place(self, value: str) -> Place:
        """Where staged value `value` lives (MIXED: split, its first rows on the device)."""
        if value in self.on_device:
            return Place.DEVICE
        return Place.MIXED if value in self.device_rows else self.staging.home

    @property
    def device_rows(self) -> dict[str, int]:
        """Split values: value -> its first rows held on the device."""
        return dict(self.split)


def pass_options(settings: Settings, profile: DeviceProfile, choices: Choices, **changes) -> RunOptions:
    """The options of a pass that follows `choices` under `settings` on `profile` (with `changes`)."""
    base = RunOptions(attention=settings.attention, staging=choices.staging, on_device=choices.on_device,
                      split=choices.split, band_bytes=choices.band_bytes, kv_chunk=choices.kv_chunk,
                      query_rows=choices.query_rows,
                      read_ahead=choices.read_ahead, query_chunk=settings.query_chunk,
                      conv_workspace=profile.conv_workspace, stats_chunk=profile.stats_chunk,
                      stage_dir=settings.stage_dir, progress=settings.progress, tile_batch=choices.tile_batch,
                      recompute=choices.recompute)
    return base.replace(**changes) if changes else base


def _check_batch(n) -> None:
    if not (isinstance(n, int) and not isinstance(n, bool) and n >= 1):
        raise ValueError(f"tile_batch must be an int >= 1 (tiles run at a time), got {n!r}")


def _check_split(split, staging: Place) -> None:
    if not split:
        return
    if staging is not Place.MIXED:
        raise ValueError(f"split values {split!r} are held on the device and in host memory: staging must be "
                         f"{Place.MIXED.value!r}, got {staging.value!r}")
    for item in split:
        ok = isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str) \
            and isinstance(item[1], int) and not isinstance(item[1], bool) and item[1] >= 0
        if not ok:
            raise ValueError(f"split must be (value name, device rows >= 0) pairs, got {item!r} in {split!r}")
