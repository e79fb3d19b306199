"""ControlNet families: how a recorded ControlNet call runs on tiles, and the shape of what it returns.

A family knows, for its ControlNet classes, which argument is the latent and which are control images
(`image_args`), how many residuals the model returns and where (`outputs`, with `Deferred` leaves), and
how to call it on a batch of tiles (`run`): the rows the denoiser's call needs, each tile's crop of the
latent, of every control image (the tile's box times the image's factor over the latent: the VAE factor
for pixel images, 1 for latent control images) and the tile's positional inputs. Every other per-row
argument (prompt embeddings, pooled embeddings, SDXL's added conditioning, timesteps) gives its rows;
scales, guess mode and the like pass unchanged.

- UNet ControlNets (`ControlNetModel`, `ControlNetUnionModel` and their Multi wrappers; SD 1.x, SDXL):
  pixel control images; SDXL's crop micro-conditioning per tile, as the UNet gets it.
- SD3 (`SD3ControlNetModel`, `SD3MultiControlNetModel`): latent control images; with
  `positions="global"` each tile's crop of the ControlNet's own position table, as the transformer gets.
- Flux (`FluxControlNetModel`, `FluxMultiControlNetModel`): packed latent control tokens (or pixel images
  for ControlNets with an input hint block); each tile's rows of `img_ids`.

diffusers' output classes are imported inside the methods that build them, so that importing
tilewise.diffusion does not import diffusers (~3 s).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from ...geometry import box_slices
from ..residuals import ControlCall, Deferred, Tiles, crop_map
from ..rows import take_rows
from .flux import IdsLayout, raster_groups
from .sd3 import position_hook
from .transformer import pack, unpack


def _names(module) -> set[str]:
    return {c.__name__ for c in type(module).__mro__}


def _first_net(module):
    """The first ControlNet of a Multi wrapper, or the module itself (for the output structure)."""
    nets = getattr(module, "nets", None)
    return nets[0] if nets is not None and len(nets) else module


def _leaves(call: ControlCall, first: int, n: int) -> list[Deferred] | None:
    return [Deferred(call, (first, i)) for i in range(n)] or None


class ControlFamily:
    """The contract of a ControlNet family (see the module docstring)."""

    classes: tuple[str, ...] = ()
    sample_arg = "sample"
    image_args: tuple[str, ...] = ("controlnet_cond",)

    @classmethod
    def accepts(cls, module) -> bool:
        return bool(_names(module) & set(cls.classes))

    def batch(self, args: dict[str, Any]) -> int:
        return int(args[self.sample_arg].shape[0])

    def outputs(self, call: ControlCall):
        raise NotImplementedError

    def run(self, module, args: dict[str, Any], tiles: Tiles, rows: list[int]):
        raise NotImplementedError

    def _rows(self, args: dict, rows: list[int], tiles: Tiles, skip: tuple[str, ...]) -> dict[str, Any]:
        """Every argument but `skip` for the tiles: control images cropped, per-row values by rows."""
        B, n, idx = self.batch(args), len(tiles.boxes), torch.tensor(rows)
        kw = {}
        for name, v in args.items():
            if name in skip or name == "return_dict":
                continue
            kw[name] = self._crop_images(v, idx, B, tiles, name) if name in self.image_args else \
                take_rows(v, idx, B, n)
        return kw

    def _crop_images(self, v, idx, B: int, tiles: Tiles, name: str):
        """A control image (or a list of them, MultiControlNet) cut to every tile, rows `idx`."""
        if isinstance(v, (list, tuple)):
            return type(v)(self._crop_images(c, idx, B, tiles, name) for c in v)
        if not isinstance(v, torch.Tensor) or v.ndim != 4:
            raise ValueError(f"{name}: TiledControlNet crops a (batch, channels, height, width) control "
                             f"image per tile, got {type(v).__name__} {tuple(getattr(v, 'shape', ()))}")
        if v.shape[0] != B:
            raise ValueError(f"{name} has batch {v.shape[0]}, the ControlNet's latent {B}")
        part = v.index_select(0, idx.to(v.device))
        return torch.cat([crop_map(part, box, tiles.hw) for box in tiles.boxes])


class UNetControl(ControlFamily):
    """ControlNets of UNets (SD 1.x / 2.x, SDXL): `model(sample, timestep, ..., controlnet_cond=pixels)`."""

    classes = ("ControlNetModel", "MultiControlNetModel", "ControlNetUnionModel", "MultiControlNetUnionModel")

    def outputs(self, call: ControlCall):
        net = _first_net(call.module)
        down = _leaves(call, 0, len(net.controlnet_down_blocks))
        mid = Deferred(call, (1,))
        if call.args.get("return_dict", True) and not hasattr(call.module, "nets"):
            from diffusers.models.controlnets.controlnet import ControlNetOutput

            return ControlNetOutput(down_block_res_samples=tuple(down), mid_block_res_sample=mid)
        return down, mid

    def run(self, module, args, tiles, rows):
        sample = _checked_grid(args[self.sample_arg], tiles, type(module).__name__)
        part = sample.index_select(0, torch.tensor(rows, device=sample.device))
        x = torch.cat([part[(..., *box_slices(b))] for b in tiles.boxes])
        kw = self._rows(args, rows, tiles, skip=(self.sample_arg,))
        if tiles.condition is not None:
            tiles.condition(kw, tiles.boxes, len(rows))
        return module(x, return_dict=False, **kw)


class SD3Control(ControlFamily):
    """SD3 ControlNets: the 4D latent and a latent control image; the position table per tile."""

    classes = ("SD3ControlNetModel", "SD3MultiControlNetModel")
    sample_arg = "hidden_states"

    def outputs(self, call: ControlCall):
        blocks = _leaves(call, 0, len(_first_net(call.module).controlnet_blocks))
        if call.args.get("return_dict", True) and not hasattr(call.module, "nets"):
            from diffusers.models.controlnets.controlnet_sd3 import SD3ControlNetOutput

            return SD3ControlNetOutput(controlnet_block_samples=blocks)
        return (blocks,)

    def run(self, module, args, tiles, rows):
        name = type(module).__name__
        sample = args[self.sample_arg]
        if sample.ndim != 4 or _first_net(module).pos_embed is None:
            raise NotImplementedError(f"{name} without its own pos_embed (SD3.5 large ControlNets) takes the "
                                      "transformer's patch tokens: not tiled yet; run the pipeline untiled")
        _checked_grid(sample, tiles, name)
        part = sample.index_select(0, torch.tensor(rows, device=sample.device))
        x = torch.cat([part[(..., *box_slices(b))] for b in tiles.boxes])
        kw = self._rows(args, rows, tiles, skip=(self.sample_arg,))
        with contextlib.ExitStack() as stack:
            if tiles.positions == "global":
                for net in getattr(module, "nets", [module]):
                    _check_table(net.pos_embed, tiles.hw, name)
                    stack.enter_context(position_hook(net.pos_embed, tiles.hw, tiles.boxes, len(rows)))
            return module(hidden_states=x, return_dict=False, **kw)


def _check_table(patch_embed, hw, name: str) -> None:
    M, p = patch_embed.pos_embed_max_size, patch_embed.patch_size
    if M is None or hw[0] // p > M or hw[1] // p > M:
        raise ValueError(f"positions='global': {name}'s position table covers {M}x{M} patches "
                         f"(pos_embed_max_size), the latent is {hw[0] // p}x{hw[1] // p}; "
                         "use positions='tile'")


class FluxControl(ControlFamily):
    """Flux ControlNets: packed latent tokens with img_ids; packed control tokens or pixel images."""

    classes = ("FluxControlNetModel", "FluxMultiControlNetModel")
    sample_arg = "hidden_states"

    def outputs(self, call: ControlCall):
        net = _first_net(call.module)
        blocks = _leaves(call, 0, len(net.controlnet_blocks))
        single = _leaves(call, 1, len(net.controlnet_single_blocks))
        if call.args.get("return_dict", True) and not hasattr(call.module, "nets"):
            from diffusers.models.controlnets.controlnet_flux import FluxControlNetOutput

            return FluxControlNetOutput(controlnet_block_samples=blocks,
                                        controlnet_single_block_samples=single)
        return blocks, single

    def run(self, module, args, tiles, rows):
        name = type(module).__name__
        ids = args.get("img_ids")
        x = args[self.sample_arg]
        if ids is None or x.ndim != 3:
            raise ValueError(f"{name}: TiledControlNet needs hidden_states as (batch, tokens, channels) with "
                             "img_ids, as the Flux ControlNet pipelines pass them")
        ids = ids[0] if ids.ndim == 3 else ids
        groups, h, w = raster_groups(ids, name)
        lay = IdsLayout(ids, args.get("txt_ids"), groups, h, w)
        if groups != 1 or (2 * h, 2 * w) != tuple(tiles.hw):
            raise ValueError(f"{name}: its latent is a {2 * h}x{2 * w} grid in {groups} group(s), the "
                             f"denoiser's {tiles.hw[0]}x{tiles.hw[1]}")
        idx = torch.tensor(rows, device=x.device)
        kw = self._rows(args, rows, tiles, skip=(self.sample_arg, "img_ids", "txt_ids", "controlnet_cond"))
        if "txt_ids" in args:
            kw["txt_ids"] = args["txt_ids"]
        kw["controlnet_cond"] = self._tokens_or_images(args["controlnet_cond"], idx, tiles, lay, name)
        boxes = tiles.boxes
        shapes = {(b[1] - b[0], b[3] - b[2]) for b in boxes}
        if len(boxes) > 1 and (tiles.positions == "global" or len(shapes) > 1):
            raise ValueError(f"{name}: tiles at different places share no img_ids; call it one tile at a "
                             "time")
        grid = unpack(x.index_select(0, idx), h, w)
        tokens = torch.cat([pack(grid[(..., *box_slices(b))]) for b in boxes])
        ids = lay.tile_ids(boxes[0], tiles.positions)
        return module(hidden_states=tokens, img_ids=ids, return_dict=False, **kw)

    def _tokens_or_images(self, v, idx, tiles: Tiles, lay: IdsLayout, name: str):
        if isinstance(v, (list, tuple)):
            return type(v)(self._tokens_or_images(c, idx, tiles, lay, name) for c in v)
        if v.ndim == 4:  # pixel control image (ControlNets with an input hint block)
            return self._crop_images(v, idx, v.shape[0], tiles, name)
        grid = unpack(v.index_select(0, idx.to(v.device)), lay.h, lay.w)
        return torch.cat([pack(grid[(..., *box_slices(b))]) for b in tiles.boxes])


def _checked_grid(sample, tiles: Tiles, name: str):
    if sample.ndim != 4 or tuple(sample.shape[-2:]) != tuple(tiles.hw):
        raise ValueError(f"{name} was called on a latent of shape {tuple(sample.shape)}, the denoiser on a "
                         f"{tiles.hw[0]}x{tiles.hw[1]} latent: TiledControlNet needs the ControlNet and the "
                         "denoiser on the same latent grid")
    return sample


CONTROL_FAMILIES: list[type[ControlFamily]] = [UNetControl, SD3Control, FluxControl]


def control_family(module) -> ControlFamily:
    """The family of a ControlNet module; ValueError naming the supported classes otherwise."""
    for cls in CONTROL_FAMILIES:
        if cls.accepts(module):
            return cls()
    supported = ", ".join(c for cls in CONTROL_FAMILIES for c in cls.classes)
    raise ValueError(f"TiledControlNet cannot wrap a {type(module).__name__}: supported ControlNet classes "
                     f"are {supported}")
