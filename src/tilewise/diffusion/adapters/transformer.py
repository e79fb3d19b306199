"""What the transformer families share: forward's arguments by name, refusals, per-tile calls, token packing.

A transformer family's adapter (sd3, flux, qwen, zimage) declares which forward arguments are per-row
conditioning (`rows_args`), which describe the token layout (`layout_args`, read by `to_grid`) and which
it refuses (`refused`, when given); everything else passes to every tile unchanged. `to_grid` turns the
pipeline's input into the (B, C, H, W) latent grid in latent pixels, `_predict` calls the model on a
batch of tiles of that grid, `from_grid` packs the fused prediction back as the model returns it.

Families whose forward takes one positional input for the whole batch (rotary position ids without a
batch dimension: Flux, Flux.2, Qwen-Image) set `shares_positions`: with `positions="global"` tiles at
different places cannot share a call, so each tile is its own model call (its rows batched); with
`positions="tile"` every tile of one size has the same positions and the tiles are batched.

diffusers' output classes are imported inside the methods that build them, so that importing
tilewise.diffusion does not import diffusers (~3 s).
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any

import torch

from ..residuals import Selected, Tiles, evaluate, residual_args
from .base import Adapter, Call, expand_rows


def accepted_signature(model) -> inspect.Signature:
    """The signature of what the model accepts: its forward's, or, when the instance's `forward` was replaced
    by a wrapper taking (*args, **kwargs) (an offloading or profiling hook), the class's own forward's."""
    sig = inspect.signature(model.forward)
    kinds = {p.kind for p in sig.parameters.values()}
    if sig.parameters and kinds <= {inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD}:
        own = inspect.signature(inspect.unwrap(type(model).forward))
        return own.replace(parameters=list(own.parameters.values())[1:])  # without self
    return sig


def bind_call(model, args: tuple, kwargs: dict, who: str = "TiledDenoiser") -> dict[str, Any]:
    """The call's arguments by the names of what the model accepts (TypeError naming what is wrong)."""
    try:
        bound = accepted_signature(model).bind(*args, **kwargs)
    except TypeError as e:
        raise TypeError(f"{who}.forward() for {type(model).__name__}: {e}") from None
    return dict(bound.arguments)


def rows_of(value: Any, i: int, rows: int, n: int) -> Any:
    """Tile i's rows of a per-row value (tensors whose leading dim is n = tiles x rows), recursively."""
    if isinstance(value, torch.Tensor):
        return value[i * rows : (i + 1) * rows] if value.ndim >= 1 and value.shape[0] == n else value
    if isinstance(value, Selected):
        return value.one_tile()
    if isinstance(value, dict):
        return {k: rows_of(v, i, rows, n) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(rows_of(v, i, rows, n) for v in value)
    return value


def unpack(tokens, h: int, w: int, p: int = 2):
    """(B, h*w, C*p*p) patch tokens in raster order -> (B, C, h*p, w*p) grid (Flux's `_unpack_latents`)."""
    B, S, D = tokens.shape
    if S != h * w or D % (p * p):
        raise ValueError(f"{S} tokens of width {D} are not a {h}x{w} grid of {p}x{p} patches")
    return tokens.view(B, h, w, D // (p * p), p, p).permute(0, 3, 1, 4, 2, 5).reshape(B, -1, h * p, w * p)


def pack(grid, p: int = 2):
    """(B, C, H, W) grid -> (B, (H/p)*(W/p), C*p*p) patch tokens in raster order (Flux's `_pack_latents`)."""
    B, C, H, W = grid.shape
    return grid.reshape(B, C, H // p, p, W // p, p).permute(0, 2, 4, 1, 3, 5).reshape(B, -1, C * p * p)


def unpack_groups(tokens, groups: int, h: int, w: int, p: int = 2):
    """A sequence of `groups` same-size token grids (latent, then conditioning images) as channel blocks."""
    return torch.cat([unpack(g, h, w, p) for g in tokens.split(h * w, dim=1)[:groups]], dim=1)


def pack_groups(grid, groups: int, p: int = 2):
    """The inverse of `unpack_groups`: channel blocks back to one token sequence, group after group."""
    return torch.cat([pack(g, p) for g in grid.chunk(groups, dim=1)], dim=1)


def tile_tokens(box, h: int, w: int, p: int = 2):
    """Raster indices, in an h x w token grid, of the tokens of a latent-pixel box aligned to p."""
    y0, y1, x0, x1 = (c // p for c in box)
    return (torch.arange(y0, y1)[:, None] * w + torch.arange(x0, x1)[None, :]).flatten()


@contextlib.contextmanager
def hooked(module, hook, *, pre: bool = False, with_kwargs: bool = False):
    """A forward (pre-)hook on `module` for the duration of one model call, run before any other hook."""
    register = module.register_forward_pre_hook if pre else module.register_forward_hook
    handle = register(hook, prepend=True, with_kwargs=with_kwargs)
    try:
        yield
    finally:
        handle.remove()


class TransformerAdapter(Adapter):
    """The part of a transformer family's adapter that reads like every other (see the module docstring)."""

    align_name = "the transformer's patch side in latent pixels,"
    sample_arg = "hidden_states"
    timestep_arg = "timestep"
    prompt_arg = "encoder_hidden_states"
    pooled_arg: str | None = None
    rows_args: tuple[str, ...] = ()
    residual_args: tuple[str, ...] = ()  # ControlNet residual tokens (of rows_args): per tile
    layout_args: tuple[str, ...] = ()
    refused: dict[str, str] = {}
    shares_positions = False

    def align(self, model) -> int:
        return 2  # every family here patchifies (or packs) 2x2 latent pixels into one token

    def parse(self, model, args: tuple, kwargs: dict) -> Call:
        name = type(model).__name__
        given = bind_call(model, args, kwargs)
        for arg, why in self.refused.items():
            if given.get(arg) is not None:
                raise NotImplementedError(f"{name}: {arg} {why}")
        for arg in (self.sample_arg, self.timestep_arg):
            if given.get(arg) is None:
                raise TypeError(f"TiledDenoiser.forward() for {name} needs {arg}")
        for arg in self.residual_args:  # tensors: token crops per tile; TiledControlNet outputs: run per tile
            given[arg] = residual_args(given.get(arg), arg)
        grid, layout = self.to_grid(model, given)
        # per row: the family's conditioning, and attention kwargs dicts (IP-Adapter image embeddings,
        # ip_adapter_image_embeds, are a conditioning every tile gets, at its call's rows)
        cond = {k: v for k, v in given.items()
                if v is not None and (k in self.rows_args or isinstance(v, dict))}
        skip = {self.sample_arg, self.timestep_arg, "return_dict", *cond, *self.layout_args}
        shared = {k: v for k, v in given.items() if k not in skip and v is not None}
        return Call(grid, given[self.timestep_arg], cond, shared, return_dict=given.get("return_dict", True),
                    layout=layout)

    def apply_region(self, cond: dict, region, n: int) -> None:
        """Replace the (conditional) prompt embeddings by the region's, per row (and the pooled ones)."""
        ref = cond.get(self.prompt_arg)
        emb = region.prompt_embeds if ref is None else region.prompt_embeds.to(ref.device, ref.dtype)
        cond[self.prompt_arg] = expand_rows(emb, n, "prompt_embeds")
        if region.pooled_prompt_embeds is not None and self.pooled_arg is not None:
            ref = cond.get(self.pooled_arg)
            pooled = region.pooled_prompt_embeds
            pooled = pooled if ref is None else pooled.to(ref.device, ref.dtype)
            cond[self.pooled_arg] = expand_rows(pooled, n, "pooled_prompt_embeds")

    def predict(self, model, call: Call, x, t, cond: dict, boxes, rows: int):
        n = len(boxes)
        if not (self.shares_positions and self.positions == "global" and n > 1):
            return self._predict(model, call, x, t, cond, boxes, rows)
        N = x.shape[0]  # one call per tile: the model takes one set of positions for its whole batch
        return torch.cat([self._predict(model, call, x[i * rows : (i + 1) * rows], rows_of(t, i, rows, N),
                                        rows_of(cond, i, rows, N), boxes[i : i + 1], rows) for i in range(n)])

    def tile_residuals(self, call: Call, cond: dict, boxes, patch: int = 2) -> dict:
        """`cond` with its residual tokens for the tiles: crops of tensors, TiledControlNet outputs run."""
        H, W = call.sample.shape[-2:]
        h, w = H // patch, W // patch

        def crop(r, box):
            if r.ndim != 3 or r.shape[1] != h * w:
                raise ValueError(f"a ControlNet residual of shape {tuple(r.shape)} is not (batch, {h * w} "
                                 f"tokens, channels) of the {H}x{W} latent")
            return r[:, tile_tokens(box, h, w, patch).to(r.device)]

        return evaluate(cond, Tiles(list(boxes), (H, W), crop, positions=self.positions))

    def shared_kwargs(self, call: Call) -> dict[str, Any]:
        """The arguments every tile gets unchanged, dicts copied (forwards pop from their kwargs dicts)."""
        return {k: dict(v) if isinstance(v, dict) else v for k, v in call.shared.items()}

    def wrap(self, call: Call, value):
        """The prediction as the model returns it: a tuple, or diffusers' `Transformer2DModelOutput`."""
        if not call.return_dict:
            return (value,)
        import diffusers.models.modeling_outputs as outputs

        return outputs.Transformer2DModelOutput(sample=value)

    # family specifics ----------------------------------------------------------------------------------
    def to_grid(self, model, given: dict) -> tuple[Any, Any]:
        """(the (B, C, H, W) latent grid, the layout that packs a prediction back)."""
        raise NotImplementedError

    def _predict(self, model, call: Call, x, t, cond: dict, boxes, rows: int):
        raise NotImplementedError
