"""A family's table entry, `Spec` (read by `adapters.grid` for transformers, `adapters.unet` for UNets).

See `adapters.grid` for what each field means to a tile's call; `adapters.families` holds the entries.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .joint import Joint
from .positions import MethodSource, ModuleSource

LAYOUTS = {"bchw": (2, 3), "bcthw": (2, 3, 4), "btchw": (1, 3, 4), "bthwc": (1, 2, 3), "tokens": (1,)}


@dataclass(frozen=True)
class Spec:
    """One family's table entry (its fields: `adapters.grid`'s module docstring)."""

    family: str
    classes: tuple[str, ...]
    patch: Callable[[Any], tuple[int, ...]]  # config -> patch per latent axis ([frames,] rows, columns)
    layout: str = "bcthw"
    sample: str = "hidden_states"
    timestep: str = "timestep"
    prompt: str = "encoder_hidden_states"
    pooled: str | None = None
    spatial: tuple[str, ...] = ()
    tokens: dict[str, Any] = field(default_factory=dict)  # argument -> its token axis (or a taking function)
    frames: dict[str, int] = field(default_factory=dict)  # argument -> its latent-frame axis (per frame)
    axis_positions: str | None = None  # an argument of per-axis positions ([t], [rows], [cols]) in patches
    batched_tokens: tuple[str, ...] = ()  # of `tokens`: those with a batch dim before the token axis
    sizes: tuple[str, ...] = ()  # layout "tokens": the arguments giving ([frames,] rows, columns) in patches
    sources: tuple[ModuleSource, ...] = ()
    refused: dict[str, str] = field(default_factory=dict)
    one_call_per_tile: bool = False  # inputs broadcast over the batch (Cosmos' padding mask): never batched
    refuse_config: Callable[[Any], str | None] | None = None  # config -> why this model cannot be tiled
    resampled: tuple[str, ...] = ()  # of `spatial`: inputs the model resizes to its grid (Stable Cascade)
    method: MethodSource | None = None  # a model method making forward's inputs, positions among them
    rows_at: dict[str, int] = field(default_factory=dict)  # per-row arguments whose batch axis is not 0
    joint: Joint | None = None  # a joint sequence with the target latent last (`adapters.joint`)
    align: int | None = None  # tile sides a multiple of this many latent pixels (default: the patch)
    # (config, the call's inputs by name, None when the wrapper is built) -> why frame windows (tile_frames)
    # cannot be used with this model or these inputs (None: they can)
    refuse_frames: Callable[[Any, dict | None], str | None] | None = None
    # (model, the call's inputs by name) -> inputs the model would make for the whole latent when the call
    # passes none (LTX-2's video_coords), made so that tiles take theirs from them
    fill: Callable[[Any, dict], dict] | None = None
    stream: Stream | None = None  # a second, non-spatial output predicted with the latent (LTX-2's audio)


@dataclass(frozen=True)
class Stream:
    """A non-spatial output stream every tile call predicts whole (LTX-2's audio): `index` in the tuple
    output, `name` of the output class' field; `exact_when`: the boolean argument that makes it independent of
    the latent (then every tile predicts it exactly)."""

    index: int
    name: str
    exact_when: str | None = None
