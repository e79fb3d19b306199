"""The UNet adapter: diffusers' UNet2DConditionModel (SD 1.x / 2.x, SDXL) and any module with its call.

`model(sample, timestep, encoder_hidden_states, ..., return_dict=False)` on (B, C, h, w) tiles. Regions
replace `encoder_hidden_states` (and SDXL's pooled `text_embeds`); SDXL's micro-conditioning gets the
tile's crop top-left (`micro_conditioning="tile"`), the pipeline's (`"pipeline"`) or a callable's.
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

MICRO_CONDITIONING = ("tile", "pipeline")
# UNet2DConditionModel.forward's conditioning arguments after (sample, timestep), in its order
_COND = ("encoder_hidden_states", "class_labels", "timestep_cond", "attention_mask", "cross_attention_kwargs",
         "added_cond_kwargs", "down_block_additional_residuals", "mid_block_additional_residual",
         "down_intrablock_additional_residuals", "encoder_attention_mask")
_RESIDUALS = ("down_block_additional_residuals", "mid_block_additional_residual",
              "down_intrablock_additional_residuals")


def downsampling_factor(unet) -> int:
    """2 ** (number of downsampling blocks) for a diffusers UNet; 1 for a model without block_out_channels."""
    config = getattr(unet, "config", None)
    blocks = getattr(config, "block_out_channels", None) if config is not None else None
    return 2 ** (len(blocks) - 1) if blocks else 1


def _check_channels(model, sample) -> None:
    """A (B, C, h, w) sample has the UNet's in_channels (its conv_in would fail on any other C)."""
    want = getattr(getattr(model, "config", None), "in_channels", None)
    got = sample.shape[1] if getattr(sample, "ndim", 0) == 4 else None
    if isinstance(want, int) and got is not None and got != want:
        raise ValueError(f"sample has {got} channels (shape {tuple(sample.shape)}) but the UNet takes "
                         f"{want} (config.in_channels)")


class UNetAdapter(Adapter):
    """diffusers UNets, and any denoiser module called like one (the fallback family)."""

    family = "unet"
    classes = ("UNet2DConditionModel",)
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
        return not type(model).__module__.startswith("diffusers.models.transformers.")

    def align(self, model) -> int:
        return downsampling_factor(model)

    def parse(self, model, args: tuple, kwargs: dict) -> Call:
        names = ("sample", "timestep", *_COND, "return_dict")
        if len(args) > len(names):
            raise TypeError(f"TiledDenoiser.forward() takes at most {len(names)} positional arguments "
                            f"({len(args)} given)")
        given = dict(zip(names, args, strict=False))
        dup = sorted(set(given) & set(kwargs))
        if dup:
            raise TypeError(f"TiledDenoiser.forward() got multiple values for {dup}")
        given.update(kwargs)
        unknown = sorted(set(given) - set(names))
        if unknown:
            raise TypeError(f"TiledDenoiser.forward() got unexpected keyword arguments {unknown}")
        if "sample" not in given or "timestep" not in given:
            raise TypeError("TiledDenoiser.forward() needs sample and timestep")
        for r in _RESIDUALS:  # tensors cropped per tile, TiledControlNet outputs computed per tile
            given[r] = residual_args(given.get(r), r)
        _check_channels(model, given["sample"])
        cond = {k: given[k] for k in _COND if given.get(k) is not None}
        return Call(given["sample"], given["timestep"], cond, return_dict=given.get("return_dict", True))

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
        hw = tuple(call.sample.shape[-2:])
        tiles = Tiles(list(boxes), hw, lambda r, box: crop_map(r, box, hw),
                      condition=lambda kw, b, n: self._micro_conditioning(kw, b, n, hw))
        cond = evaluate(cond, tiles)  # residuals: the tiles' crops, ControlNets run on the tiles
        self._micro_conditioning(cond, boxes, rows, hw)
        out = model(x, t, return_dict=False, **cond, **call.shared)
        return out[0] if isinstance(out, (tuple, list)) else getattr(out, "sample", out)

    def output(self, call: Call, fused):
        if not call.return_dict:
            return (fused,)
        from diffusers.models.unets.unet_2d_condition import UNet2DConditionOutput

        return UNet2DConditionOutput(sample=fused)

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
