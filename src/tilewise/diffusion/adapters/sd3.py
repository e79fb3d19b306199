"""The SD3 adapter: diffusers' SD3Transformer2DModel (StableDiffusion3Pipeline and its Img2Img).

SD3 takes the (B, C, H, W) latent itself and patchifies it 2x2; its position embedding is a fixed
`pos_embed_max_size`^2 table of which `PatchEmbed` adds the *centred* crop of the input's size. A tile
called as it is therefore gets the centre of the table, whatever its place in the image
(`positions="tile"`, what ComfyUI's tiled nodes give SD3). With `positions="global"` each tile gets the
crop at its place inside the whole latent's centred crop: exactly the embedding its tokens have untiled.
The public forward takes no positions, so a forward hook on `pos_embed` (PyTorch's public hook API; the
model's `forward` is left alone) replaces, during one tile call only, the crop it added by that crop.
Global positions exist only where the whole latent fits the table (`pos_embed_max_size` patches a side).
"""

from __future__ import annotations

import contextlib

import torch

from .base import Call
from .transformer import TransformerAdapter, hooked


def global_pos_embed(patch_embed, hw: tuple[int, int], boxes, rows: int):
    """(tiles x rows, tokens, D): the embedding each tile's tokens have in the whole H x W latent's crop."""
    M, p = patch_embed.pos_embed_max_size, patch_embed.patch_size
    top, left = (M - hw[0] // p) // 2, (M - hw[1] // p) // 2
    table = patch_embed.pos_embed.reshape(M, M, -1)
    crops = [table[top + y0 // p : top + y1 // p, left + x0 // p : left + x1 // p].flatten(0, 1)
             for y0, y1, x0, x1 in boxes]
    return torch.stack(crops).repeat_interleave(rows, dim=0)


def position_hook(patch_embed, hw: tuple[int, int], boxes, rows: int):
    """A forward hook on `patch_embed` (an SD3 PatchEmbed) for one call on tiles `boxes` of the H x W latent:
    each tile's tokens get their crop of the whole latent's position embedding (none needed for one tile
    covering the latent, which has it already)."""
    H, W = hw
    if all(tuple(b) == (0, H, 0, W) for b in boxes):
        return contextlib.nullcontext()
    g = global_pos_embed(patch_embed, (H, W), boxes, rows)

    def hook(module, args, output):
        # PatchEmbed added the centred crop of the tile's size: swap it for the tile's crop of the image's
        local = module.cropped_pos_embed(*args[0].shape[-2:])
        return output + (g.to(output.device) - local).to(output.dtype)

    return hooked(patch_embed, hook)


class SD3Adapter(TransformerAdapter):
    """SD3 / SD3.5: per-row prompt and pooled embeddings; the tile's crop of the position table."""

    family = "sd3"
    classes = ("SD3Transformer2DModel",)
    pooled_arg = "pooled_projections"
    rows_args = ("encoder_hidden_states", "pooled_projections", "block_controlnet_hidden_states")
    residual_args = ("block_controlnet_hidden_states",)

    def align(self, model) -> int:
        return int(model.config.patch_size)

    def to_grid(self, model, given: dict):
        x = given[self.sample_arg]
        if x.ndim != 4:
            raise ValueError(f"SD3Transformer2DModel takes a (batch, channels, height, width) latent, got "
                             f"{tuple(x.shape)}")
        if self.positions == "global":
            M, p = model.pos_embed.pos_embed_max_size, model.pos_embed.patch_size
            H, W = x.shape[-2:]
            if M is None or H // p > M or W // p > M:
                raise ValueError(f"positions='global': SD3Transformer2DModel's position table covers "
                                 f"{M}x{M} patches (pos_embed_max_size), the latent is {H // p}x{W // p}: "
                                 "its tokens have no position beyond the table; use positions='tile' (each "
                                 "tile gets the centred crop of its own size) or a smaller image")
        return x, None

    def _predict(self, model, call: Call, x, t, cond: dict, boxes, rows: int):
        cond = self.tile_residuals(call, cond, boxes, int(model.config.patch_size))
        with self._positions(model, call, boxes, rows):
            out = model(hidden_states=x, timestep=t, **cond, **self.shared_kwargs(call), return_dict=False)
        return out[0]

    def _positions(self, model, call: Call, boxes, rows: int):
        """positions='global': the hook that gives each tile its crop of the image's position embedding."""
        if self.positions == "tile":
            return contextlib.nullcontext()
        return position_hook(model.pos_embed, call.sample.shape[-2:], boxes, rows)

    def output(self, call: Call, fused):
        return self.wrap(call, fused)

