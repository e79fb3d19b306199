"""Recomputation over staging (#31): a GroupNorm input its readers remake from staged values they read
anyway, measured by its maker but never stored, and chains of them (a value remade through values
recomputed themselves, from the chain's staged leaves); exact against the stock VAE, counted as it runs,
and chosen by GPU plans only where their time model finds it faster."""

import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from counting import build_vae, count, fake  # noqa: E402
from vae_support import kl_vae, structured_latent  # noqa: E402

import tilewise as tw  # noqa: E402
from tilewise.locality import lower  # noqa: E402
from tilewise.locality.program import recomputable, recompute  # noqa: E402
from tilewise.vae.plan.make import make_plan, request  # noqa: E402
from tilewise.vae.plan.settle import _recomputed  # noqa: E402
from tilewise.vae.run.executor import Executor  # noqa: E402
from tilewise.vae.run.options import RunOptions  # noqa: E402
from tilewise.vae.run.segments import cut  # noqa: E402
from tilewise.vae.runner import run_once  # noqa: E402
from tilewise.vae.settings import Attention  # noqa: E402

NARROW = dict(blocks=(16, 32, 32, 32), groups=8)


def _values(p):
    return tuple(recomputable(cut(p, {}, "global"), p.input))


def _chained(p, most: int | None = None):
    """Values recomputable through chains (`longer`), taken one by one in program order (at most `most`)."""
    segs, values = cut(p, {}, Attention.GLOBAL), []
    while most is None or len(values) < most:
        left = [v for v in recomputable(recompute(segs, values, p.input), p.input, longer=True)
                if v not in values]
        if not left:
            break
        values.append(left[0])
    return tuple(values)


def _through(segs) -> int:
    """The most GroupNorms one segment runs again (1: a value remade one level; more: through a chain)."""
    return max(sum(op.kind.value == "group_norm" and id(op) in s.again for op in s.ops) for s in segs)


# (disk: ~1 min inside the suite, 10x its host run; disk staging's exactness is test_vae's)
@pytest.mark.parametrize("staging", ["device", "host", pytest.param("disk", marks=pytest.mark.slow)])
def test_recomputing_decode_equals_the_stock_decoder(staging):
    vae = kl_vae("sd")
    z = structured_latent(2, 4, 13, 11)  # (odd sizes, 5 x 4 tiles of 3)
    p = lower(vae.decoder)
    values = _values(p)
    with torch.no_grad():
        ref = vae.decoder(z)
        got = Executor(p, 3, p.input, RunOptions(staging=staging, progress=False, recompute=values)).run(z)
    assert len(values) >= 5  # (each resnet block's second norm input, from the block input)
    assert (got.output - ref).abs().max() <= 1e-4


def test_recomputing_encode_equals_the_stock_encoder():
    vae = kl_vae("sd")
    x = torch.randn(1, 3, 30, 26, generator=torch.Generator().manual_seed(3))
    p = lower(vae.encoder)
    values = _values(p)
    with torch.no_grad():
        ref = vae.encoder(x)
        got = Executor(p, 2, p.output, RunOptions(staging="host", progress=False, recompute=values)).run(x)
    assert values and (got.output - ref).abs().max() <= 1e-4


def test_a_recomputed_value_is_measured_by_its_maker_and_remade_by_its_reader():
    p = lower(kl_vae("sd").decoder)
    segs = cut(p, {}, "global")
    v = _values(p)[0]
    after = recompute(segs, [v], p.input)
    maker = next(s for s in after if v in s.outputs)
    readers = [s for s in after if v in {op.dst for op in s.ops} and s is not maker]
    assert maker.measured == [v] and readers and all(v not in s.inputs for s in after)
    assert all(s.again and len(s.ops) > len(segs[after.index(s)].ops) for s in readers)
    segs = cut(p, {}, Attention.GLOBAL)
    other = next(u for s in segs if s.kind.value == "attention" for u in s.inputs)  # (read whole)
    with pytest.raises(ValueError, match=f"value '{other}' cannot be recomputed by its readers"):
        recompute(segs, [other], p.input)


def test_chains_are_remade_from_their_staged_leaves():
    p = lower(kl_vae("sd").decoder)
    segs = cut(p, {}, Attention.GLOBAL)
    one, chained = _values(p), _chained(p)
    after = recompute(segs, chained, p.input)
    staged = [{u for s in g for u in s.inputs} - {p.input} for g in (segs, after)]
    assert set(one) < set(chained) and _through(after) > 2  # (a reader remakes several blocks)
    assert staged[1] < staged[0] and staged[1].isdisjoint(chained)
    # (a resnet's shortcut, read by its residual add only: recomputed in a chain, never one level)
    shortcut = [v for v in chained
                if not any(op.kind.value == "group_norm" and op.src[0] == v for op in p.ops)]
    assert shortcut and not set(shortcut) & set(one)


# (disk: slow, as above)
@pytest.mark.parametrize("staging", ["device", "host", pytest.param("disk", marks=pytest.mark.slow)])
def test_recomputing_chains_decode_equals_the_stock_decoder(staging):
    vae = kl_vae("sd")
    z = structured_latent(2, 4, 13, 11)
    p = lower(vae.decoder)
    values = _chained(p)
    with torch.no_grad():
        ref = vae.decoder(z)
        got = Executor(p, 3, p.input, RunOptions(staging=staging, progress=False, recompute=values)).run(z)
    assert _through(cut(p, {}, Attention.GLOBAL, values)) > 2
    assert (got.output - ref).abs().max() <= 1e-4


def test_recomputing_chains_encode_equals_the_stock_encoder():
    vae = kl_vae("sd")
    x = torch.randn(1, 3, 30, 26, generator=torch.Generator().manual_seed(3))
    p = lower(vae.encoder)
    values = _chained(p)
    with torch.no_grad():
        ref = vae.encoder(x)
        got = Executor(p, 2, p.output, RunOptions(staging="host", progress=False, recompute=values)).run(x)
    assert set(_values(p)) < set(values) and (got.output - ref).abs().max() <= 1e-4


def test_gpu_plan_counts_a_recomputing_run_and_stages_less():
    with fake():
        vae = build_vae("sd", torch.float16, "meta", **NARROW)
        tv = tw.TiledVAE(vae, tile_size=4, staging="host", progress=False, device_kind="cuda",
                         memory_budget=64 << 20)
        z = torch.randn(2, 4, 22, 19).to("meta", torch.float16)
        job = tv.job("decode")
        base = make_plan(tv.settings, job, tuple(z.shape), request(tv.settings, job, 4, "host"))
        ask = base.choices.replace(recompute=_values(job.program))
        plan = make_plan(tv.settings, job, tuple(z.shape), ask)
        with count("meta") as c:
            run_once(tv.settings, job, z, plan.choices, None)
    assert plan.flops == c.flops > base.flops  # (the readers' recomputed convolutions, on bigger halos)
    assert plan.h2d == c.h2d < base.h2d and plan.d2h == c.d2h < base.d2h
    assert abs(plan.launches - c.launches) <= 0.03 * c.launches and plan.syncs == c.syncs + 1
    assert c.device_peak("meta") <= plan.peak <= 1.15 * c.device_peak("meta")
    assert len(plan.stages) == len(base.stages) - len(plan.choices.recompute)
    assert plan.staging_floor <= base.staging_floor
    assert "recomputed by their readers" in str(plan) and "of the values it stages" in str(plan)


@pytest.mark.parametrize("staging", ["host", "device"])
@pytest.mark.parametrize("most", [12, None])
def test_gpu_plan_counts_a_chained_run_to_the_byte(staging, most):
    with fake():  # (tiles of 4 on 22 x 19: a long chain's halo is the whole value, two tiles in a row
        # read the same box, each its own copy ahead)
        vae = build_vae("sd", torch.float16, "meta", **NARROW)
        tv = tw.TiledVAE(vae, tile_size=4, staging=staging, progress=False, device_kind="cuda",
                         memory_budget=64 << 20)
        z = torch.randn(2, 4, 22, 19).to("meta", torch.float16)
        job = tv.job("decode")
        values = _chained(job.program, most)
        base = make_plan(tv.settings, job, tuple(z.shape), request(tv.settings, job, 4, staging))
        plan = make_plan(tv.settings, job, tuple(z.shape), base.choices.replace(recompute=values))
        with count("meta") as c:
            run_once(tv.settings, job, z, plan.choices, None)
    assert _through(cut(job.program, {}, Attention.GLOBAL, values)) > 2
    assert plan.flops == c.flops > base.flops and (plan.h2d, plan.d2h) == (c.h2d, c.d2h)
    assert abs(plan.launches - c.launches) <= 0.03 * c.launches
    assert c.device_peak("meta") <= plan.peak <= 1.15 * c.device_peak("meta")
    if staging == "host":
        assert plan.d2h < base.d2h  # (fewer values stored)


@pytest.mark.parametrize("link", [1e7, 1e15])
def test_gpu_plans_recompute_where_their_time_model_finds_it_faster(link):
    from tilewise.vae.devices import CUDA

    with fake():  # (a slow link: recomputing beats the transfers; one as fast as memory: it does not)
        vae = build_vae("sd", torch.float16, "meta", **NARROW)
        shape, budget = (1, 4, 32, 32), 8 << 20
        gpu = CUDA.replace(link_bytes_s=link)
        tv = tw.TiledVAE(vae, memory_budget=budget, progress=False, device_kind=gpu)
        job = tv.job("decode")
        host = make_plan(tv.settings, job, shape, request(tv.settings, job, 8, "host"))
        chosen = _recomputed(tv.settings, job, shape, host)
        cpu = tw.TiledVAE(vae, memory_budget=256 << 20, progress=False, device_kind="cpu").plan(shape)
        z = torch.randn(shape).to("meta", torch.float16)
        with count("meta") as c:
            run_once(tv.settings, job, z, chosen.choices, None)
    assert host.peak <= budget and chosen.peak <= budget
    assert (chosen.h2d, chosen.d2h, chosen.flops) == (c.h2d, c.d2h, c.flops)
    if link < 1e10:
        assert chosen.choices.recompute and chosen.seconds < host.seconds and chosen.h2d < host.h2d
        assert set(chosen.choices.recompute) - set(_values(job.program))  # (chains, shortcuts)
    else:
        assert chosen.choices.recompute == () and chosen is host
    assert cpu.choices.recompute == ()


def test_gradients_refuse_recomputed_values():
    from tilewise.vae.run.reverse import backward

    vae = kl_vae("sd")
    z = structured_latent(1, 4, 6, 6)
    p = lower(vae.decoder)
    ex = Executor(p, 3, p.input, RunOptions(progress=False, recompute=_values(p)))
    with pytest.raises(ValueError, match="for forward runs, not gradients"):
        backward(ex, None, {}, z, torch.ones(1, 3, 12, 12), (), True)
