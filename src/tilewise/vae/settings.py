"""A TiledVAE run's settings and vocabularies, validated once where they enter.

- The vocabularies (`Kind`, `Mode`, `Attention`, `Estimator`, `Place`): every word a setting may take;
  the engine below dispatches on their members, never on free text.
- `Settings`: the frozen record of what the user asked of a TiledVAE (its constructor's arguments),
  checked and normalised in `__post_init__`, so a `replace` is checked again; `FastSettings` is fast
  mode's part of it.
- `Job`: what one call runs: the direction, the lowered program, the device profile the plan is made for,
  the element size and the device the VAE is on.

Functions below `vae/tiled.py` take these records (or the fields they read), never the TiledVAE.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from ..locality.program import Program
from ..memory import parse_bytes
from ..vocabulary import Vocabulary
from .devices import DeviceProfile, profile


class Kind(Vocabulary):
    """The direction of a run: latents to images, or images to latents."""

    DECODE = "decode"
    ENCODE = "encode"


class Mode(Vocabulary):
    """exact: equal to the untiled module; fast: GroupNorm statistics estimated (a named approximation)."""

    EXACT = "exact"
    FAST = "fast"


class Attention(Vocabulary):
    """global: every query attends to every token (exact); tile: to its tile's own (approximate)."""

    GLOBAL = "global"
    TILE = "tile"


class Estimator(Vocabulary):
    """Fast mode's statistics: from a sample of the real tiles, or from stratified crops (the seed's)."""

    TILES = "tiles"
    CROPS = "crops"


class Place(Vocabulary):
    """Where the full-size values between segments live. MIXED: the values a plan names on the device,
    the others in (pinned) host memory (GPU plans)."""

    DEVICE = "device"
    HOST = "host"
    DISK = "disk"
    MIXED = "device+host"

    @property
    def home(self) -> Place:
        """Where a value not named on the device lives (MIXED: the host)."""
        return Place.HOST if self is Place.MIXED else self


REQUESTABLE = (Place.DEVICE, Place.HOST, Place.DISK)  # what a user may ask for ("auto": None)
FAST_SAMPLE = {Estimator.TILES: 0.5, Estimator.CROPS: 0.25}  # fast_sample=None: each estimator's default


def _flag(value, what: str) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{what} must be True or False, got {value!r}")


def _int_at_least(value, low: int, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{what}, got {value!r}")
    return value


@dataclass(frozen=True)
class FastSettings:
    """Fast mode's options (TiledVAE's fast_*, color_fix)."""

    estimator: Estimator = Estimator.TILES
    sample: float | None = None  # fraction of tiles (or area in crops) estimated from; None: the default
    low: int = 4  # the low pass runs this many times smaller (0: none)
    crop: int | None = None  # the crop estimator's crop (None: the tile)
    color_fix: bool = False  # encode: estimate only before the first downsampling

    def __post_init__(self):
        object.__setattr__(self, "estimator", Estimator.parse(self.estimator, "fast_estimator"))
        number = isinstance(self.sample, int | float) and not isinstance(self.sample, bool)
        ok = self.sample is None or number
        if not ok or (self.sample is not None and not 0 < self.sample <= 1):
            raise ValueError(f"fast_sample must be None (the estimator's default) or in (0, 1], "
                             f"got {self.sample!r}")
        _int_at_least(self.low, 0, "fast_low must be an int >= 0 (0: no low-resolution pass)")
        if self.crop is not None:
            _int_at_least(self.crop, 1, "fast_crop must be None (the tile) or a positive int (latent pixels)")
        _flag(self.color_fix, "color_fix")

    def fraction(self, estimator: Estimator) -> float:
        """`sample`, or the estimator's default: half of the tiles (decode: sampled tiles are final
        output, so sampling more costs no convolutions, only their staging), a quarter of the area in
        crops (encode: crops are extra work)."""
        return FAST_SAMPLE[estimator] if self.sample is None else self.sample


@dataclass(frozen=True)
class Settings:
    """What a TiledVAE was asked for, validated (the messages name the argument and what is valid)."""

    tile_size: int = 32
    mode: Mode = Mode.EXACT
    attention: Attention = Attention.GLOBAL
    memory_budget: int | None = None  # bytes (a string such as "2GiB" is parsed)
    staging: Place | None = None  # None: "auto"
    retry_on_oom: bool = False
    progress: bool = True
    query_chunk: int = 4096
    stage_dir: str | None = None
    fast: FastSettings = field(default_factory=FastSettings)
    process_group: Any = None
    device_kind: str | DeviceProfile | None = None  # what plans are shaped for (None: the VAE's device)

    def __post_init__(self):
        put = object.__setattr__
        put(self, "mode", Mode.parse(self.mode, "mode"))
        put(self, "attention", Attention.parse(self.attention, "attention"))
        put(self, "staging", _staging(self.staging))
        _int_at_least(self.tile_size, 1, "tile_size must be a positive int (latent pixels)")
        _int_at_least(self.query_chunk, 1, "query_chunk must be an int >= 1 (queries per attention chunk)")
        _flag(self.retry_on_oom, "retry_on_oom")
        _flag(self.progress, "progress")
        if self.stage_dir is not None and not (isinstance(self.stage_dir, str | os.PathLike)
                                               and os.path.isdir(self.stage_dir)):
            raise ValueError(f"stage_dir must be None (the system's temporary folder) or an existing folder, "
                             f"got {self.stage_dir!r}")
        if self.memory_budget is not None:
            put(self, "memory_budget", parse_bytes(self.memory_budget))
        if isinstance(self.process_group, str) and self.process_group != "default":
            raise ValueError(f"process_group must be None, 'default' or a ProcessGroup, "
                             f"got {self.process_group!r}")
        if self.process_group is not None and self.retry_on_oom:
            raise ValueError("retry_on_oom=True is single-process only (a retry on one rank would "
                             "desynchronise the others): drop it or process_group")
        profile(self.device_kind, "cpu")  # (checks the value: a kind name, a DeviceProfile or None)

    def replace(self, **changes) -> Settings:
        """A copy with some settings changed, checked again."""
        return dataclasses.replace(self, **changes)

    @property
    def staging_word(self) -> str:
        """The staging as the user gave it ("auto" for None)."""
        return "auto" if self.staging is None else self.staging.value


def _staging(value) -> Place | None:
    """None for "auto", else one of REQUESTABLE."""
    if value is None or value == "auto":
        return None
    if value not in REQUESTABLE:
        raise ValueError(f"staging must be 'auto' or one of {tuple(s.value for s in REQUESTABLE)}, "
                         f"got {value!r}")
    return Place(value)


@dataclass(frozen=True)
class Job:
    """One call's work: the direction, its lowered program and what the plan is shaped for."""

    kind: Kind
    program: Program
    profile: DeviceProfile  # the device kind plans are made for
    dtype: torch.dtype  # the VAE's
    device: torch.device  # where the VAE's parameters are
    factor: int  # image pixels per latent pixel
    model: str = ""  # the wrapped VAE's class name (for messages)

    @property
    def item(self) -> int:
        """Bytes per element of the VAE's dtype."""
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def ref(self) -> str:
        """The value whose pixels tiles count: the latent (the decoder's input, the encoder's output)."""
        return self.program.input if self.kind is Kind.DECODE else self.program.output

    @property
    def gpu(self) -> bool:
        """Whether plans are GPU-shaped (a kernel launch per operator, transfers across a link)."""
        return self.profile.kind != "cpu"
