"""The Flux adapters: FluxTransformer2DModel (Flux.1, its Img2Img, Fill, Kontext), Flux2Transformer2DModel.

Both take the latent as a sequence of 2x2-patch tokens (`hidden_states` (B, S, 4C)) with one row of
rotary position ids per token (`img_ids` (S, k): Flux (t, row, col), Flux.2 (t, row, col, layer)) and
text ids beside them. The ids say where every token is: the tokens with the first id of the first token
form the latent's raster grid; the tokens after them are conditioning images (Kontext: t = 1, Flux.2
references: t = 10, 20, ...), each tiled with the latent's crop when it has the latent's grid (they ride
along as extra channels of the grid) and refused in one line otherwise. Flux Fill's masked-image
channels are part of each token and are cropped with it.

`positions="global"`: each tile's tokens keep their rows of `img_ids` (public forward, no hook);
`positions="tile"`: the ids restart at the tile's origin, as in ComfyUI's tiled nodes and Ultimate SD
Upscale. The forward takes one set of ids for the whole batch, so with global positions every tile is
its own model call.

diffusers' output classes are imported inside the methods that build them, so that importing
tilewise.diffusion does not import diffusers (~3 s).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .base import Call
from .transformer import TransformerAdapter, pack_groups, tile_tokens, unpack_groups

ROW, COL = 1, 2  # axes of img_ids that hold a token's row and column (axis 0 tells images apart)


@dataclass
class IdsLayout:
    """Where the tokens of a Flux call are: `groups` same-size h x w grids (latent first) and their ids."""

    ids: Any  # (groups * h * w, k) img_ids of the untiled call
    txt_ids: Any
    groups: int
    h: int
    w: int

    def tile_ids(self, box, positions: str):
        """The img_ids of a box's tokens, group after group: the untiled call's rows, or restarted at 0."""
        idx = tile_tokens(box, self.h, self.w)
        parts = [self.ids[g * self.h * self.w + idx.to(self.ids.device)] for g in range(self.groups)]
        ids = torch.cat(parts)
        if positions == "tile":
            ids = ids.clone()
            ids[:, ROW] -= box[0] // 2
            ids[:, COL] -= box[2] // 2
        return ids


def raster_groups(ids, name: str) -> tuple[int, int, int]:
    """(groups, h, w) of Flux img_ids: consecutive raster grids of one size (ValueError otherwise); a grid
    may start at any (row, column) (LongCat-Image numbers the image after the text)."""
    first = ids[:, 0]
    starts = [0, *(torch.nonzero(first[1:] != first[:-1]).flatten() + 1).tolist(), len(ids)]
    sizes = []
    for a, b in zip(starts, starts[1:], strict=False):
        r, c = ids[a:b, ROW].long(), ids[a:b, COL].long()
        r, c = r - r.min(), c - c.min()
        h, w = int(r.max()) + 1, int(c.max()) + 1
        grid = torch.stack(torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij"), -1).reshape(-1, 2)
        if b - a != h * w or not torch.equal(torch.stack([r, c], -1).cpu(), grid):
            raise ValueError(f"{name}: img_ids tokens {a}..{b} are not a raster grid (row, col); "
                             "TiledDenoiser reads the latent's grid from the pipeline's own img_ids")
        sizes.append((h, w, float(first[a])))
    h, w, _ = sizes[0]
    other = [(hh, ww, t) for hh, ww, t in sizes[1:] if (hh, ww) != (h, w)]
    if other:
        hh, ww, t = other[0]
        raise ValueError(f"{name}: a conditioning image (img_ids first id {t:g}) is a {hh}x{ww} token grid "
                         f"beside the {h}x{w} latent: TiledDenoiser crops a conditioning image per tile only "
                         "when it has the latent's size (give it the output's height and width; "
                         "FluxKontextPipeline: pipe(..., _auto_resize=False, max_area=height * width)) or "
                         "run the pipeline untiled")
    return len(sizes), h, w


class FluxAdapter(TransformerAdapter):
    """Flux.1 (dev, schnell, Fill, Kontext): per-row prompt, pooled and guidance; positions from img_ids."""

    family = "flux"
    classes = ("FluxTransformer2DModel",)
    pooled_arg = "pooled_projections"
    rows_args = ("encoder_hidden_states", "pooled_projections", "guidance", "controlnet_block_samples",
                 "controlnet_single_block_samples")
    residual_args = ("controlnet_block_samples", "controlnet_single_block_samples")
    layout_args = ("img_ids", "txt_ids")
    shares_positions = True

    def text_ids(self, txt_ids, n: int):
        """Text ids for n prompt tokens (a region's prompt may be longer or shorter): Flux's are zeros."""
        return txt_ids.new_zeros((n, txt_ids.shape[-1]))

    def to_grid(self, model, given: dict):
        name = type(model).__name__
        x, ids, txt_ids = given[self.sample_arg], given.get("img_ids"), given.get("txt_ids")
        if ids is None or txt_ids is None or x.ndim != 3:
            shape = tuple(x.shape) if hasattr(x, "shape") else type(x).__name__
            raise ValueError(f"{name}: TiledDenoiser needs hidden_states as (batch, tokens, channels) with "
                             "img_ids and txt_ids, as the Flux pipelines pass them; got hidden_states "
                             f"{shape}")
        ids = ids[0] if ids.ndim == 3 else ids  # (B, S, k) ids: the model reads the first row too
        txt_ids = txt_ids[0] if txt_ids.ndim == 3 else txt_ids
        if ids.shape[0] != x.shape[1]:
            raise ValueError(f"{name}: {x.shape[1]} tokens but {ids.shape[0]} rows of img_ids")
        groups, h, w = raster_groups(ids, name)
        layout = IdsLayout(ids, txt_ids, groups, h, w)
        return unpack_groups(x, groups, h, w), layout

    def _predict(self, model, call: Call, x, t, cond: dict, boxes, rows: int):
        lay = call.layout
        cond = self.tile_residuals(call, cond, boxes)
        ids = lay.tile_ids(boxes[0], self.positions)  # the boxes of one call share their ids (see predict)
        prompt = cond.get(self.prompt_arg)
        txt_ids = lay.txt_ids
        if prompt is not None and prompt.shape[1] != txt_ids.shape[0]:
            txt_ids = self.text_ids(txt_ids, prompt.shape[1])  # a region's prompt of another length
        out = model(hidden_states=pack_groups(x, lay.groups), timestep=t, img_ids=ids, txt_ids=txt_ids,
                    **cond, **self.shared_kwargs(call), return_dict=False)[0]
        h, w = x.shape[-2] // 2, x.shape[-1] // 2
        return unpack_groups(out, lay.groups, h, w)

    def output(self, call: Call, fused):
        return self.wrap(call, pack_groups(fused, call.layout.groups))


class FluxLikeAdapter(FluxAdapter):
    """Flux's token layout and ids under other names: Bria, LongCat-Image (its image ids start after the
    text's), Ovis-Image."""

    family = "flux-like"
    classes = ("BriaTransformer2DModel", "LongCatImageTransformer2DModel", "OvisImageTransformer2DModel")
    rows_args = ("encoder_hidden_states", "pooled_projections", "guidance")
    residual_args = ()
    refused = dict.fromkeys(("controlnet_block_samples", "controlnet_single_block_samples"),
                            "(this family's ControlNet residuals) are not tiled yet; run its ControlNet "
                            "pipeline untiled")


class ChromaAdapter(FluxAdapter):
    """Chroma: Flux's layout without pooled projections; an attention mask over text then image tokens."""

    family = "chroma"
    classes = ("ChromaTransformer2DModel",)
    pooled_arg = None
    rows_args = ("encoder_hidden_states", "attention_mask")
    residual_args = ()
    refused = dict.fromkeys(("controlnet_block_samples", "controlnet_single_block_samples"),
                            "(Chroma ControlNet residuals) are not tiled yet; run its pipeline untiled")

    def _predict(self, model, call: Call, x, t, cond: dict, boxes, rows: int):
        mask = cond.get("attention_mask")
        if mask is not None:  # (rows, text + image tokens): the text's part, then the tile's image tokens
            n_img = call.layout.groups * call.layout.h * call.layout.w
            n_tile = call.layout.groups * (x.shape[-2] // 2) * (x.shape[-1] // 2)
            text = mask[:, : mask.shape[1] - n_img]
            cond = {**cond, "attention_mask": torch.cat([text, text.new_ones((text.shape[0], n_tile))], 1)}
        return super()._predict(model, call, x, t, cond, boxes, rows)


class Flux2Adapter(FluxAdapter):
    """Flux.2 (dev, Klein): per-row prompt and guidance, 4-axis ids (t, row, col, layer)."""

    family = "flux2"
    classes = ("Flux2Transformer2DModel",)
    pooled_arg = None
    rows_args = ("encoder_hidden_states", "guidance")
    residual_args = ()
    refused = dict.fromkeys(("kv_cache", "kv_cache_mode"),
                            "(reference-image KV caching) is not tiled yet; run the pipeline untiled")

    def text_ids(self, txt_ids, n: int):
        """Flux.2's text ids: (0, 0, 0, l) for token l."""
        ids = txt_ids.new_zeros((n, txt_ids.shape[-1]))
        ids[:, -1] = torch.arange(n, device=ids.device).to(ids.dtype)
        return ids

    def output(self, call: Call, fused):
        tokens = pack_groups(fused, call.layout.groups)
        if not call.return_dict:
            return (tokens,)
        from diffusers.models.transformers.transformer_flux2 import Flux2Transformer2DModelOutput

        return Flux2Transformer2DModelOutput(sample=tokens)
