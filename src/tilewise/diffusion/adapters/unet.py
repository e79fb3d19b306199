"""The UNet adapter: diffusers' UNets (SD 1.x / 2.x, SDXL, video UNets, Stable Cascade, ControlNet-XS) and any
module with a UNet's call.

`model(sample, timestep, ..., return_dict=False)` on (B, C, [T,] h, w) tiles, its arguments bound by the
names its forward takes (`transformer.bind_call`). A UNet family is a `Spec` in `families.UNETS`: its
sample layout (image, video (B, C, T, H, W) or (B, T, C, H, W)), the inputs on the latent's grid (I2VGen-XL's
image latents, ControlNet-XS's control image: cropped at their own resolution; Stable Cascade's effnet
and pixels, which the model resamples to its size: resampled to the latent's, then cropped) and what it
refuses. UNets have no positional inputs (their convolutions see where a pixel is); a motion module's
frame positions are the frame window's (as AnimateDiff's context windows give them).

Regions replace `encoder_hidden_states` (and SDXL's pooled `text_embeds`); SDXL's micro-conditioning gets
the tile's crop top-left (`micro_conditioning="tile"`), the pipeline's (`"pipeline"`) or a callable's.
ControlNet and T2I-Adapter residuals (`down_block_additional_residuals`, `mid_block_additional_residual`,
`down_intrablock_additional_residuals`) are per tile: tensors are cropped at their own resolution,
TiledControlNet outputs computed by running the ControlNet on the tile (`tilewise.diffusion.residuals`).

diffusers' output classes are imported inside the methods that build them, so that importing
tilewise.diffusion does not import diffusers (~3 s).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..residuals import Tiles, crop_map, evaluate, residual_args
from .base import Adapter, Call, expand_rows
from .families import UNETS
from .grid import GridLayout, PerTile, Spatial, Spec
from .transformer import accepted_signature, bind_call

MICRO_CONDITIONING = ("tile", "pipeline")
_RESIDUALS = ("down_block_additional_residuals", "mid_block_additional_residual",
              "down_intrablock_additional_residuals")


def downsampling_factor(unet) -> int:
    """2 ** (number of downsampling blocks) for a diffusers UNet; 1 for a model without block_out_channels."""
    config = getattr(unet, "config", None)
    blocks = getattr(config, "block_out_channels", None) if config is not None else None
    return 2 ** (len(blocks) - 1) if blocks else 1


def _check_channels(model, grid) -> None:
    """A (B, C, [T,] h, w) grid has the UNet's in_channels (its conv_in would fail on any other C)."""
    want = getattr(getattr(model, "config", None), "in_channels", None)
    got = grid.shape[1] if getattr(grid, "ndim", 0) in (4, 5) else None
    if isinstance(want, int) and got is not None and got != want:
        raise ValueError(f"sample has {got} channels (latent grid {tuple(grid.shape)}) but the UNet takes "
                         f"{want} (config.in_channels)")


DEFAULT = Spec("unet", (), lambda c: (1,), layout="bchw", sample="sample")


def spec_of(model) -> Spec:
    """The model's UNet table entry (`families.UNETS`), or the plain (B, C, H, W) UNet call."""
    names = {c.__name__ for c in type(model).__mro__}
    return next((u for u in UNETS if names & set(u.classes)), DEFAULT)


def called_like_a_denoiser(model) -> bool:
    """A module whose forward takes (sample, timestep, ...): two leading positional parameters."""
    try:
        params = list(accepted_signature(model).parameters.values())
    except (TypeError, ValueError):
        return False
    lead = [p for p in params[:2] if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(lead) == 2


class UNetAdapter(Adapter):
    """diffusers UNets, and any denoiser module called like one (the fallback family)."""

    family = "unet"
    classes = ("UNet2DConditionModel", *(c for u in UNETS for c in u.classes if c != "UNet2DConditionModel"))
    align_name = "the UNet's downsampling factor"

    def __init__(self, micro_conditioning: str | Callable = "tile", vae_scale_factor: int = 8,
                 positions: str = "global", **options):
        super().__init__(positions)  # a UNet has no positional inputs: "global" and "tile" compute the same
        if not (callable(micro_conditioning) or micro_conditioning in MICRO_CONDITIONING):
            raise ValueError(f"micro_conditioning must be one of {MICRO_CONDITIONING} or a callable, "
                             f"got {micro_conditioning!r}")
        self.micro_conditioning, self.vae_scale_factor = micro_conditioning, vae_scale_factor

    @classmethod
    def accepts(cls, model) -> bool:
        """The fallback: any module called like a UNet, except a diffusers transformer no family calls."""
        if type(model).__module__.startswith("diffusers.models.transformers."):
            return False
        return spec_of(model) is not DEFAULT or called_like_a_denoiser(model)

    def align(self, model) -> int:
        return downsampling_factor(model) * spec_of(model).patch(model.config if hasattr(model, "config")
                                                                  else None)[-1]

    def parse(self, model, args: tuple, kwargs: dict) -> Call:
        spec, name = spec_of(model), type(model).__name__
        given = bind_call(model, args, kwargs)
        names = list(accepted_signature(model).parameters)
        sample, timestep = names[0], names[1]
        for arg in (sample, timestep):
            if given.get(arg) is None:
                raise TypeError(f"TiledDenoiser.forward() for {name} needs {arg}")
        for arg, why in spec.refused.items():
            if given.get(arg) is not None:
                raise NotImplementedError(f"{name}: {arg} {why}")
        for r in _RESIDUALS:  # tensors cropped per tile, TiledControlNet outputs computed per tile
            if r in given:
                given[r] = residual_args(given.get(r), r)
        x = given[sample]
        ndim = 4 if spec.layout == "bchw" else 5
        if not isinstance(x, torch.Tensor) or x.ndim != ndim:
            want = {"bchw": "(batch, channels, height, width)",
                    "bcthw": "(batch, channels, frames, height, width)",
                    "btchw": "(batch, frames, channels, height, width)"}[spec.layout]
            raise ValueError(f"sample must be a {want} latent for {name}, got "
                             f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
        lay = GridLayout(spec, (1,) * (ndim - 2), (), config=getattr(model, "config", None))
        grid = lay.canonical(x, sample)
        lay.sides = tuple(grid.shape[2:])
        _check_channels(model, grid)
        cond = {k: (Spatial(v, k) if k in spec.spatial and v is not None else v) for k, v in given.items()
                if k not in (sample, timestep, "return_dict")}
        lay.names = sample, timestep
        return Call(grid, given[timestep], cond, return_dict=given.get("return_dict", True), layout=lay)

    def apply_region(self, cond: dict, region, n: int) -> None:
        """Replace the (conditional) prompt embeddings by the region's, per row."""
        ref = cond.get("encoder_hidden_states")
        emb = region.prompt_embeds if ref is None else region.prompt_embeds.to(ref.device, ref.dtype)
        cond["encoder_hidden_states"] = expand_rows(emb, n, "prompt_embeds")
        if region.pooled_prompt_embeds is not None:
            added = dict(cond.get("added_cond_kwargs") or {})
            pooled = region.pooled_prompt_embeds
            if "text_embeds" in added:
                pooled = pooled.to(added["text_embeds"].device, added["text_embeds"].dtype)
            added["text_embeds"] = expand_rows(pooled, n, "pooled_prompt_embeds")
            cond["added_cond_kwargs"] = added

    def predict(self, model, call: Call, x, t, cond: dict, boxes, rows: int):
        lay, hw = call.layout, tuple(call.sample.shape[-2:])
        flat = [tuple(b[-4:]) for b in boxes]  # residuals and micro-conditioning: rows and columns
        tiles = Tiles(flat, hw, lambda r, box: crop_map(r, box, hw),
                      condition=lambda kw, b, n: self._micro_conditioning(kw, b, n, hw))
        cond = evaluate(cond, tiles)  # residuals: the tiles' crops, ControlNets run on the tiles
        cond = {k: v.for_tiles(lay, boxes) if isinstance(v, PerTile) else v for k, v in cond.items()}
        self._micro_conditioning(cond, flat, rows, hw)
        sample, timestep = lay.names
        out = model(**{sample: lay.to_model(x), timestep: t}, return_dict=call.return_dict, **cond,
                    **call.shared)
        if lay.out_type is None:
            lay.out_type = type(out)
        value = out[0] if isinstance(out, (tuple, list)) else getattr(out, "sample", out)
        return lay.canonical(value, "the prediction")

    def output(self, call: Call, fused):
        lay = call.layout
        value = lay.to_model(fused)
        if not call.return_dict:
            return (value,)
        if lay.out_type is not None and not issubclass(lay.out_type, (tuple, list, torch.Tensor)):
            return lay.out_type(sample=value)
        from diffusers.models.unets.unet_2d_condition import UNet2DConditionOutput

        return UNet2DConditionOutput(sample=value)

    def _micro_conditioning(self, cond: dict, boxes, n_rows: int, hw) -> None:
        """SDXL: per-tile `time_ids` (original size, crop top-left, target size) for what the tile is."""
        added = cond.get("added_cond_kwargs")
        if not added or "time_ids" not in added or self.micro_conditioning == "pipeline":
            return
        ids = added["time_ids"]
        if ids.ndim != 2 or ids.shape[-1] != 6:
            return
        s = self.vae_scale_factor
        image_px = (hw[0] * s, hw[1] * s)
        parts = []
        for i, box in enumerate(boxes):
            rows = ids[i * n_rows : (i + 1) * n_rows]
            box_px = tuple(c * s for c in box)
            if callable(self.micro_conditioning):
                parts.append(self.micro_conditioning(rows, box_px, image_px))
            else:
                offset = torch.tensor([0, 0, box_px[0], box_px[2], 0, 0]).to(rows)
                parts.append(rows + offset)
        cond["added_cond_kwargs"] = {**added, "time_ids": torch.cat(parts)}
