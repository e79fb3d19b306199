"""Exact, memory-bounded gradients through a 2-D TiledVAE's decode and encode (issue #30).

`run` is the autograd form of `runner.run`: a `torch.autograd.Function` whose forward is the exact tile
program (the same `Executor`, plan and staging), keeping its staged values and GroupNorm statistics,
and whose backward is the reverse tile program (`run.reverse`). Gradients reach the input and every
parameter of the VAE that requires grad; `loss.backward()` accumulates them into `.grad`,
`torch.autograd.grad` returns them. The staged values live until the graph is freed (after backward, or
when the output dies), as an untiled graph's activations would.

When: grad mode on and the input requires grad, or the VAE is training (`vae.train()`) with parameters
that require grad (fine-tuning a decoder; `wants`). An eval-mode VAE called on an input that does not
require grad runs the plain path (diffusers loads VAEs in eval mode with parameters that require grad:
an inference call outside `torch.no_grad` keeps no staged values).

Fast mode with the crop estimator (`fast_estimator="crops"`) differentiates with its estimated
statistics held constant (they are estimates; the gradient is the fast forward's with them fixed);
fast mode's sampled-tile passes and process groups are refused at the call. The 3-D causal VAEs have their
own backward (`video.gradient`: causal steps recomputed last to first).
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass, replace

import torch

from ..errors import WontFit
from ..memory import format_bytes
from .checks import check_fits
from .fast.run import crop_stats
from .fast.split import fast_split
from .plan.backward import backward_plan
from .plan.make import make_plan, request
from .plan.records import Plan
from .plan.settle import settle
from .run.executor import Executor
from .run.options import Choices, pass_options
from .run.reverse import backward
from .settings import Job, Mode, Place, Settings

logger = logging.getLogger(__name__)


def wants(vae, t) -> bool:
    """Whether a call on t builds a graph: grad mode on, and t requires grad or the VAE is training with
    parameters that require grad (module doc)."""
    if not torch.is_grad_enabled():
        return False
    return t.requires_grad or (vae.training and any(q.requires_grad for q in vae.parameters()))


def refusal(settings: Settings, job: Job) -> str:
    """Why this TiledVAE's call has no tiled backward ("" where it has one)."""
    if settings.process_group is not None:
        return "with a process group (each rank holds a band of rows; the reverse runs in one process)"
    if fast_split(job.program, job.kind, settings.mode, settings.fast) is not None:
        return ("in fast mode with the sampled-tile estimator (fast_estimator='tiles': its passes are "
                "several programs); use fast_estimator='crops' (statistics held constant) or mode='exact'")
    return ""


def run(settings: Settings, job: Job, t, vae) -> tuple:
    """(output with its graph, most staged bytes) of the job on t: the exact tile program forward, the
    reverse tile program backward."""
    why = refusal(settings, job)
    if why:
        raise RuntimeError(f"TiledVAE {job.kind} has no backward {why}; use the wrapped VAE to train")
    choices = _choices(settings, job, tuple(t.shape))
    params = tuple(q for q in vae.parameters() if q.requires_grad)
    call = _Call(settings, job, choices)
    out = _Tiled.apply(t, call, *params)
    return out, call.staged_peak


def plan(settings: Settings, job: Job, shape: tuple[int, ...], tile_size: int | None = None,
         staging: str | None = None) -> Plan:
    """The plan of a call that asks for gradients: the forward's, with its `backward` (`BackwardPlan`).
    Within a memory budget (no tile or staging given) the tile halves, then disk staging is tried, until
    the backward's peak fits it too (WontFit when none does)."""
    if tile_size is not None or staging is not None or settings.memory_budget is None:
        place = None if staging is None else Place.parse(staging, "staging")
        fwd = make_plan(settings, job, shape, request(settings, job, tile_size, place))
        return replace(fwd, backward=backward_plan(job, shape, fwd.choices, settings))
    fwd = settle(settings, job, shape)
    if fwd.tile_batch > 1 or fwd.choices.recompute:  # (a differentiable call runs tile by tile, forward
        # and backward, every value staged: `run.reverse`)
        fwd = make_plan(settings, job, shape, fwd.choices.replace(tile_batch=1, recompute=()))
    for choices in _smaller(fwd.choices):
        back = backward_plan(job, shape, choices, settings)
        if back.peak <= settings.memory_budget:
            fwd = fwd if choices is fwd.choices else make_plan(settings, job, shape, choices)
            return replace(fwd, backward=back)
    raise WontFit(f"TiledVAE {job.kind} backward of {shape}: its peak {format_bytes(back.peak)} at tile 1 "
                  f"with disk staging exceeds memory_budget {format_bytes(settings.memory_budget)}; use a "
                  "larger budget or a smaller input")


def _smaller(choices: Choices):
    """The forward's choices, then at half the tile down to 1, then the same with disk staging (the
    staged values out of memory)."""
    stagings = [choices] if choices.staging is Place.DISK else [
        choices, choices.replace(staging=Place.DISK, on_device=frozenset())]
    for c in stagings:
        tile = c.tile_size
        while tile >= 1:
            yield c if tile == c.tile_size else c.replace(tile_size=tile)
            tile //= 2


def _choices(settings: Settings, job: Job, shape: tuple[int, ...]) -> Choices:
    """The choices a differentiable call runs: its plan's (`plan`), checked against the memory there is."""
    p = plan(settings, job, shape)
    check_fits(job, shape, p, False, settings.stage_dir)
    return p.choices


@dataclass
class _Call:
    """One differentiable call: what runs, and what its forward staged."""

    settings: Settings
    job: Job
    choices: Choices
    staged_peak: int = 0


class _Kept:
    """What the forward kept for the backward; its staging is closed when this dies (the graph freed)."""

    def __init__(self, ex: Executor, res, x):
        self.ex, self.stage, self.stats, self.x, self.used = ex, res.staging, res.stats, x, False
        weakref.finalize(self, res.staging.close)


class _Tiled(torch.autograd.Function):
    """The tiled decode / encode as one autograd node (module doc)."""

    @staticmethod
    def forward(ctx, x, call: _Call, *params):
        s, job, choices = call.settings, call.job, call.choices
        fast = s.mode is Mode.FAST
        fixed = crop_stats(job, s.fast, x, choices.tile_size, None) if fast else {}
        options = pass_options(s, job.profile, choices, band_bytes=None if fast else choices.band_bytes,
                               keep_staged=True, tile_batch=1)  # (tile by tile, as backward recomputes)
        ex = Executor(job.program, choices.tile_size, job.ref, options, x.device, None, fixed)
        res = ex.run(x)
        call.staged_peak = res.staged_peak
        ctx.kept, ctx.params = _Kept(ex, res, x), params
        return res.output

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        k = ctx.kept
        if k.used:
            raise RuntimeError("TiledVAE's backward frees the staged values as it runs: a second backward "
                               "through the same call (retain_graph=True) is not supported; call decode / "
                               "encode again")
        k.used = True
        gx, gp = backward(k.ex, k.stage, k.stats, k.x, grad_out.contiguous(), ctx.params,
                          ctx.needs_input_grad[0])
        return (gx, None, *gp)
