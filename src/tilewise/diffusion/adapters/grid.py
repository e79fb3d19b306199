"""The declared transformer families: one `Spec` (a table entry in `families.py`) says how a model is tiled.

A `Spec` says, for a diffusers transformer whose forward takes the latent itself (image (B, C, H, W),
video (B, C, T, H, W) or (B, T, C, H, W)) or its tokens with their grid sizes (LTX-Video): the names
of the sample, timestep and prompt arguments, the patch per axis, which other inputs lie on the latent's
grid (`spatial`: cropped with the tile, at their own resolution) or hold one entry per image token
(`tokens`: positions the pipeline computed, per-token timesteps: the tile's entries), where the model
computes positions from the latent's shape (`sources`, hooked per tile: `adapters.positions`) and what
it refuses. Every other argument is per-row conditioning (a tensor whose leading dim is the batch) or
goes to every tile unchanged. `GridAdapter` runs any such entry: the fusion core sees the latent as a
(B, C, [T,] H, W) grid in latent pixels and gets predictions back on it.

`fill` makes what the model would make for the whole latent when the call passes none (LTX-2's
video_coords, from its rope), so that tiles take theirs from it. `stream` names a second output that is not
on the grid (LTX-2's audio, which attends every video token): every tile call gets the whole audio input
and predicts it, and the output is the tiles' mean (option `audio="mean"`, an approximation exact with one
tile or when the stream sees no video, `isolate_modalities=True`; `audio="exact"` refuses the rest).

With `positions="global"`, positions computed inside the model or passed without a batch dimension are
one set per call, so each tile is its own model call (its rows batched); `positions="tile"`: tokens
numbered as a tile's own (the model computes them for the tile's size; passed positions are the
untiled call's at the tile placed at the origin), tiles batched.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from . import joint
from .base import Call
from .inputs import AxisPositions, Frames, PerTile, RowsAt, Spatial, Tokens
from .positions import Geometry, method_inputs, module_hooks, take_tokens, token_index
from .spec import LAYOUTS, Spec
from .transformer import TransformerAdapter, bind_call

AUDIO = ("mean", "exact")  # a stream output (LTX-2's audio): the tiles' mean, or refused unless exact

__all__ = ["AxisPositions", "Frames", "GridAdapter", "GridLayout", "PerTile", "RowsAt", "Spatial", "Spec",
           "Tokens"]


@dataclass
class GridLayout:
    """How one call's sample maps to the (B, C, [T,] H, W) grid and back, and what its tiles need."""

    spec: Spec
    patch: tuple[int, ...]
    sides: tuple[int, ...]  # the grid's ([T,] H, W) in latent pixels
    cache: dict = field(default_factory=dict)  # untiled positions, computed once per call
    out_type: Any = None
    names: tuple[str, ...] = ()  # the model's sample and timestep arguments (UNets)
    config: Any = None  # the model's config (a resampled input's patch)
    prefix_out: Any = None  # a joint sequence's output before the target's tokens (`adapters.joint`)
    stream_sum: Any = None  # a stream output (`Spec.stream`): the sum of the tile calls' predictions
    stream_n: int = 0  # how many tile calls (each on all rows) it sums

    @property
    def post(self) -> tuple[int, ...]:
        return tuple(-(-s // p) for s, p in zip(self.sides, self.patch, strict=True))

    @property
    def n_tokens(self) -> int:
        n = 1
        for s in self.post:
            n *= s
        return n

    def tile_tokens(self, box) -> torch.Tensor:
        return token_index(box, self.sides, self.patch)

    def canonical(self, v, name: str, sides: tuple[int, ...] | None = None):
        """A tensor in the model's layout as a (B, C, [T,] H, W) grid (tokens: of `sides`, by default the
        whole latent's)."""
        layout = self.spec.layout
        if layout == "btchw":
            return v.transpose(1, 2)
        if layout == "bthwc":
            return v.permute(0, 4, 1, 2, 3)
        if layout == "tokens":
            B, S, D = v.shape
            post = tuple(-(-s // a) for s, a in zip(sides or self.sides, self.patch, strict=True))
            if S != math.prod(post):
                raise ValueError(f"{name}: {S} tokens, but the sizes given make {post}")
            k, c = len(post), D // math.prod(self.patch)
            g = v.reshape(B, *post, c, *self.patch)
            g = g.permute(0, k + 1, *(a for i in range(k) for a in (1 + i, k + 2 + i)))
            return g.reshape(B, c, *(n * p for n, p in zip(post, self.patch, strict=True)))
        return v

    def to_model(self, grid):
        """A (B, C, [T,] H, W) grid in the model's layout (tokens: packed as the pipeline packs them)."""
        layout = self.spec.layout
        if layout == "btchw":
            return grid.transpose(1, 2)
        if layout == "bthwc":
            return grid.permute(0, 2, 3, 4, 1)
        if layout == "tokens":
            B, C, *sides = grid.shape
            post = [n // p for n, p in zip(sides, self.patch, strict=True)]
            k = len(post)
            g = grid.reshape(B, C, *(a for n, p in zip(post, self.patch, strict=True) for a in (n, p)))
            g = g.permute(0, *(2 + 2 * i for i in range(k)), 1, *(3 + 2 * i for i in range(k)))
            return g.reshape(B, math.prod(post), C * math.prod(self.patch))
        return grid

    def geometry(self, grid, box) -> Geometry:
        """The hook geometry of one tile call on `grid` (the tile's grid) at `box`."""
        sample = self.to_model(grid)
        whole = list(sample.shape)
        axes = LAYOUTS[self.spec.layout]
        if self.spec.layout == "tokens":
            whole[1] = self.n_tokens
        else:
            for a, s in zip(axes, self.sides, strict=True):
                whole[a] = s
        return Geometry(tuple(whole), axes, self.post, self.tile_tokens(box), self.n_tokens)


class GridAdapter(TransformerAdapter):
    """A transformer family declared by a `Spec` (see the module docstring)."""

    def __init__(self, spec: Spec, positions: str = "global", audio: str = "mean", **options: Any) -> None:
        super().__init__(positions)  # micro_conditioning, vae_scale_factor: other families' options
        if audio not in AUDIO:
            raise ValueError(f"audio={audio!r}: expected one of {AUDIO}")
        self.audio = audio
        self.spec, self.family, self.classes = spec, spec.family, spec.classes
        self.sample_arg, self.timestep_arg, self.prompt_arg = spec.sample, spec.timestep, spec.prompt
        self.pooled_arg, self.refused = spec.pooled, spec.refused
        unbatched = (set(spec.tokens) - set(spec.batched_tokens)) | ({spec.axis_positions} - {None})
        # one set of positions per model call: tiles at different places each get their own call
        inside = positions == "global" and bool(spec.sources or unbatched)
        self.shares_positions = spec.one_call_per_tile or inside
        if spec.stream is not None:
            self.no_regions = ("its audio stream is predicted with the whole prompt's video; a region's "
                               "prompt would predict another audio for its rows")
        if spec.joint is not None:
            self.no_regions = ("its prompt is a vision-language sequence whose slots and mask (img_mask) "
                               "belong to that prompt; a region's embeddings have neither")

    def align(self, model) -> int:
        return int(self.spec.align or self.spec.patch(model.config)[-1])

    def frame_align(self, model) -> int:
        p = self.spec.patch(model.config)
        return int(p[0]) if len(p) == 3 else 1

    def frames_refused(self, model, call: Call | None = None) -> str | None:
        if self.spec.refuse_frames is None:
            return None
        inputs = None if call is None else {k: getattr(v, "value", v) for k, v in call.cond.items()}
        return self.spec.refuse_frames(model.config, inputs)

    def parse(self, model, args: tuple, kwargs: dict) -> Call:
        name, spec = type(model).__name__, self.spec
        given = bind_call(model, args, kwargs)
        self.refuse(name, given)
        if spec.fill is not None:  # what the model would make for the whole latent, made so
            given.update({k: v for k, v in spec.fill(model, given).items() if given.get(k) is None})
        x = given[spec.sample]
        ndim = {"bchw": 4, "tokens": 3}.get(spec.layout, 5)
        if not isinstance(x, torch.Tensor) or x.ndim != ndim:
            shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"{name}: TiledDenoiser tiles {spec.sample} as its pipeline passes it, a "
                             f"{ndim}-D tensor ({spec.layout}); got {shape}")
        post, per_tile = None, {}
        if spec.joint is not None:  # the target's tokens; the rest of the sequence kept for every tile
            x, post, per_tile = joint.split(spec.joint, spec.sample, given, x, name)
        lay = self._layout(model, given, x, post)
        grid = lay.canonical(x, spec.sample)
        lay.sides = tuple(grid.shape[2:])
        cond = dict(per_tile)
        for k, v in given.items():
            if k in (spec.sample, spec.timestep, "return_dict", *spec.sizes, *per_tile) or v is None:
                continue
            if k in spec.spatial:
                v = Spatial(v, k)
            elif k in spec.tokens:
                v = Tokens(v, k, axis=spec.tokens[k], batched=k in spec.batched_tokens)
            elif k in spec.frames:
                v = Frames(v, k, axis=spec.frames[k])
            elif k in spec.rows_at:
                v = RowsAt(v, k, axis=spec.rows_at[k])
            cond[k] = v
        if spec.axis_positions:  # the pipeline's, or those the model makes for the whole latent
            pos = given.get(spec.axis_positions)
            if pos is None:
                pos = tuple(torch.arange(n, device=x.device) for n in lay.post)
            cond[spec.axis_positions] = AxisPositions(pos, spec.axis_positions)
        return Call(grid, given[spec.timestep], cond, return_dict=given.get("return_dict", True), layout=lay)

    def refuse(self, name: str, given: dict) -> None:
        """The arguments this family refuses, and those TransformerAdapter.parse checks (sample, timestep)."""
        for arg, why in self.refused.items():
            if given.get(arg) is not None:
                raise NotImplementedError(f"{name}: {arg} {why}")
        for arg in (self.sample_arg, self.timestep_arg):
            if given.get(arg) is None:
                raise TypeError(f"TiledDenoiser.forward() for {name} needs {arg}")

    def _layout(self, model, given: dict, x, post=None) -> GridLayout:
        patch = tuple(int(p) for p in self.spec.patch(model.config))
        if self.spec.layout == "tokens" and post is not None:  # a joint sequence's target grid
            post = post[-len(patch):]
            return GridLayout(self.spec, patch, tuple(s * p for s, p in zip(post, patch, strict=True)))
        if self.spec.layout == "tokens":
            post = [given.get(s) for s in self.spec.sizes]
            if any(not isinstance(s, int) for s in post):
                raise ValueError(f"{type(model).__name__}: TiledDenoiser needs {self.spec.sizes} as ints "
                                 f"with {self.spec.sample} (its pipeline passes them), got {post}")
            sides = tuple(s * p for s, p in zip(post, patch, strict=True))
            return GridLayout(self.spec, patch, sides)
        axes = LAYOUTS[self.spec.layout]
        if len(patch) != len(axes):
            patch = patch[-len(axes):]
        return GridLayout(self.spec, patch, tuple(x.shape[a] for a in axes))

    def _predict(self, model, call: Call, x, t, cond: dict, boxes, rows: int):
        lay, spec = call.layout, self.spec
        kw = {}
        for k, v in cond.items():
            kw[k] = v.for_tiles(lay, boxes, self.positions) if isinstance(v, PerTile) else v
        t = self._tile_timestep(lay, t, boxes)
        if spec.sizes:
            kw.update(zip(spec.sizes, (-(-s // p) for s, p in zip(x.shape[2:], lay.patch, strict=True)),
                          strict=True))
        prefix = kw.pop(spec.sample, None)  # a joint sequence's tokens before the target's
        inputs = {spec.sample: lay.to_model(x)}
        n = inputs[spec.sample].shape[1]
        if prefix is not None:
            inputs[spec.sample] = torch.cat([prefix, inputs[spec.sample]], dim=1)
        if spec.method is not None and self._global(lay, boxes):  # the model's method, the whole's positions
            geos = [lay.geometry(x[:1], b) for b in boxes]
            inputs = method_inputs(model, spec.method, inputs[spec.sample], geos, lay.cache)
        with self._positions(model, lay, x, boxes):
            out = model(**inputs, **{spec.timestep: t}, **kw, return_dict=call.return_dict)
        if lay.out_type is None:
            lay.out_type = type(out)
        if spec.stream is not None:
            self._stream(lay, out, kw, boxes, rows, call.sample.shape[0])
        if not isinstance(out, torch.Tensor):  # Kandinsky 5 returns its prediction bare
            out = out[0] if isinstance(out, tuple) else out.sample
        if spec.joint is not None:
            out = joint.target(lay, out, n, rows, call.sample.shape[0])
        return lay.canonical(out, "the prediction", x.shape[2:])

    def _stream(self, lay: GridLayout, out, kw: dict, boxes, rows: int, batch: int) -> None:
        """Sum a stream output (`Spec.stream`) of tile calls on all rows, one per tile, for `output`."""
        st = self.spec.stream
        exact = bool(kw.get(st.exact_when)) if st.exact_when else False
        whole = tuple(c for side in lay.sides for c in (0, side))
        if self.audio == "exact" and not exact and any(tuple(b) != whole for b in boxes):
            raise NotImplementedError(
                f"audio='exact': {st.name} attends every video token, which no tile of {lay.sides} holds "
                f"(tile {boxes[0]}); use one tile covering the latent, {st.exact_when}=True, or "
                "audio='mean' (the tiles' predictions averaged, an approximation)")
        if rows != batch:  # a probe on fewer rows: not a prediction of the call's
            return
        value = out[st.index] if isinstance(out, tuple) else getattr(out, st.name)
        total = value.reshape(len(boxes), rows, *value.shape[1:]).sum(0)
        lay.stream_sum = total if lay.stream_sum is None else lay.stream_sum + total
        lay.stream_n += len(boxes)

    def _tile_timestep(self, lay: GridLayout, t, boxes):
        """Per-token timesteps at the tiles' tokens, per-frame ones for their frame window."""
        spec = self.spec
        if not isinstance(t, torch.Tensor) or t.ndim < 2:
            return t
        n = len(boxes)
        parts = t.chunk(n)  # the fusion core repeated the call's rows for every tile
        if spec.timestep in spec.tokens and t.shape[spec.tokens[spec.timestep]] == lay.n_tokens:
            a = spec.tokens[spec.timestep]
            return torch.cat([take_tokens(p, lay.tile_tokens(b), a, lay.n_tokens, spec.timestep)
                              for p, b in zip(parts, boxes, strict=True)])
        if spec.timestep in spec.frames and len(lay.sides) == 3:
            a = spec.frames[spec.timestep]
            if t.shape[a] == lay.sides[0]:
                return torch.cat([p.narrow(a, b[0], b[1] - b[0]) for p, b in zip(parts, boxes, strict=True)])
        return t

    def _global(self, lay: GridLayout, boxes) -> bool:
        """Whether the tiles' positions differ from those the model computes for them: positions='global'
        and some tile is not the whole latent."""
        whole = tuple(c for s in lay.sides for c in (0, s))
        return self.positions == "global" and any(tuple(b) != whole for b in boxes)

    def _positions(self, model, lay: GridLayout, x, boxes):
        """positions='global' with positions computed inside the model: the sources' hooks for one tile."""
        if not self.spec.sources or not self._global(lay, boxes):
            return contextlib.nullcontext()
        return module_hooks(model, self.spec.sources, lay.geometry(x, boxes[0]), lay.cache)

    def output(self, call: Call, fused):
        lay = call.layout
        value = lay.to_model(fused)
        if self.spec.joint is not None:
            value = joint.with_prefix(lay, value)
        if issubclass(lay.out_type, torch.Tensor):
            return value
        extra = {}
        if self.spec.stream is not None:  # the tiles' mean (with one tile: its own prediction)
            s = lay.stream_sum if lay.stream_n == 1 else lay.stream_sum / lay.stream_n
            extra[self.spec.stream.name] = s
        if not call.return_dict:
            return (value, *extra.values())
        return lay.out_type(sample=value, **extra)
