"""Fast GPU plans keep the sampled tiles' statistics on the device where that is cheaper than the link
(issue #31): planned on fake tensors at one tile, so no GPU is needed and it takes seconds."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from counting import build_vae, fake  # noqa: E402

import tilewise as tw  # noqa: E402
from tilewise.vae.fast.estimators import sample_tiles  # noqa: E402
from tilewise.vae.plan.fast import FEWEST  # noqa: E402
from tilewise.vae.plan.make import make_plan, request  # noqa: E402
from tilewise.vae.plan.records import PassKind  # noqa: E402
from tilewise.vae.run.segments import tile_grid  # noqa: E402

NARROW = dict(blocks=(16, 32, 32, 32), groups=8)
BUDGET = 12_000_000  # (the default half of the tiles do not fit at once: staged, across the link on host)


def _plans(**fast):
    """Fast decode plans at tile 16 within BUDGET: staging on the device and in host memory."""
    with fake():
        vae = build_vae("sd", torch.float16, "meta", **NARROW)
        tv = tw.TiledVAE(vae, mode="fast", memory_budget=BUDGET, progress=False, device_kind="cuda", **fast)
        job, shape = tv.job("decode"), (1, 4, 64, 64)
        return [make_plan(tv.settings, job, shape, request(tv.settings, job, 16, st).replace(fast_cuts=None))
                for st in ("device", "host")]


def test_fast_plan_samples_what_fits_on_the_device_when_cheaper_than_staging_over_the_link():
    device, host = _plans()
    default_device, default_host = _plans(fast_sample=0.5)  # (the default sample, given: no fewer)
    assert any(q.kind is PassKind.SAMPLED_STAGED for q in default_host.passes)
    assert default_host.h2d + default_host.d2h > 0 and default_device.peak > BUDGET
    # the plan samples fewer tiles, together on the device: no value crosses the link (only the statistics'
    # merge weights, 8 B a merged tile, go to the device), within the budget
    assert device.choices.fast_most > 0 and device.peak <= BUDGET and device.d2h == 0 and device.h2d < 4096
    assert not any(q.kind is PassKind.SAMPLED_STAGED for q in device.passes)
    assert device.seconds < default_host.seconds
    # ... but at least FEWEST of the tiles (the estimator's measured error: BENCHMARKS.md #31)
    grid = tile_grid((64, 64), 16)
    assert len(sample_tiles(grid, 0.5, device.choices.fast_most)) >= FEWEST * grid.rows * grid.cols


def test_cpu_fast_plans_and_given_samples_sample_as_before():
    with fake():
        vae = build_vae("sd", torch.float16, "meta", **NARROW)
        tv = tw.TiledVAE(vae, mode="fast", memory_budget=BUDGET, progress=False)
        plan = tv.plan((1, 4, 64, 64), kind="decode")
    assert plan.choices.fast_most == 0
    assert all(p.choices.fast_most == 0 for p in _plans(fast_sample=0.5))


def test_fast_gpu_plan_tries_no_tile_below_half_the_first_that_fits(monkeypatch):
    # (settle.FAST_DESCENT: smaller tiles only add halo work and launches, and cost planning time; within
    # 6 MB host staging fits at tile 16, device staging at none: tried down to 8, not 4)
    from tilewise.vae.plan import settle

    tried, fitted = [], []
    visit = settle._Search.visit

    def recorded(self, tile, st, bands, fits, settled):
        tried.append(tile)
        visit(self, tile, st, bands, fits, settled)
        fitted.extend(q.tile_size for q in fits[len(fitted):])

    monkeypatch.setattr(settle._Search, "visit", recorded)
    with fake():
        vae = build_vae("sd", torch.float16, "meta", **NARROW)
        tv = tw.TiledVAE(vae, mode="fast", memory_budget=6_000_000, progress=False, device_kind="cuda")
        plan = tv.plan((1, 4, 64, 64), kind="decode")
    assert fitted and plan.tile_size in fitted and plan.peak <= 6_000_000
    assert min(tried) * 2 >= max(fitted) and min(tried) < max(fitted)  # (it did try below the first)
