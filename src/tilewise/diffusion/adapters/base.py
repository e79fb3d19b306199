"""The contract of a model adapter (see `tilewise.diffusion.adapters`): `Call` and `Adapter`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ...geometry import Box

POSITIONS = ("global", "tile")  # a tile's tokens get their positions in the image, or those of a tile


@dataclass
class Call:
    """One denoiser call as the fusion core sees it."""

    sample: Any  # (B, C, H, W) latent grid
    timestep: Any
    cond: dict[str, Any] = field(default_factory=dict)  # per-row conditioning (leading dim = batch)
    shared: dict[str, Any] = field(default_factory=dict)  # passed to every tile unchanged
    return_dict: bool = True
    layout: Any = None  # the adapter's own record of how the call's input maps to the grid (packing back)


class Adapter:
    """The contract of one model family (see the module docstring); subclasses implement every method.

    `positions` ("global" or "tile"): whether a tile's tokens get the positional inputs they have in the
    whole image or those of an image the size of the tile (today's tiled-diffusion tools); families
    without positional inputs compute the same either way.
    """

    family = ""
    classes: tuple[str, ...] = ()  # model class names this adapter calls
    align_name = "the model's alignment"  # what `align` is, for error messages
    no_regions: str | None = None  # why regional prompts cannot apply to this family (None: they can)

    def __init__(self, positions: str = "global", **options: Any) -> None:
        # options meant for other families (micro_conditioning, vae_scale_factor) are not this one's
        if positions not in POSITIONS:
            raise ValueError(f"positions must be one of {POSITIONS}, got {positions!r}")
        self.positions = positions

    @classmethod
    def accepts(cls, model) -> bool:
        """Whether this adapter calls `model` (by default: its class or a base class is in `classes`)."""
        return any(c.__name__ in cls.classes for c in type(model).__mro__)

    def align(self, model) -> int:
        """Tile sides must be multiples of this many latent pixels (downsampling factor, patch size)."""
        raise NotImplementedError

    def frame_align(self, model) -> int:
        """Frame windows of a video must be multiples of this many latent frames (the temporal patch)."""
        return 1

    def frames_refused(self, model, call: Call | None = None) -> str | None:
        """Why frame windows (tile_frames) cannot be used with this model (call None: when the wrapper is
        built) or with this call's inputs; None where they can."""
        return None

    def parse(self, model, args: tuple, kwargs: dict) -> Call:
        raise NotImplementedError

    def apply_region(self, cond: dict, region, n: int) -> None:
        raise NotImplementedError

    def predict(self, model, call: Call, x, t, cond: dict, boxes: list[Box], rows: int):
        raise NotImplementedError

    def output(self, call: Call, fused):
        raise NotImplementedError


def expand_rows(t, n: int, name: str):
    """A region's embeddings (batch 1 or a divisor of n) for n rows."""
    if t.shape[0] == n:
        return t
    if t.shape[0] == 1:
        return t.expand(n, *t.shape[1:])
    if n % t.shape[0] == 0:
        return t.repeat(n // t.shape[0], *([1] * (t.ndim - 1)))
    raise ValueError(f"Region.{name} has batch {t.shape[0]}; expected 1 or a divisor of {n} rows")
