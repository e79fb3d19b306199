"""TiledVAE's checks at the call, before any tile runs: the input's dtype and values, and whether the run
fits the memory and disk there are (`tilewise.limits`)."""

from __future__ import annotations

import math
import tempfile

import torch

from ..errors import WontFit
from ..limits import check_disk, device_memory_available, host_memory_available
from ..memory import format_bytes


def check_dtype(t: torch.Tensor, what: str, vae: torch.nn.Module) -> None:
    """The input's dtype is the VAE's (as the wrapped VAE's convolutions require; autocast casts itself)."""
    want = next((p.dtype for p in vae.parameters()), torch.float32)
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


def check_fits(tv, kind: str, shape: tuple[int, ...], plan, streamed: bool) -> None:
    """Refuse (WontFit) a run whose staged values (and output, unless streamed) cannot fit where they live:
    device / host memory or the staging folder's disk, as `plan` (the run's) places them. Looked at only
    when a cheap bound says it may not fit."""
    p = tv.program(kind)
    shapes = p.shapes(tuple(shape[-2:]))
    chans = p.channels()
    item = torch.empty((), dtype=next((q.dtype for q in tv.vae.parameters()), torch.float32)).element_size()
    bound = sum(shape[0] * chans[v] * math.prod(shapes[v]) * item for v in shapes)  # every value at once
    device = next((q.device for q in tv.vae.parameters()), torch.device("cpu"))
    if bound * 2 < min(host_memory_available(), device_memory_available(device)):
        return
    tile, staging = plan.tile_size, plan.staging
    out = 0 if streamed else plan.output_bytes
    what = f"TiledVAE {kind} of {tuple(shape)} (tile {tile}, staging {staging!r})"
    other = ("try staging='disk' or a memory_budget (tilewise decode: --staging disk, --budget)"
             if staging != "disk" else "use a smaller image")
    if staging == "disk":
        folder = tv.stage_dir or tempfile.gettempdir()
        check_disk(plan.staged_peak, folder, f"{what}: staging",
                   hint="give stage_dir= a folder on a larger disk, or use a smaller image")
        _memory(out, device, f"{what}: its output", "stream it to a file (decode_to) or use a smaller image")
    elif staging == "host" or device.type == "cpu":
        _memory(plan.staged_peak + (out if device.type == "cpu" else 0), torch.device("cpu"),
                f"{what}: its staged values{'' if streamed else ' and output'}", other)
    if device.type != "cpu" and staging != "host":
        _memory(plan.staged_peak + out, device, f"{what}: its staged values and output", other)


def _memory(need: int, device: torch.device, what: str, hint: str) -> None:
    room = device_memory_available(device)
    if need > room:
        where = "host" if device.type == "cpu" else str(device)
        raise WontFit(f"{what} need at least {format_bytes(need)} of {where} memory but {format_bytes(room)} "
                      f"is available; {hint}")

