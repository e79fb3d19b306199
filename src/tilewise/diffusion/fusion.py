"""TiledDenoiser: predict on latent tiles, fuse into one prediction, let the pipeline's scheduler step it.

The fusion core: pieces (`pieces`), weights, conditioning rows and regions, batching, sharding over
ranks, accumulation. How the wrapped model is called on a tile is its family's adapter (`adapters`):
the core never names a model argument.

Methods (one signature, variant options after it):
- "multidiffusion": uniform average over overlapping windows (Bar-Tal et al. 2023, MultiDiffusion eq. 5).
- "mixture": Gaussian tile weights centred at ((h-1)/2, (w-1)/2), variance `var` in units of the tile side
  (Jiménez 2023, Mixture of Diffusers).
- "spot": SpotDiffusion (Frolov et al. 2024): non-overlapping windows whose partition is shifted every
  call by an offset drawn from (seed, timestep). No wrap-around: the shifted partition's cut edge cells
  are computed on a full tile placed inside the image and only their own cells are kept.
- "halo": each tile is computed on its core plus `halo` latent pixels and only the core is kept; exact
  for denoisers whose receptive field radius is <= halo (conv-only models), an approximation for UNets
  with attention or GroupNorm.
"""

from __future__ import annotations

import logging
import math
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from typing import Any

import torch
from tqdm.auto import tqdm

from ..blending import Accumulator, weight_window
from ..distributed import all_reduce_accumulator, all_reduce_max, rank_world, resolve_group, shard
from ..geometry import TileGrid, as_pair, box_slices
from ..locality import probe_receptive_field
from ..wrapper import ModelWrapper
from . import checks, gradients
from .adapters import Call, adapter_for
from .pieces import Piece, plan_pieces, video_pieces
from .regions import Region, region_weights
from .rows import take_rows

logger = logging.getLogger(__name__)

METHODS = checks.METHODS


def _batches(items: Sequence[Any], size: int) -> Iterator[Sequence[Any]]:
    for i in range(0, len(items), size):
        yield items[i : i + size]


class TiledDenoiser(ModelWrapper):
    """Tiled diffusion wrapper: same call signature and return type as the wrapped diffusers denoiser.

    An nn.Module holding the model as its submodule `unet` (whatever its family); it presents the model
    (`tilewise.wrapper`): `pipe.to(...)` moves it, `pipe.save_pretrained` saves it as stock diffusers does,
    and attributes (config, add_embedding, ...) and helpers (FreeU, attention processors) read through.

    `tile_size`, `overlap`, `halo` are in latent pixels; tiles are `tile_size` windows (the whole side when
    the latent is smaller), whose size must be a multiple of the UNet's downsampling factor. `batch_size`
    tiles are run in one call, each with the whole CFG batch. `micro_conditioning="tile"` (SDXL) shifts
    the crop top-left of `time_ids` by the tile's offset in pixels (latent offset x `vae_scale_factor`) and
    keeps the pipeline's original and target size (by default the whole image); "pipeline" passes the
    pipeline's `time_ids` unchanged; a callable `f(time_ids, box_px, image_size_px) -> time_ids` overrides.
    `cfg`: whether the batch is [unconditional, conditional] halves ("auto": the two halves of the
    sample are identical); only regions need to know it, the unconditional half keeps its embeddings.
    `process_group` ("default" = the initialised default group, or a torch.distributed ProcessGroup):
    every rank plans the same tiles, runs its shard (`tilewise.distributed.shard`, balanced by read area),
    and the weighted value and weight buffers (float64) are summed over the ranks before normalising, so
    every rank returns the same prediction, equal to the single-process one; ranks must get the same
    inputs (same seed: the pipeline draws noise from one global generator).
    `positions` (transformers): "global" gives each tile's tokens the positional inputs they have in the
    untiled call; "tile" those of an image the tile's size, as today's tiled-diffusion tools do (for
    comparison). A UNet has none: both compute the same.
    Videos ((B, C, T, H, W) latents, `adapters.families`): tiles cover every frame; `tile_frames` (latent
    frames, a multiple of the model's temporal patch) and `frame_overlap` add overlapping frame windows,
    fused like tiles ("multidiffusion", "mixture").
    `audio` (LTX-2, whose audio stream attends every video token): "mean" returns the tiles' audio
    predictions averaged, an approximation (exact with one tile, or with isolate_modalities=True, where the
    audio sees no video); "exact" refuses a call on several tiles that is not exact.
    Gradients (`tilewise.diffusion.gradients`): a call that autograd records (grad mode on, and the
    latent, a conditioning tensor or a parameter of the model or of a TiledControlNet's ControlNet requires
    grad) is differentiable and exact, the gradient of the fused prediction; `backward="recompute"` runs
    each tile call under a non-reentrant checkpoint (backward holds one tile call's activations at a time
    and runs its forward again), "keep" keeps every tile call's graph (no second forward, every tile's
    activations held). Refused with a process group. A float64 sample is fused in float64.
    """

    wrapped = "unet"

    def __init__(
        self,
        unet: torch.nn.Module,
        tile_size: int | Sequence[int] = 64,
        overlap: int | Sequence[int] = 16,
        method: str = "multidiffusion",
        batch_size: int = 1,
        regions: Sequence[Region] | None = None,
        *,
        var: float = 0.01,
        halo: int | Sequence[int] | str | None = None,
        seed: int = 0,
        micro_conditioning: str | Callable = "tile",
        vae_scale_factor: int = 8,
        cfg: bool | str = "auto",
        order: str = "row",
        align: int | None = None,
        progress: bool = False,
        process_group: Any = None,
        positions: str = "global",
        tile_frames: int | None = None,
        frame_overlap: int = 0,
        backward: str = "recompute",
        audio: str = "mean",
    ) -> None:
        super().__init__()
        if not isinstance(unet, torch.nn.Module) or isinstance(unet, TiledDenoiser):
            kind = type(unet).__name__
            raise ValueError(f"unet must be a denoiser nn.Module (not already tiled), got {kind}")
        checks.check_caches(unet)
        self.method = method
        self.tile_size = as_pair(tile_size, "tile_size")
        self.overlap = as_pair(overlap, "overlap")
        self.halo = halo if halo is None or halo == "probe" else as_pair(halo, "halo")
        self.batch_size, self.var, self.seed, self.order = batch_size, var, seed, order
        self.vae_scale_factor, self.cfg = vae_scale_factor, cfg
        # how this model family is called on a tile (tilewise.diffusion.adapters)
        self.adapter = adapter_for(unet, micro_conditioning=micro_conditioning,
                                   vae_scale_factor=vae_scale_factor, positions=positions, audio=audio)
        self.positions = positions
        self.tile_frames, self.frame_overlap = tile_frames, frame_overlap
        self.align = self.adapter.align(unet) if align is None else align
        self.frame_align = self.adapter.frame_align(unet)
        checks.check_frame_inputs(self, unet)
        self._region_cache: dict[tuple[int, int], torch.Tensor] = {}
        self.regions = regions
        self.progress = progress
        self.progress_bar = None  # an external tqdm-like object updated per tile (used by `upscale`)
        # None: single process; "default" or a ProcessGroup: this rank runs its shard of the tiles
        self.process_group = process_group
        self.backward = backward  # how a differentiable call keeps what backward needs (`gradients`)
        self._validate()
        self._weights: dict[tuple[int, int], torch.Tensor] = {}
        self._logged: set[tuple[int, int]] = set()
        self._wrap(unet)  # last: the settings above stay the wrapper's

    @property
    def regions(self) -> list[Region]:
        """Regional prompts; setting them clears the cached per-pixel region weights."""
        return self._regions

    @regions.setter
    def regions(self, regions: Sequence[Region] | None) -> None:
        regions = list(regions or [])
        bad = [r for r in regions if not isinstance(r, Region)]
        if bad:
            names = [type(r).__name__ for r in bad]
            raise ValueError(f"regions must be tilewise.Region objects, got {names}")
        self._regions = regions
        self._region_cache.clear()

    # ---- validation (tilewise.diffusion.checks) -----------------------------------------------------------
    def _validate(self) -> None:
        checks.check_settings(self)
        gradients.check_backward(self.backward)

    def _check_latent(self, sample: torch.Tensor) -> tuple[int, int]:
        checks.check_call(self.unet, sample)
        H, W = checks.check_latent(sample, self.align, self.adapter.align_name, self.unet)
        if (H < self.tile_size[0] or W < self.tile_size[1]) and (H, W) not in self._logged:
            self._logged.add((H, W))
            logger.info("tile %s is larger than the %dx%d latent along some side: that side is one tile",
                        self.tile_size, H, W)
        return H, W

    # ---- plan: which boxes are read and where their predictions go --------------------------------------
    def plan(self, height: int, width: int, timestep: torch.Tensor | float = 0,
             frames: int | None = None) -> list[Piece]:
        """The pieces of one call on a height x width latent (spot: shifted by the timestep's offset); of a
        video's latent of `frames` frames: frame windows times those, boxes (t0, t1, y0, y1, x0, x1)."""
        if self.method == "halo" and self.halo == "probe":
            raise ValueError("halo='probe' is measured on the first call; plan() needs a numeric halo")
        pieces = plan_pieces(self.method, height, width, self.tile_size, self.overlap, self.halo, self.align,
                             self.order, self.seed, timestep)
        if frames is None:
            return pieces
        return video_pieces(pieces, frames, self.tile_frames, self.frame_overlap)

    def count(self, height: int, width: int, frames: int | None = None) -> int:
        """Tiles per call on a height x width latent, of `frames` latent frames for a video (spot: at
        offset 0; a shifted partition may add one)."""
        if self.method == "halo" and self.halo == "probe":
            tile = (min(self.tile_size[0], height), min(self.tile_size[1], width))
            return len(TileGrid(height, width, tile))
        return len(self.plan(height, width, frames=frames))

    def _probe_halo(self, call: Call) -> tuple[int, int]:
        """halo='probe': the receptive-field radius measured by perturbing one latent pixel (first call)."""
        sample, B = call.sample, call.sample.shape[0]
        row = torch.zeros(1, dtype=torch.long)
        t = take_rows(call.timestep, row, B, 1)

        def model(x: torch.Tensor) -> torch.Tensor:
            cond = {k: take_rows(v, row, B, 1) for k, v in call.cond.items()}
            box = tuple(c for n in x.shape[2:] for c in (0, n))
            return self.adapter.predict(self.unet, call, x, t, cond, [box], 1)

        result = probe_receptive_field(model, sample[:1])
        if result.radius is None:
            raise ValueError(f"halo='probe': {result}; the denoiser is not local, so method='halo' cannot be "
                             "exact; give halo=<latent pixels> explicitly or use 'multidiffusion'/'mixture'")
        logger.info("halo='probe': measured receptive-field radius %d latent px", result.radius)
        return result.radius, result.radius

    def _window(self, piece: Piece, device: torch.device) -> torch.Tensor:
        """The piece's blending window over its out box: (h, w), or (frames, h, w) for a video's piece (the
        frame window's own weights, uniform or Gaussian as the method's, times the spatial ones)."""
        o = piece.out
        shape = tuple(o[i + 1] - o[i] for i in range(0, len(o), 2))
        kind = "gaussian" if self.method == "mixture" else "uniform"
        if (kind, shape) not in self._weights:
            # float64: a float64 accumulator gets the exact window, a float32 one its rounding as before
            win = weight_window(kind, shape[-2:], var=self.var, dtype=torch.float64)
            if len(shape) == 3:
                win = weight_window(kind, (shape[0], 1), var=self.var, dtype=torch.float64)[:, :, None] * win
            self._weights[(kind, shape)] = win
        return self._weights[(kind, shape)].to(device)

    # ---- forward -----------------------------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any):
        """The wrapped model's call: predict on every tile (batched), fuse into one prediction for the whole
        latent, returned as the model returns it."""
        checks.check_caches(self.unet)  # a cache enabled after wrapping (pipe.transformer.enable_cache(...))
        checks.check_regions(self)  # regions set after wrapping
        call = self.adapter.parse(self.unet, args, kwargs)
        checks.check_frame_inputs(self, self.unet, call)
        grad = gradients.needs_grad(self.unet, call)
        gradients.check_process_group(resolve_group(self.process_group), grad)  # a bad group says so first
        H, W = self._check_latent(call.sample)
        if self.method == "halo" and self.halo == "probe":
            self.halo = self._probe_halo(call)
        if call.sample.ndim == 5:  # a video: frame windows times the spatial pieces
            pieces = self.plan(H, W, call.timestep, frames=call.sample.shape[2])
        else:
            pieces = self.plan(H, W, call.timestep)
        fused = self._fuse(call, pieces, self.backward if grad else None)
        return self.adapter.output(call, fused)

    def _fuse(self, call: Call, pieces: list[Piece], backward: str | None = None) -> torch.Tensor:
        """MultiDiffusion eq. 5: sum_i W_i * F(x_i) / sum_i W_i, accumulated per batch (and over ranks) in
        float32, or float64 for a float64 sample and over ranks; `backward` (None: no gradients) how tile
        calls keep what backward needs (`gradients.run`)."""
        sample = call.sample
        B, sides = sample.shape[0], tuple(sample.shape[2:])  # ([frames,] H, W)
        runs = self._runs(sample)
        group = resolve_group(self.process_group)
        if group is not None:
            pieces = self._shard(pieces, runs, group)
        # one tile covering the latent: the fused prediction is the tile's own (no w * y / w rounding)
        everything = tuple(c for n in sides for c in (0, n))
        whole = group is None and len(pieces) == 1 and pieces[0].out == everything
        acc: Accumulator | None = None
        # a float64 model's prediction is not rounded to float32 (its finite differences would disagree)
        dtype = torch.float64 if group is not None or sample.dtype == torch.float64 else torch.float32
        bar = self._bar(len(pieces))
        for chunk in _batches(pieces, self.batch_size):
            outs = self._run_chunk(call, chunk, runs, backward)
            for p in chunk:
                pred = self._combine(p, outs, runs, B, sample.device)[(..., *p.crop)]
                if whole:
                    fused = pred
                    continue
                if acc is None:
                    acc = Accumulator((B, pred.shape[1], *sides), device=sample.device, dtype=dtype,
                                      weight_shape=sides)
                acc.add(pred, p.out, self._window(p, sample.device))
            if bar is not None:
                bar.update(len(chunk))
        if bar is not None and bar is not self.progress_bar:
            bar.close()
        if group is not None:
            acc = self._all_reduce(acc, group, (B, *sides), sample.device)
        if not whole:
            fused = acc.result()  # raises ValueError naming any latent pixel no tile covers
        return fused.to(sample.dtype)

    def _shard(self, pieces: list[Piece], runs: dict, group: Any) -> list[Piece]:
        """This rank's pieces: LPT over (read area x conditioning runs), keyed by the boxes, not the order."""
        rank, world = rank_world(group)

        def cost(p: Piece) -> float:
            r = p.read
            return math.prod(r[i + 1] - r[i] for i in range(0, len(r), 2)) * len(self._jobs(p, runs))

        return shard(pieces, rank, world, key=lambda p: (p.read, p.out), cost=cost)

    def _all_reduce(self, acc: Accumulator | None, group: Any, bhw: tuple[int, ...],
                    device: torch.device) -> Accumulator:
        """Sum the ranks' value and weight buffers (one float64 all-reduce); an empty shard adds zeros."""
        has = 0 if acc is None else acc.shape[1]
        channels = all_reduce_max(has, group)  # collective on every rank, whether its shard is empty or not
        if acc is None:
            B, *sides = bhw
            acc = Accumulator((B, channels, *sides), device=device, dtype=torch.float64,
                              weight_shape=tuple(sides))
        all_reduce_accumulator(acc, group)
        return acc

    def _bar(self, total: int):
        if self.progress_bar is not None:
            return self.progress_bar
        if not self.progress:
            return None
        return tqdm(total=total, desc="tiles", leave=False)

    # ---- conditioning runs: the pipeline prompt and each region -----------------------------------------
    def _runs(self, sample: torch.Tensor) -> dict:
        """Row sets: all rows, the unconditional half and the conditional half (regions only)."""
        B = sample.shape[0]
        rows = torch.arange(B)
        if not self.regions:
            return {"all": rows, "uncond": rows[:0], "cond": rows, "weights": None}
        cfg = self.cfg
        if cfg == "auto":
            cfg = B % 2 == 0 and torch.equal(sample[: B // 2], sample[B // 2 :])
        if cfg and B % 2:
            raise ValueError(f"cfg=True needs an even batch [uncond, cond], got batch {B}")
        half = B // 2 if cfg else 0
        key = (int(sample.shape[-2]), int(sample.shape[-1]))
        if key not in self._region_cache:
            self._region_cache[key] = region_weights(self.regions, *key, self.vae_scale_factor)
        return {"all": rows, "uncond": rows[:half], "cond": rows[half:], "weights": self._region_cache[key]}

    def _jobs(self, piece: Piece, runs: dict) -> list[tuple[int, str]]:
        """(conditioning k, row set) runs a piece needs: k = 0 the pipeline prompt, k >= 1 region k - 1."""
        if runs["weights"] is None:
            return [(0, "all")]
        a = runs["weights"][(slice(None), *box_slices(piece.spatial))]
        active = [k for k in range(a.shape[0]) if bool((a[k] > 0).any())]
        jobs = [(0, "all")] if 0 in active else ([(0, "uncond")] if len(runs["uncond"]) else [])
        return jobs + [(k, "cond") for k in active if k > 0]

    def _run_chunk(self, call: Call, chunk, runs, backward: str | None = None) -> dict:
        """Run the model once per (conditioning, row set) on all pieces of the chunk that need it."""
        groups: dict[tuple[int, str, tuple[int, int]], list[Piece]] = defaultdict(list)
        for p in chunk:
            shape = tuple(p.read[i + 1] - p.read[i] for i in range(0, len(p.read), 2))  # halo reads differ
            for k, rows_name in self._jobs(p, runs):
                groups[(k, rows_name, shape)].append(p)
        outs = {}
        for (k, rows_name, _), ps in groups.items():
            rows = runs[rows_name]
            # bound now: a recomputation during backward runs this call, not the loop's last
            y = gradients.run(partial(self._call, call, ps, k, rows), backward, call.layout)
            for p, part in zip(ps, y.split(len(rows)), strict=True):
                outs[(p.index, k, rows_name)] = part
        return outs

    def _call(self, call: Call, ps: list[Piece], k: int, rows: torch.Tensor) -> torch.Tensor:
        """One model call on the pieces `ps`, rows `rows`, conditioning k (0: the prompt, k: region k - 1)."""
        sample = call.sample
        B = sample.shape[0]
        part = sample.index_select(0, rows.to(sample.device))
        x = torch.cat([part[(..., *box_slices(p.read))] for p in ps])
        cond = {name: take_rows(v, rows, B, len(ps)) for name, v in call.cond.items()}
        t = take_rows(call.timestep, rows, B, len(ps))
        if k > 0:
            self.adapter.apply_region(cond, self.regions[k - 1], len(rows) * len(ps))
        return self.adapter.predict(self.unet, call, x, t, cond, [p.read for p in ps], len(rows))

    def _combine(self, p: Piece, outs: dict, runs: dict, B: int, device) -> torch.Tensor:
        """The piece's prediction: unconditional rows from the prompt, conditional rows blended by region."""
        if runs["weights"] is None:
            return outs[(p.index, 0, "all")]
        a = runs["weights"][(slice(None), *box_slices(p.spatial))].to(device)
        if len(p.read) == 6:
            a = a[:, None]  # (K, 1, h, w): a region holds for every frame
        first = next(v for (i, _, _), v in outs.items() if i == p.index)
        pred = first.new_zeros((B, *first.shape[1:]))
        n_unc = len(runs["uncond"])
        if (p.index, 0, "all") in outs:
            pred[:n_unc] = outs[(p.index, 0, "all")][:n_unc]
        elif n_unc:
            pred[:n_unc] = outs[(p.index, 0, "uncond")]
        for (i, k, rows_name), v in outs.items():
            if i != p.index or (k == 0 and rows_name == "uncond"):
                continue
            v_cond = v[n_unc:] if rows_name == "all" else v
            pred[n_unc:] += a[k].to(v.dtype) * v_cond
        return pred
