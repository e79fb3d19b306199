"""TiledDenoiser's checks: its settings when built, the model when wrapped and called, each call's latent.

Every check raises a ValueError naming the argument, the value and what would be valid, before any tile
runs: settings and step caches when the wrapper is built; the model's device and dtype, NaN / inf in the
sample and the latent's shape when it is called (a model on the meta device can be wrapped, so that
`plan` and `count` work on a model without weights, but not run).
"""

from __future__ import annotations

from typing import Any

import torch

METHODS = ("multidiffusion", "mixture", "spot", "halo")
COMPUTE = (torch.float16, torch.bfloat16, torch.float32, torch.float64)  # weights a sample must match


def check_settings(td: Any) -> None:
    """The wrapper's settings (method, tiles, overlap, batch, halo, cfg, variance, frames, process group)."""
    if td.method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {td.method!r}")
    th, tw = td.tile_size
    if th <= 0 or tw <= 0:
        raise ValueError(f"tile_size must be positive, got {td.tile_size}")
    for t, o, axis in ((th, td.overlap[0], "height"), (tw, td.overlap[1], "width")):
        if td.method in ("multidiffusion", "mixture") and not 0 <= o < t:
            raise ValueError(f"overlap {o} must satisfy 0 <= overlap < tile_size {t} along {axis}")
        if t % td.align:
            lo, hi = t // td.align * td.align, -(-t // td.align) * td.align
            raise ValueError(f"tile_size {t} along {axis} is not a multiple of {td.adapter.align_name} "
                             f"{td.align}; use {' or '.join(str(v) for v in (lo, hi) if v > 0)}")
    if not isinstance(td.batch_size, int) or td.batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {td.batch_size!r}")
    if td.method == "halo" and td.halo is None:
        raise ValueError("method='halo' needs halo=<latent pixels> (receptive-field radius) or 'probe'")
    if td.halo not in (None, "probe") and min(td.halo) < 0:
        raise ValueError(f"halo must be >= 0, got {td.halo}")
    if td.cfg not in (True, False, "auto"):
        raise ValueError(f"cfg must be True, False or 'auto', got {td.cfg!r}")
    if td.method == "mixture" and not td.var > 0:
        raise ValueError(f"var (Gaussian variance in tile-side units) must be > 0, got {td.var}")
    check_frames(td.tile_frames, td.frame_overlap, td.method, td.frame_align)
    check_regions(td)
    if isinstance(td.process_group, str) and td.process_group != "default":
        raise ValueError(f"process_group must be None, 'default' or a ProcessGroup, got {td.process_group!r}")


def check_frame_inputs(td: Any, model, call: Any = None) -> None:
    """Frame windows where the model (call None: when wrapped) and the call's inputs allow them: inputs
    that every window would need whole (reference frames, an image frame the model marks by position) are
    refused by the family's table entry, with the reason."""
    if td.tile_frames is None:
        return
    why = td.adapter.frames_refused(model, call)
    if why:
        raise ValueError(f"tile_frames={td.tile_frames}: {type(model).__name__} {why}; use tile_frames=None "
                         "(tiles over space, every frame in each)")


def check_regions(td: Any) -> None:
    """Regional prompts, where the model's family can take a region's embeddings."""
    if td.regions and td.adapter.no_regions:
        raise ValueError(f"regions: the {td.adapter.family} family cannot take regional prompts: "
                         f"{td.adapter.no_regions}; give regions=None")


def check_frames(tile_frames, frame_overlap, method: str, frame_align: int) -> None:
    """Frame windows (videos): a positive window of latent frames, 0 <= frame_overlap < tile_frames."""
    if tile_frames is None:
        if frame_overlap:
            raise ValueError(f"frame_overlap={frame_overlap} needs tile_frames=<latent frames>")
        return
    if isinstance(tile_frames, bool) or not isinstance(tile_frames, int) or tile_frames < 1:
        raise ValueError(f"tile_frames must be None (the whole clip) or a positive int of latent frames, "
                         f"got {tile_frames!r}")
    if not isinstance(frame_overlap, int) or not 0 <= frame_overlap < tile_frames:
        raise ValueError(f"frame_overlap {frame_overlap!r} must satisfy 0 <= frame_overlap < tile_frames "
                         f"{tile_frames}")
    if method not in ("multidiffusion", "mixture"):
        raise ValueError(f"tile_frames (overlapping frame windows) works with method 'multidiffusion' or "
                         f"'mixture', got {method!r}")
    if tile_frames % frame_align:
        raise ValueError(f"tile_frames {tile_frames} is not a multiple of the model's temporal patch "
                         f"{frame_align} (latent frames)")


def check_caches(model) -> None:
    """Step caches (FasterCache, first-block cache, TaylorSeer, pyramid attention broadcast: diffusers'
    `enable_cache`) keep one state per model call and reuse it at the next step's call; tiles are several
    calls per step, so each would be fed another tile's state. Refused until the cache is disabled."""
    if getattr(model, "is_cache_enabled", False):
        raise ValueError(f"unet: this {type(model).__name__} has a step cache enabled (enable_cache: "
                         "FasterCache, first-block cache, ...), which keeps one state per model call; every "
                         "tile is its own call, so a tile would reuse another tile's state. Disable it "
                         "(model.disable_cache()) before TiledDenoiser, or run the pipeline untiled")


def check_call(model, sample) -> None:
    """The model can run the sample: not on the meta device, weights of the sample's dtype (outside
    autocast), no NaN or inf in the sample."""
    if not isinstance(sample, torch.Tensor):
        return
    param = next(iter(model.parameters()), None)
    if sample.is_meta or (param is not None and param.is_meta):
        where = "sample" if sample.is_meta else "the model's weights"
        raise ValueError(f"{where} are on the meta device (no data): TiledDenoiser can plan there "
                         "(plan, count) but not run; load the weights (model.to_empty / from_pretrained) "
                         "and give a real latent")
    if param is not None and sample.is_floating_point() and param.dtype in COMPUTE and \
            sample.dtype != param.dtype and not torch.is_autocast_enabled(sample.device.type):
        raise ValueError(f"sample is {sample.dtype} but the model's weights are {param.dtype}: cast one "
                         f"(sample.to({param.dtype}) or model.to({sample.dtype})), or run under "
                         "torch.autocast")
    if sample.is_floating_point():
        bad = ~torch.isfinite(sample)
        if bool(bad.any()):
            first = bad.nonzero()[0].tolist()
            raise ValueError(f"sample holds {int(bad.sum())} NaN or inf values (first at index {first} of "
                             f"shape {tuple(sample.shape)}): the latent given to the denoiser is broken "
                             "(a NaN from the previous step, the scheduler or the inputs)")


def check_latent(sample, align: int, align_name: str, model) -> tuple[int, int]:
    """The fusion core's grid: a floating (B, C, [T,] H, W) tensor, every side >= 1, H, W >= `align`."""
    if not isinstance(sample, torch.Tensor):
        raise ValueError(f"sample must be a (batch, channels, height, width) tensor, got "
                         f"{type(sample).__name__}")
    if sample.ndim not in (4, 5):
        raise ValueError(f"sample must be a (batch, channels, height, width) latent (or a video's "
                         f"(batch, channels, frames, height, width)), got {tuple(sample.shape)}")
    if sample.numel() == 0:
        raise ValueError(f"sample is empty: shape {tuple(sample.shape)}; every side must be >= 1")
    if not sample.is_floating_point():
        raise ValueError(f"sample is a {sample.dtype} tensor; latents are floating point (the model's "
                         f"dtype, e.g. sample.to({getattr(model, 'dtype', torch.float32)}))")
    H, W = sample.shape[-2:]
    if H < align or W < align:
        raise ValueError(f"latent {H}x{W} is smaller than {align_name} {align}; height and width must be "
                         f">= {align} latent pixels")
    return int(H), int(W)
