"""The plan of a backward through a tiled 3-D VAE (`plan(shape, backward=True)`, `vae/video/backward.py`):
at or above the live tensor bytes the differentiable call makes (its graph, its gradients), within 2.5x
of them (1.0-1.8x on these tiny VAEs); the backward's live bytes fall with the tile (each causal step
reversed tile by tile); a memory budget picks the call's tile by both peaks and refuses, before anything
runs, what no tile fits."""

from __future__ import annotations

import copy

import pytest
import torch
from video_vae_support import video_vae

import tilewise as tw
from tilewise.memory import measure_live_peak

torch.set_num_threads(1)


def _live(tv, vae, z) -> int:  # (tv: a TiledVAE, or the VAE itself for the untiled backward)
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


@pytest.mark.parametrize("name,tiles", [("ltx0.9.0", (3, 6)), ("wan2.1", (6,))])
def test_the_backward_peak_falls_with_the_tile(name, tiles):
    """A 12x12 latent, 2 frames, decoded in tiles of 3 (4x4) or 6 (2x2): the backward's live bytes are
    below those of one tile of the whole frame (tile 12: one causal step's whole-frame graph, which the
    backward held at any tile before each step was reversed tile by tile) and fall with the tile; LTX's
    decode runs in one causal step (no caches), so there its live bytes are under half the untiled
    backward's; Wan's causal caches of every tile are kept from the forward and do not shrink with the
    tile. The plan's backward peak is within [1, 2]x of each measurement."""
    vae = copy.deepcopy(video_vae(name))
    shape = (1, 4, 2, 12, 12)
    z = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    live = {}
    for tile in (*tiles, 12):
        tv = tw.TiledVAE(vae, tile_size=tile, progress=False)
        back = tv.plan(shape, backward=True).backward
        live[tile] = _live(tv, vae, z)
        assert live[tile] <= back.peak <= 2 * live[tile], (tile, live[tile], back)
    ordered = [live[t] for t in (*tiles, 12)]
    assert ordered == sorted(ordered) and len(set(ordered)) == len(ordered), live
    assert live[tiles[-1]] < 0.6 * live[12], live
    if name == "ltx0.9.0":
        assert live[3] < 0.5 * _live(vae, vae, z), live


def test_a_budget_takes_the_largest_tile_both_peaks_fit_and_refuses_what_none_fits():
    """A budget under one tile's backward (tile 32: the whole 20x18 latent frame) takes smaller tiles
    (a step reversed tile by tile needs less); one under the smallest tile's backward (caches of every
    tile kept, halos) is refused before anything runs."""
    vae = copy.deepcopy(video_vae("wan2.1"))
    shape = (1, 4, 3, 20, 18)
    free = tw.TiledVAE(vae, progress=False).plan(shape, backward=True)
    assert free.grid == (1, 1)
    budget = int(free.backward.peak * 0.6)
    tv = tw.TiledVAE(vae, memory_budget=budget, progress=False)
    plan = tv.plan(shape, backward=True)
    assert plan.backward.peak <= budget and plan.peak <= budget and plan.tile_size < free.tile_size
    assert _live(tv, vae, torch.randn(shape, generator=torch.Generator().manual_seed(1))) <= budget
    small = int(free.backward.peak * 0.4)  # (under every tile's: smaller tiles add caches' halos)
    with pytest.raises(ValueError, match=r"no differentiable decode of \(1, 4, 3, 20, 18\) fits"):
        tw.TiledVAE(vae, memory_budget=small, progress=False).plan(shape, backward=True)
    z = torch.randn(shape).requires_grad_(True)
    with pytest.raises(ValueError, match="no differentiable decode"):
        tw.TiledVAE(vae, memory_budget=small, progress=False).decode(z)
