"""The declared transformer families: one `Spec` per family (see `adapters.grid`), read top to bottom.

Each entry says what a tile needs of its model, taken from the model's forward and its pipelines' calls in
diffusers 0.42: the sample's layout and patch, the inputs on the latent's grid (cropped per tile), the
per-token inputs (taken at the tile's tokens) and the submodule that computes positions from the
latent's shape (hooked per tile for `positions="global"`: `adapters.positions`).
"""

from __future__ import annotations

from .grid import Spec
from .positions import ModuleSource

ROPE = (ModuleSource("rope"),)  # a rotary table computed from the latent's shape by `model.rope`


def _wan_patch(c):
    return tuple(c.patch_size)


SPECS: tuple[Spec, ...] = (
    # Wan 2.1 / 2.2 (T2V, I2V: condition channels in the sample, image embeddings per row; TI2V: one
    # timestep per token), SkyReels-V2, ChronoEdit: (B, C, T, H, W), 3-D rotary table from `rope`
    Spec("wan", ("WanTransformer3DModel",), _wan_patch, tokens={"timestep": 1},
         batched_tokens=("timestep",), sources=ROPE),
)
