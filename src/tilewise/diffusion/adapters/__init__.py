"""Model adapters: how one model family is called on one tile, behind one contract the fusion core uses.

The fusion core (`tilewise.diffusion.fusion`) knows latent grids, pieces, weights and conditioning rows;
it never names a model's arguments. An adapter does, in four steps of every call:

1. `parse(model, args, kwargs) -> Call`: the pipeline's call as a (B, C, H, W) latent grid, the
   timestep, the per-row conditioning (tensors whose leading dim is the batch: split into row sets and
   repeated per tile; objects that select their own rows, `take_rows(rows, n_rows, repeats)`: the
   ControlNet residuals of `tilewise.diffusion.residuals`, which learn the call's row indices so),
   what goes to every tile unchanged, and the layout that packs a prediction back
   (a transformer's token order and position ids).
2. `apply_region(cond, region, n)`: a regional prompt's embeddings in place of the prompt's.
3. `predict(model, call, x, t, cond, boxes, rows) -> prediction`: the model on a batch of tiles `x`
   (n tiles x `rows` rows, all of one size) cut at the grid boxes `boxes`, with the conditioning the
   tiles need there (e.g. SDXL's crop micro-conditioning, a transformer's positions of those tokens,
   ControlNet residuals computed on those tiles: `residuals.evaluate(cond, Tiles(boxes, ...))`).
4. `output(call, fused)`: the fused (B, C, H, W) prediction in the model's own return type.

`adapter_for(model, **options)` picks the family from the model class and refuses an unsupported one
in one line naming the supported classes. The UNet adapter is the last family and takes any other
module with the UNet's call, `model(sample, timestep, encoder_hidden_states=..., return_dict=False)`,
except a diffusers transformer that no family calls.
"""

from __future__ import annotations

from .base import POSITIONS, Adapter, Call
from .families import REFUSED, SPECS
from .flux import ChromaAdapter, Flux2Adapter, FluxAdapter, FluxLikeAdapter
from .grid import GridAdapter, Spec
from .qwen import QwenImageAdapter
from .sd3 import SD3Adapter
from .unet import UNetAdapter
from .zimage import ZImageAdapter

__all__ = ["POSITIONS", "REFUSED", "SPECS", "Adapter", "Call", "ChromaAdapter", "FAMILIES", "Flux2Adapter",
           "FluxAdapter", "FluxLikeAdapter", "GridAdapter", "QwenImageAdapter", "SD3Adapter", "Spec",
           "UNetAdapter", "ZImageAdapter", "adapter_for"]

# tried in order: the UNet adapter, the fallback, last
FAMILIES: list[type[Adapter]] = [SD3Adapter, FluxAdapter, FluxLikeAdapter, ChromaAdapter, Flux2Adapter,
                                 QwenImageAdapter, ZImageAdapter, UNetAdapter]


def adapter_for(model, **options) -> Adapter:
    """The adapter of the model's family (a declared `Spec` naming its class, else the first adapter whose
    `accepts` does), built with `options`."""
    name = type(model).__name__
    if name in REFUSED:
        raise ValueError(f"TiledDenoiser cannot wrap a {name}: {REFUSED[name]}")
    names = {c.__name__ for c in type(model).__mro__}
    for spec in SPECS:
        if names & set(spec.classes):
            why = spec.refuse_config(model.config) if spec.refuse_config else None
            if why:
                raise ValueError(f"TiledDenoiser cannot wrap this {type(model).__name__}: {why}")
            return GridAdapter(spec, **options)
    for cls in FAMILIES:
        if cls.accepts(model):
            return cls(**options)
    supported = ", ".join([*(c for spec in SPECS for c in spec.classes),
                           *(c for cls in FAMILIES for c in cls.classes)])
    raise ValueError(f"TiledDenoiser cannot wrap a {name} (unet=): supported model classes are {supported}, "
                     "and modules called like a UNet, model(sample, timestep, ...)")
