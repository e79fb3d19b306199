"""The contract of a model adapter (see `tilewise.diffusion.adapters`): `Call` and `Adapter`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ...geometry import Box


@dataclass
class Call:
    """One denoiser call as the fusion core sees it."""

    sample: Any  # (B, C, H, W) latent grid
    timestep: Any
    cond: dict[str, Any] = field(default_factory=dict)  # per-row conditioning (leading dim = batch)
    shared: dict[str, Any] = field(default_factory=dict)  # passed to every tile unchanged
    return_dict: bool = True


class Adapter:
    """The contract of one model family (see the module docstring); subclasses implement every method."""

    family = ""
    classes: tuple[str, ...] = ()  # model class names this adapter calls

    @classmethod
    def accepts(cls, model) -> bool:
        """Whether this adapter calls `model` (by default: its class is one of `classes`)."""
        return type(model).__name__ in cls.classes

    def align(self, model) -> int:
        """Tile sides must be multiples of this many latent pixels (downsampling factor, patch size)."""
        raise NotImplementedError

    def parse(self, model, args: tuple, kwargs: dict) -> Call:
        raise NotImplementedError

    def apply_region(self, cond: dict, region, n: int) -> None:
        raise NotImplementedError

    def predict(self, model, call: Call, x, t, cond: dict, boxes: list[Box], rows: int):
        raise NotImplementedError

    def output(self, call: Call, fused):
        raise NotImplementedError
