"""Gradients through TiledDenoiser (and the TiledControlNet it runs): which calls need them, and how each
tile's model call keeps what backward needs.

The fused prediction sum_i W_i * F(x_i) / sum_i W_i (MultiDiffusion eq. 5) is a differentiable function of
the latent, the conditioning and the parameters of the model and of any ControlNet run per tile; autograd
through the tile calls and the accumulator gives its exact gradient. What differs is memory:

- "keep": each tile call's graph is kept until backward, as a plain module call keeps it: backward holds
  every tile's activations at once (as much as, or more than, the untiled model's: overlaps are counted
  twice), and runs no forward again.
- "recompute": each tile call runs under `torch.utils.checkpoint` (non-reentrant): forward keeps only the
  tile call's inputs and its prediction, and backward runs the tile's forward again, one tile at a time,
  so it holds one tile call's activations (`batch_size` tiles) at a time: one more forward per tile.

A call needs gradients when autograd records (`torch.is_grad_enabled()`) and something it reads requires
them: the latent, a conditioning tensor, a parameter of the denoiser or of a ControlNet it runs.
Gradients are refused with a process group: its sum over the ranks (`torch.distributed.all_reduce`) is
not recorded by autograd, so each rank's backward would reach only its own tiles.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

BACKWARD = ("recompute", "keep")


def check_backward(backward: Any) -> None:
    """`backward` is one of BACKWARD."""
    if backward not in BACKWARD:
        raise ValueError(f"backward must be one of {BACKWARD} ('recompute': each tile's forward again "
                         f"during backward, one tile's activations held; 'keep': every tile's graph "
                         f"kept), got {backward!r}")


def requires_grad(value: Any, seen: set[int] | None = None) -> bool:
    """Whether a tensor in `value` requires grad: tensors, modules' parameters, dicts, lists, tuples and
    tilewise's own records (per-tile inputs, deferred ControlNet residuals and their recorded calls)."""
    seen = set() if seen is None else seen
    if id(value) in seen:
        return False
    seen.add(id(value))
    if isinstance(value, torch.Tensor):
        return value.requires_grad
    if isinstance(value, torch.nn.Module):
        return any(p.requires_grad for p in value.parameters())
    if isinstance(value, dict):
        return any(requires_grad(v, seen) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(requires_grad(v, seen) for v in value)
    if type(value).__module__.startswith("tilewise.") and hasattr(value, "__dict__"):
        return any(requires_grad(v, seen) for v in vars(value).values())
    return False


def needs_grad(model: torch.nn.Module, call: Any) -> bool:
    """Whether autograd records this denoiser call: grad mode on, and the model's parameters or the call's
    inputs (latent, timestep, conditioning, ControlNet calls) require grad."""
    if not torch.is_grad_enabled():
        return False
    return requires_grad(model) or requires_grad((call.sample, call.timestep, call.cond, call.shared))


def check_process_group(process_group: Any, grad: bool) -> None:
    """Gradients are refused with a process group (see the module docstring)."""
    if grad and process_group is not None:
        raise ValueError("TiledDenoiser(process_group=...) with gradients: the sum over the ranks is not "
                         "recorded by autograd, so a backward would reach only this rank's tiles; call it "
                         "under torch.no_grad() (or with nothing requiring grad), or use process_group=None "
                         "for a differentiable call")


def run(fn: Callable[[], torch.Tensor], backward: str | None, layout: Any = None) -> torch.Tensor:
    """One tile call `fn()`: plain (backward None: no gradients, or "keep"), or under a non-reentrant
    checkpoint ("recompute"). A layout's per-call position cache (`adapters.grid.GridLayout.cache`) is
    fresh inside a checkpoint, so that the tile's forward and its recomputation run the same operators."""
    if backward != "recompute":
        return fn()

    def tile() -> torch.Tensor:
        if not hasattr(layout, "cache"):
            return fn()
        kept, layout.cache = layout.cache, {}
        try:
            return fn()
        finally:
            layout.cache = kept

    return checkpoint(tile, use_reentrant=False)
