"""TiledVAE's checks: the VAE it is built on (`check_vae`); at the call, before any tile runs, the input's
dtype and values, and whether the run fits the memory and disk there are (`tilewise.limits`)."""

from __future__ import annotations

import math
import tempfile

import torch
from torch._subclasses.fake_tensor import FakeTensor

from ..errors import WontFit
from ..limits import check_disk, device_memory_available, host_memory_available
from ..memory import format_bytes
from .families import FAMILIES
from .settings import Job, Kind, Place


def check_vae(vae) -> None:
    """Refuse at construction what is not a VAE this wraps: a class of the families' table (`families`:
    those it refuses, with their reasons, later), or a module with an encoder and a decoder (traced as an
    AutoencoderKL). A VAE on the meta device is not refused: plans and counted runs use one
    (tests/test_counting.py)."""
    if type(vae).__name__ not in FAMILIES and not all(isinstance(getattr(vae, part, None), torch.nn.Module)
                                                      for part in ("encoder", "decoder")):
        hint = (" (a denoiser: tile it with tw.TiledDenoiser)" if hasattr(vae, "time_embedding")
                or hasattr(vae, "time_proj") else "")
        raise ValueError(f"vae must be a diffusers VAE with an encoder and a decoder (AutoencoderKL, "
                         f"AutoencoderTiny, AutoencoderKLWan, AutoencoderKLQwenImage, "
                         f"AutoencoderKLLTXVideo, ...), got a {type(vae).__name__}{hint}")


def check_input(job: Job, t) -> None:
    """A 2-D job's input: a (B, C, H, W) tensor of the VAE's channels, not empty, not too small for the
    program, in the VAE's dtype and finite (ValueError naming the value and what would be valid; a call
    that asks for gradients runs `gradient`)."""
    p = job.program
    what = "latent z" if job.kind is Kind.DECODE else "image x"
    if not isinstance(t, torch.Tensor) or t.ndim != 4:
        shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{what} must be a (B, C, H, W) tensor, got {shape}")
    if t.shape[1] != p.in_channels:
        raise ValueError(f"{what} has {t.shape[1]} channels, the VAE {job.kind}r expects {p.in_channels} "
                         f"(shape {tuple(t.shape)})")
    if min(t.shape) == 0:
        raise ValueError(f"{what} is empty: shape {tuple(t.shape)}")
    check_device(job, t, what)
    h, w = t.shape[-2:]
    shapes = p.shapes((h, w))
    small = next((op for op in p.ops if min(shapes[op.dst]) < 1), None)
    if small is not None:
        raise ValueError(f"{what} of {h}x{w} is too small for the VAE {job.kind}r: {small.name} would have "
                         f"no pixels left (the wrapped VAE fails on it too); use a larger {what}")
    check_dtype(t, what, job.dtype)
    check_finite(t, what)


def check_device(job: Job, t: torch.Tensor, what: str) -> None:
    """Input and weights with data, or a fake input (a counted run under FakeTensorMode, on the meta device):
    a meta VAE given a real input would run its ops on no data (and be blamed on NaN), a meta input has no
    values to decode."""
    if isinstance(t, FakeTensor) or not (t.is_meta or job.device.type == "meta"):
        return
    where = f"{what} is" if t.is_meta else "the VAE's weights are"
    raise ValueError(f"{where} on the meta device (no data): TiledVAE can plan there (plan, counted runs "
                     "under FakeTensorMode) but not run; load the weights (vae.to_empty / "
                     "from_pretrained) and give a real input")


def check_dtype(t: torch.Tensor, what: str, want: torch.dtype) -> None:
    """The input's dtype is the VAE's (as the wrapped VAE's convolutions require; autocast casts itself)."""
    name = what.split()[-1]
    if not t.is_floating_point():
        raise ValueError(f"{what} is a {t.dtype} tensor; the VAE takes floating-point input in its own "
                         f"dtype: pass {name}.to({want})")
    if t.dtype != want and not torch.is_autocast_enabled(t.device.type):
        raise ValueError(f"{what} is {t.dtype} but the VAE's weights are {want} (the wrapped VAE refuses the "
                         f"mix too): pass {name}.to({want}), or move the VAE with vae.to({t.dtype})")


def check_finite(t: torch.Tensor, what: str) -> None:
    """The input holds no NaN or inf (else every later 'non-finite output' would blame the VAE)."""
    s = t.sum(dtype=torch.float32) if t.dtype in (torch.float16, torch.bfloat16) else t.sum()
    if bool(s.isfinite()) or bool(t.isfinite().all()):
        return
    nan, inf = int(torch.isnan(t).sum()), int(torch.isinf(t).sum())
    first = tuple(int(i) for i in torch.nonzero(~torch.isfinite(t))[0])
    raise ValueError(f"{what} of shape {tuple(t.shape)} holds {nan} NaN and {inf} inf values (the first at "
                     f"index {first}): the input is broken before any VAE op runs")


def check_fits(job: Job, shape: tuple[int, ...], plan, streamed: bool, stage_dir: str | None) -> None:
    """Refuse (WontFit) a run whose staged values (and output, unless streamed) cannot fit where they live:
    device / host memory or the staging folder's disk (`stage_dir`, None: the system's temporary
    folder), as `plan` (the run's) places them. Looked at only when a cheap bound says it may not fit."""
    p, device = job.program, job.device
    shapes = p.shapes(tuple(shape[-2:]))
    chans = p.channels()
    bound = sum(shape[0] * chans[v] * math.prod(shapes[v]) * job.item for v in shapes)  # every value at once
    if bound * 2 < min(host_memory_available(), device_memory_available(device)):
        return
    tile, staging = plan.tile_size, plan.staging
    out = 0 if streamed else plan.output_bytes
    what = f"TiledVAE {job.kind} of {tuple(shape)} (tile {tile}, staging {staging.value!r})"
    other = ("try staging='disk' or a memory_budget (tilewise decode: --staging disk, --budget)"
             if staging is not Place.DISK else "use a smaller image")
    if staging is Place.DISK:
        folder = stage_dir or tempfile.gettempdir()
        check_disk(plan.staged_peak, folder, f"{what}: staging",
                   hint="give stage_dir= a folder on a larger disk, or use a smaller image")
        _memory(out, device, f"{what}: its output", "stream it to a file (decode_to) or use a smaller image")
    elif staging is Place.HOST or device.type == "cpu":
        _memory(plan.staged_peak + (out if device.type == "cpu" else 0), torch.device("cpu"),
                f"{what}: its staged values{'' if streamed else ' and output'}", other)
    if device.type != "cpu" and staging is not Place.HOST:
        _memory(plan.staged_peak + out, device, f"{what}: its staged values and output", other)


def check_video_fits(job: Job, plan, stage_dir: str | None = None) -> None:
    """Refuse (WontFit) a 3-D VAE run whose plan (`VideoPlan`) cannot fit: its device peak (caches, staged
    values, one tile's working set, the output unless it streams) where the VAE is, what host staging
    keeps in host memory (on a CPU VAE, the same memory), and what disk staging keeps in files on the disk
    of `stage_dir` (None: the system's temporary folder)."""
    what = (f"TiledVAE {job.kind} of {plan.input_shape} (tile {plan.tile_size}, staging "
            f"{plan.staging.value!r})")
    if plan.staging is Place.DISK:
        check_disk(plan.disk_bytes, stage_dir or tempfile.gettempdir(), f"{what}: staging",
                   hint="give stage_dir= a folder on a larger disk, or use a shorter or smaller video")
    hint = ("use a memory_budget, a smaller tile or staging='host' or 'disk'" if plan.staging is Place.DEVICE
            else "use a smaller tile or a shorter video" + (" (or staging='disk')"
                                                            if plan.staging is Place.HOST else ""))
    held = f"{what}: its caches, staged values and output"
    if job.device.type == "cpu":
        _memory(plan.peak + plan.host_bytes, job.device, held, hint)
        return
    _memory(plan.peak, job.device, held, hint)
    _memory(plan.host_bytes, torch.device("cpu"), f"{what}: its host-staged caches and values", hint)


def _memory(need: int, device: torch.device, what: str, hint: str) -> None:
    room = device_memory_available(device)
    if need > room:
        where = "host" if device.type == "cpu" else str(device)
        raise WontFit(f"{what} need at least {format_bytes(need)} of {where} memory but {format_bytes(room)} "
                      f"is available; {hint}")

