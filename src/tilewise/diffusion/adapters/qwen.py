"""The Qwen-Image adapter: diffusers' QwenImageTransformer2DModel (QwenImagePipeline, Img2Img, Edit).

Qwen-Image takes 2x2-packed tokens (as Flux) and `img_shapes`, per sample a list of (frame, h, w) token
grids: the latent, then any reference image (Qwen-Image-Edit), whose tokens follow the latent's. Its
rotary positions are computed inside from those sizes alone: centred on each grid (rows -h/2 .. h/2)
with the text's positions after the largest half-side. A tile called as it is gets the positions of an
image the tile's size (`positions="tile"`). The public forward cannot take a tile's place, so with
`positions="global"` a forward hook on `pos_embed` (PyTorch's public hook API; `forward` is left alone)
returns, during one tile call only, the untiled call's rotary table at the tile's tokens and the
untiled call's text positions. The table has no batch dimension: every tile is its own model call.

A reference image is cropped with the latent's tile when it has the latent's size, and refused in one
line otherwise.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from .base import Call
from .transformer import TransformerAdapter, hooked, pack_groups, tile_tokens, unpack_groups


@dataclass
class ShapesLayout:
    """`groups` same-size (1, h, w) token grids per sample (latent first), as in the untiled img_shapes."""

    shapes: list  # one sample's img_shapes of the untiled call
    groups: int
    h: int
    w: int

    def tile_shapes(self, box, n: int) -> list:
        """img_shapes of n samples of one tile: its grids, each the tile's size."""
        th, tw = (box[1] - box[0]) // 2, (box[3] - box[2]) // 2
        return [[(1, th, tw)] * self.groups for _ in range(n)]

    def tile_tokens(self, box):
        """Indices of a box's tokens in the untiled call's sequence, group after group."""
        idx = tile_tokens(box, self.h, self.w)
        return torch.cat([g * self.h * self.w + idx for g in range(self.groups)])


class QwenImageAdapter(TransformerAdapter):
    """Qwen-Image: per-row prompt and its mask; positions via a hook on the rotary embedder (global)."""

    family = "qwen-image"
    classes = ("QwenImageTransformer2DModel",)
    rows_args = ("encoder_hidden_states", "encoder_hidden_states_mask", "guidance", "additional_t_cond")
    layout_args = ("img_shapes",)
    refused = {"controlnet_block_samples": "(Qwen-Image ControlNet residuals) are spatial and are not tiled "
                                           "yet; run the ControlNet pipeline untiled"}
    shares_positions = True

    def to_grid(self, model, given: dict):
        name = type(model).__name__
        x, shapes = given[self.sample_arg], given.get("img_shapes")
        if shapes is None or x.ndim != 3:
            raise ValueError(f"{name}: TiledDenoiser needs hidden_states as (batch, tokens, channels) with "
                             "img_shapes, as the Qwen-Image pipelines pass them")
        per_sample = [list(s) if isinstance(s, (list, tuple)) and isinstance(s[0], (list, tuple)) else [s]
                      for s in shapes]
        first = [tuple(int(v) for v in s) for s in per_sample[0]]
        if any([tuple(int(v) for v in s) for s in other] != first for other in per_sample[1:]):
            raise ValueError(f"{name}: samples of one batch have different img_shapes {shapes}; "
                             "TiledDenoiser tiles one grid size per call (the model's rotary table does too)")
        f, h, w = first[0]
        differ = [s for s in first[1:] if s != (1, h, w)]
        if f != 1 or differ:
            raise ValueError(f"{name}: img_shapes {first}: TiledDenoiser crops a reference image per tile "
                             f"only when it has the latent's (1, {h}, {w}) grid (give it the output's height "
                             "and width) or run the pipeline untiled")
        if self.positions == "global" and type(model.pos_embed).__name__ != "QwenEmbedRope":
            raise ValueError(f"positions='global' is implemented for QwenEmbedRope, this {name} has "
                             f"{type(model.pos_embed).__name__}; use positions='tile'")
        layout = ShapesLayout(first, len(first), h, w)
        if x.shape[1] != len(first) * h * w:
            raise ValueError(f"{name}: {x.shape[1]} tokens but img_shapes {first} hold {len(first) * h * w}")
        return unpack_groups(x, layout.groups, h, w), layout

    def apply_region(self, cond: dict, region, n: int) -> None:
        super().apply_region(cond, region, n)
        cond.pop("encoder_hidden_states_mask", None)  # every token of the region's prompt is valid

    def _predict(self, model, call: Call, x, t, cond: dict, boxes, rows: int):
        lay = call.layout
        shapes = lay.tile_shapes(boxes[0], x.shape[0])  # the boxes of one call share one size (fusion core)
        with self._positions(model, call, boxes):
            out = model(hidden_states=pack_groups(x, lay.groups), timestep=t, img_shapes=shapes, **cond,
                        **self.shared_kwargs(call), return_dict=False)[0]
        return unpack_groups(out, lay.groups, x.shape[-2] // 2, x.shape[-1] // 2)

    def _positions(self, model, call: Call, boxes):
        """positions='global': the hook returning the untiled call's rotary table at the tile's tokens."""
        H, W = call.sample.shape[-2:]
        if self.positions == "tile" or boxes[0] == (0, H, 0, W):
            return contextlib.nullcontext()
        lay = call.layout
        idx = lay.tile_tokens(boxes[0])

        def hook(module, args, kwargs, output):
            kwargs = {**kwargs, "video_fhw": [lay.shapes]} if "video_fhw" in kwargs else kwargs
            args = ([lay.shapes], *args[1:]) if args else args
            # the embedder's own forward on the untiled img_shapes (not module(...): no hook re-entry)
            vid, txt = module.forward(*args, **kwargs)
            return vid[idx.to(vid.device)], txt

        return hooked(model.pos_embed, hook, with_kwargs=True)

    def output(self, call: Call, fused):
        return self.wrap(call, pack_groups(fused, call.layout.groups))

