"""The plan of a backward through a tiled 3-D VAE (`plan(shape, backward=True)`, `vae/video/backward.py`):
at or above the live tensor bytes the differentiable call makes (its graph, its gradients), within 2.5x
of them (1.2-2.0x on these tiny VAEs); a memory budget picks the call's tile by both peaks and refuses,
before anything runs, what no tile fits."""

from __future__ import annotations

import copy

import pytest
import torch
from video_vae_support import video_vae

import tilewise as tw
from tilewise.memory import measure_live_peak

torch.set_num_threads(1)


def _live(tv, vae, z) -> int:
    """Live tensor bytes of one differentiable decode and its backward (input and parameter gradients)."""
    def call():
        x = z.clone().requires_grad_(True)
        y = tv.decode(x).sample
        return torch.autograd.grad((y * y).sum(), [x, *vae.parameters()], allow_unused=True)

    return measure_live_peak(call)[1]


@pytest.mark.parametrize("name,shape", [("wan2.1", (1, 4, 3, 9, 7)), ("hunyuan", (1, 4, 2, 7, 9)),
                                        ("ltx0.9.0", (1, 4, 2, 7, 6)), ("qwen", (1, 4, 1, 9, 6)),
                                        ("mochi", (1, 4, 3, 5, 7))])
def test_the_backward_plan_bounds_the_live_bytes_of_the_differentiable_call(name, shape):
    vae = copy.deepcopy(video_vae(name))
    tv = tw.TiledVAE(vae, tile_size=3, progress=False)
    plan = tv.plan(shape, backward=True)
    back = plan.backward
    assert back is not None and back.tile_size == plan.tile_size == 3 and "backward" in str(plan)
    assert back.steps == len(plan.steps) and back.peak >= plan.peak
    live = _live(tv, vae, torch.randn(shape, generator=torch.Generator().manual_seed(0)))
    assert live <= back.peak <= 2.5 * live, (live, back)


def test_a_budget_takes_the_largest_tile_both_peaks_fit_and_refuses_what_none_fits():
    vae = copy.deepcopy(video_vae("wan2.1"))
    shape = (1, 4, 3, 20, 18)
    free = tw.TiledVAE(vae, progress=False).plan(shape, backward=True)
    budget = int(free.backward.peak * 1.1)
    tv = tw.TiledVAE(vae, memory_budget=budget, progress=False)
    plan = tv.plan(shape, backward=True)
    assert plan.backward.peak <= budget and plan.peak <= budget and plan.tile_size == free.tile_size
    assert _live(tv, vae, torch.randn(shape, generator=torch.Generator().manual_seed(1))) <= budget
    small = int(free.backward.peak * 0.5)  # (under one step's graph: no tile fits, smaller ones add halo)
    with pytest.raises(ValueError, match=r"no differentiable decode of \(1, 4, 3, 20, 18\) fits"):
        tw.TiledVAE(vae, memory_budget=small, progress=False).plan(shape, backward=True)
    z = torch.randn(shape).requires_grad_(True)
    with pytest.raises(ValueError, match="no differentiable decode"):
        tw.TiledVAE(vae, memory_budget=small, progress=False).decode(z)
