"""Fast mode's staged sampled tiles, and its exact latent-resolution pass, recompute values instead of
staging them (issue #31): the same statistics and outputs as staging them (fp32 <= 1e-5), the plan's bytes
those its run moves, and GPU plans recomputing only where their time model finds it faster (planned on
fake tensors: no GPU needed)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from counting import build_vae, count, fake  # noqa: E402
from vae_support import kl_vae, structured_latent  # noqa: E402

import tilewise as tw  # noqa: E402
from tilewise.locality import lower  # noqa: E402
from tilewise.locality.ops import OpKind  # noqa: E402
from tilewise.locality.program import recomputable, recompute, split_segments  # noqa: E402
from tilewise.vae.devices import CUDA  # noqa: E402
from tilewise.vae.fast.estimators import sample_tiles, staged_tile_stats  # noqa: E402
from tilewise.vae.fast.split import fast_split, piece_cuts, split_program  # noqa: E402
from tilewise.vae.plan.fast_programs import staged_cuts  # noqa: E402
from tilewise.vae.plan.make import make_plan, request  # noqa: E402
from tilewise.vae.plan.records import PassKind  # noqa: E402
from tilewise.vae.run.options import RunOptions  # noqa: E402
from tilewise.vae.run.segments import tile_grid  # noqa: E402
from tilewise.vae.runner import run_once  # noqa: E402
from tilewise.vae.settings import FastSettings, Kind, Mode  # noqa: E402

NARROW = dict(blocks=(16, 32, 32, 32), groups=8)


def _chained(part):
    """Every value the staged pass over `part` could recompute, taken one by one in program order
    (chains: a value remade through values recomputed before it)."""
    segs = split_segments(part, lambda op: op.kind is OpKind.GROUP_NORM)
    values = []
    while True:
        left = [v for v in recomputable(recompute(segs, values, part.input), part.input, longer=True)
                if v not in values]
        if not left:
            return tuple(values)
        values.append(left[0])


def _recomputing(tv, job, shape, plan, most: int | None = None, low: bool = True):
    """`plan` with the values of its exact pass, low pass (`low`) and staged sampled tiles' pass recomputed
    (`fast.staged_cuts`), one by one in program order (at most `most` in each pass's cut)."""
    values = {"recompute": [], "low_recompute": []}
    while True:
        ask = plan.choices.replace(**{f: tuple(vs) for f, vs in values.items()})
        left = []
        for segs, given, f in staged_cuts(job, tv.settings, ask):
            made = {op.dst for seg in segs for op in seg.ops}
            if (low or f == "recompute") and (most is None or sum(v in made for v in values[f]) < most):
                left += [(f, v) for v in recomputable(segs, given, longer=True) if v not in values[f]]
        if not left:
            return make_plan(tv.settings, job, shape, ask)
        values[left[0][0]].append(left[0][1])


def test_staged_sampled_tiles_recomputing_give_the_statistics_and_outputs_of_staging():
    vae = kl_vae("sd")
    p = lower(vae.decoder)
    k = fast_split(p, Kind.DECODE, Mode.FAST, FastSettings())
    part = split_program(p, k)[1]
    x = structured_latent(1, part.in_channels, 12, 10)  # (odd tiles at the border)
    fixed = {id(op) for op in part.ops if op.kind is OpKind.GROUP_NORM}
    tiles = sample_tiles(tile_grid(tuple(x.shape[-2:]), 4), 0.5)
    values = _chained(part)
    got = {}
    with torch.no_grad():
        for name, rec in (("staged", ()), ("recomputed", values)):
            got[name] = staged_tile_stats(part, x, part.input, tiles, fixed,
                                          RunOptions(staging="host", progress=False, recompute=rec))
    (stats, done), (stats_r, done_r) = got["staged"], got["recomputed"]
    assert len(values) > len(fixed) // 2 and stats.keys() == stats_r.keys() == fixed
    for i in fixed:  # (the same statistics: the makers measure them; the readers' remade values agree)
        assert all((a - b).abs().max() <= 1e-5 * max(1.0, a.abs().max()) for a, b in
                   zip(stats[i], stats_r[i], strict=True))
    assert done.keys() == done_r.keys() and all((done[t] - done_r[t]).abs().max() <= 1e-5 for t in done)


def test_fast_decode_recomputing_in_its_head_and_sampled_tiles_equals_todays_fast_decode():
    torch.manual_seed(0)
    vae = build_vae("sd", torch.float32, "cpu", **NARROW)
    tv = tw.TiledVAE(vae, mode="fast", tile_size=4, fast_low=4, memory_budget=1_000_000, progress=False,
                     device_kind="cuda", fast_sample=0.5)
    z, job = structured_latent(1, 4, 12, 12), tv.job("decode")
    plan = tv.plan(tuple(z.shape))  # (the sampled tiles do not fit at once: staged, in host memory)
    forced = _recomputing(tv, job, tuple(z.shape), plan, most=4)  # (all: 2.5x the run's time)
    head = {op.dst for op in split_program(job.program, fast_split(job.program, Kind.DECODE, Mode.FAST,
                                                                    tv.settings.fast))[0].ops}
    with torch.no_grad():
        ref = run_once(tv.settings, job, z, plan.choices, None)[0]
        got = run_once(tv.settings, job, z, forced.choices, None)[0]
    assert plan.staged_estimate and plan.choices.recompute == plan.choices.low_recompute == ()
    assert len(forced.choices.recompute) == 8 and len(forced.choices.low_recompute) == 4
    assert len(head & set(forced.choices.recompute)) == 4  # (the exact head's and the sampled tiles')
    assert (got - ref).abs().max() <= 1e-5


@pytest.mark.parametrize("kind,pieces", [("decode", False), ("decode", True), ("encode", False)])
def test_fast_plan_counts_a_recomputing_run_to_the_byte(kind, pieces):
    with fake():  # (pieces: the part cut at both its upsamplings, each piece recomputing its own values;
        # encode: its exact tail recomputing too)
        vae = build_vae("sd", torch.float16, "meta", **NARROW)
        tv = tw.TiledVAE(vae, mode="fast", tile_size=8, fast_low=4, memory_budget=3_000_000, progress=False,
                         device_kind="cuda", fast_sample=0.5)
        job = tv.job(kind)
        t = torch.randn(1, 4, 32, 32) if kind == "decode" else torch.randn(1, 3, 256, 256)
        t, tile = t.to("meta", torch.float16), 8 if kind == "decode" else 16
        cuts = piece_cuts(job.program, job.kind, Mode.FAST, tv.settings.fast) if pieces else ()
        base = make_plan(tv.settings, job, tuple(t.shape), request(tv.settings, job, tile, "host")
                         .replace(fast_cuts=cuts))
        plan = _recomputing(tv, job, tuple(t.shape), base)
        with count("meta") as c:
            run_once(tv.settings, job, t, plan.choices, None)
    assert plan.choices.recompute and plan.choices.low_recompute and plan.choices.staged_estimate
    assert len(plan.fast_cuts) == 2 * pieces
    assert plan.flops == c.flops > base.flops  # (the readers' recomputed convolutions)
    assert (plan.h2d, plan.d2h) == (c.h2d, c.d2h) and plan.h2d < base.h2d and plan.d2h < base.d2h
    assert abs(plan.launches - c.launches) <= 0.03 * c.launches and plan.syncs == base.syncs
    assert abs(plan.syncs - c.syncs) <= 1  # (the plan that stages is one off too here)
    assert c.device_peak("meta") <= plan.peak <= 1.15 * c.device_peak("meta")


@pytest.mark.parametrize("link", [1e9, float("inf")])
def test_fast_gpu_plans_recompute_the_sampled_tiles_where_their_time_model_finds_it_faster(link):
    # (full-width SD, 64 x 64 latent, tile 16, 40 MiB: the sampled tiles staged in host memory; over a
    # slow link their values are cheaper to remake than to move, over a free one never)
    with fake():
        vae = build_vae("sd", torch.float16, "meta")
        tv = tw.TiledVAE(vae, mode="fast", tile_size=16, memory_budget=40 << 20, progress=False,
                         device_kind=CUDA.replace(link_bytes_s=link))
        shape, job = (1, 4, 64, 64), tv.job("decode")
        plan = tv.plan(shape)
        staged = make_plan(tv.settings, job, shape, plan.choices.replace(recompute=(), low_recompute=()))
    [q] = [q for q in plan.passes if q.kind is PassKind.SAMPLED_STAGED]
    [r] = [r for r in staged.passes if r.kind is PassKind.SAMPLED_STAGED]
    assert plan.staging.value == "host" and plan.peak <= 40 << 20
    if link < float("inf"):
        assert plan.choices.recompute and plan.seconds < staged.seconds
        assert q.h2d + q.d2h < r.h2d + r.d2h and q.flops > r.flops and len(q.stages) < len(r.stages)
        assert "recomputed by their readers" in str(plan)
    else:
        assert plan.choices.recompute == plan.choices.low_recompute == ()
        assert (q.h2d, q.flops) == (r.h2d, r.flops)
