"""Batched tiles (vae.run.batches): a segment's same-shape tiles run stacked as one batch, equal to the stock
VAE and to the tile-by-tile run, and counted by the plan (launches once a batch, the batch in the peak)."""

import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from counting import build_vae, count, fake  # noqa: E402
from vae_support import kl_vae, structured_latent  # noqa: E402

import tilewise as tw  # noqa: E402
from tilewise.locality import lower  # noqa: E402
from tilewise.vae.plan.make import make_plan, request  # noqa: E402
from tilewise.vae.run.batches import batch_groups  # noqa: E402
from tilewise.vae.run.executor import Executor  # noqa: E402
from tilewise.vae.run.options import Choices, RunOptions  # noqa: E402
from tilewise.vae.runner import run_once  # noqa: E402

NARROW = dict(blocks=(16, 32, 32, 32), groups=8)


def _runs(p, tile, ref, x, staging, batch):
    with torch.no_grad():
        return [Executor(p, tile, ref, RunOptions(staging=staging, progress=False, tile_batch=n)).run(x)
                for n in (1, batch)]


@pytest.mark.parametrize("kind,shape,tile,staging", [("flux", (1, 16, 10, 12), 3, "device"),
                                                     ("flux", (2, 16, 8, 9), 2, "host"),
                                                     ("sd", (2, 4, 13, 11), 3, "disk")])
def test_batched_exact_decode_equals_the_stock_decoder_and_the_tile_by_tile_run(kind, shape, tile, staging):
    vae = kl_vae(kind)
    z = structured_latent(*shape)
    p = lower(vae.decoder)
    one, many = _runs(p, tile, p.input, z, staging, 4)
    with torch.no_grad():
        ref = vae.decoder(z)
    assert one.batched == 0 and many.batched > 0  # (B=2: tiles x samples stacked, tile-major)
    assert (many.output - ref).abs().max() <= 1e-4
    assert (many.output - one.output).abs().max() <= 1e-5
    for op_id, (mean, var) in one.stats.items():  # (the moments per tile core and per sample, merged)
        assert torch.allclose(many.stats[op_id][0], mean, rtol=0, atol=1e-6)
        assert torch.allclose(many.stats[op_id][1], var, rtol=1e-5, atol=1e-7)


def test_batched_tile_local_attention_streams_each_core_once_in_row_order():
    vae = kl_vae("flux")
    z = structured_latent(1, 16, 10, 12)
    p = lower(vae.decoder)
    got, boxes = torch.full((1, 3, 20, 24), float("nan")), []

    def emit(box, value):
        got[..., box[0]:box[1], box[2]:box[3]] = value
        boxes.append(box)

    with torch.no_grad():  # (attention="tile": each tile's queries against its own box's keys)
        runs = [Executor(p, 3, p.input, RunOptions(attention="tile", tile_batch=n, progress=False))
                for n in (1, 4)]
        one, many = runs[0].run(z).output, runs[1].run(z, emit)
    assert many.output is None and many.batched > 0 and len(boxes) == 4 * 4
    assert [b[0] for b in boxes] == sorted(b[0] for b in boxes)  # (the sink gets its rows in order)
    assert (got - one).abs().max() <= 1e-5


def test_batched_exact_encode_with_odd_sizes_equals_the_stock_encoder():
    vae = kl_vae("flux")
    x = torch.randn(2, 3, 30, 26, generator=torch.Generator().manual_seed(2))
    p = lower(vae.encoder)
    one, many = _runs(p, 3, p.output, x, "device", 3)
    with torch.no_grad():
        ref = vae.encoder(x)
    assert many.batched > 0 and (many.output - ref).abs().max() <= 1e-4
    assert (many.output - one.output).abs().max() <= 1e-5


def test_batched_fast_decode_equals_its_tile_by_tile_run():
    # (fast mode's segments span the decoder: tiles whose boxes stay off the borders need a larger latent;
    # the sampled-tile estimator's other tiles, device staging, B=2; that the run batches what its plan
    # counts: test_gpu_plan_counts_a_batched_run)
    vae = kl_vae("flux")
    z = structured_latent(2, 16, 32, 30)
    tv = tw.TiledVAE(vae, mode="fast", tile_size=8, progress=False)
    job, shape = tv.job("decode"), tuple(z.shape)
    choices = tv.plan(shape).choices
    assert choices.tile_batch == 1  # (a CPU plan runs tile by tile)
    one, many = [make_plan(tv.settings, job, shape, choices.replace(tile_batch=n)) for n in (1, 4)]
    assert many.launches < one.launches and many.flops == one.flops
    with torch.no_grad():
        ref = vae.decode(z).sample
        outs = [run_once(tv.settings, job, z, q.choices, None)[0] for q in (one, many)]
    assert (outs[1] - outs[0]).abs().max() <= 1e-5
    err = [(o - ref).abs().max().item() for o in outs]  # (fast mode's own error, the same)
    assert abs(err[1] - err[0]) <= 1e-5


def test_batched_fast_crops_run_with_host_staging_equals_its_tile_by_tile_run():
    from tilewise.vae.fast.run import crop_stats

    vae = kl_vae("flux")
    z = structured_latent(1, 16, 40, 33)
    tv = tw.TiledVAE(vae, mode="fast", fast_estimator="crops", tile_size=8, progress=False)
    job = tv.job("decode")
    with torch.no_grad():
        fixed = crop_stats(job, tv.settings.fast, z, 8, None)
        runs = [RunOptions(staging="host", band_bytes=None, tile_batch=n, progress=False) for n in (1, 3)]
        one, many = [Executor(job.program, 8, job.ref, o, fixed_stats=fixed).run(z) for o in runs]
    assert one.batched == 0 and many.batched > 0
    assert (many.output - one.output).abs().max() <= 1e-5


@pytest.mark.parametrize("mode,staging", [("exact", "device"), ("exact", "host"), ("fast", "device")])
def test_gpu_plan_counts_a_batched_run(mode, staging):
    with fake():
        vae = build_vae("sd", torch.float16, "meta", **NARROW)
        tv = tw.TiledVAE(vae, tile_size=4, staging=staging, mode=mode, progress=False, device_kind="cuda")
        z = torch.randn(2, 4, 24, 20).to("meta", torch.float16)
        job = tv.job("decode")
        many = make_plan(tv.settings, job, tuple(z.shape), request(tv.settings, job, 4, staging).replace(
            tile_batch=4))
        one = make_plan(tv.settings, job, tuple(z.shape), many.choices.replace(tile_batch=1))  # (its pieces)
        with count("meta") as c:  # (batch 1 against its run: test_counting)
            run_once(tv.settings, job, z, many.choices, None)
    assert many.tile_batch == 4 and one.tile_batch == 1
    assert abs(many.launches - c.launches) <= 0.03 * c.launches
    assert many.launches < (0.9 if mode == "exact" else 1) * one.launches  # (fast: one long segment)
    assert many.flops == c.flops or mode == "fast"  # (fast mode: its estimate of the low pass ...)
    assert many.flops == one.flops  # (... the same as batch 1's)
    assert many.syncs == c.syncs + 1 and many.d2h == c.d2h  # (+1: the call's input check)
    assert many.h2d == c.h2d or mode == "fast"  # (fast mode's low pass's input: counted apart)
    assert c.device_peak("meta") <= many.peak <= 1.15 * c.device_peak("meta")
    assert many.peak > one.peak or mode == "fast"  # (a batch's tiles together; fast: its sampled tiles'
    # pass holds more)
    assert "batches of <= 4" in str(many) and "batches" not in str(one)


def test_gpu_settle_batches_tiles_within_the_budget_and_cpu_plans_do_not():
    with fake():
        vae = build_vae("sd", torch.float16, "meta", **NARROW)
        z = torch.randn(1, 4, 96, 96).to("meta", torch.float16)
        budget = 6 << 20
        tv = tw.TiledVAE(vae, memory_budget=budget, progress=False, device_kind="cuda")
        plan = tv.plan(tuple(z.shape))
        job = tv.job("decode")
        alone = make_plan(tv.settings, job, tuple(z.shape), plan.choices.replace(tile_batch=1))
        with count("meta") as c:
            tv.decode(z)
        cpu = tw.TiledVAE(vae, memory_budget=48 << 20, progress=False, device_kind="cpu").plan(tuple(z.shape))
    assert plan.tile_batch > 1 and plan.peak <= budget and plan.seconds < alone.seconds
    assert abs(plan.launches - c.launches) <= 0.03 * c.launches and c.device_peak("meta") <= plan.peak
    assert cpu.tile_batch == 1


def test_groups_are_one_class_in_run_order_and_rows_when_asked():
    from tilewise.vae.run.segments import tile_grid

    grid = tile_grid((9, 12), 3)  # 3 x 4 tiles, serpentine
    items = [(t, "edge" if t.col in (0, 3) else "inner") for t in grid]
    groups = batch_groups(items, 3, by_row=False)
    assert [len(g) for g in groups] == [3, 3, 3, 3]
    assert all(len({key for _, key in g}) == 1 for g in groups)
    assert sorted(t.index for g in groups for t, _ in g) == list(range(12))
    rows = batch_groups(items, 3, by_row=True)
    assert all(len({t.row for t, _ in g}) == 1 for g in rows) and len(rows) == 6


def test_stacked_affine_gives_each_tile_its_samples_group_norm():
    from tilewise.locality.affine import apply_affine, group_norm_affine

    g = torch.Generator().manual_seed(4)
    tiles = [torch.randn(2, 8, 5, 3, generator=g) * 2 + 1 for _ in range(3)]
    mean = torch.randn(2, 4, dtype=torch.float64, generator=g)
    var = torch.rand(2, 4, dtype=torch.float64, generator=g) + 0.5
    w, b = torch.randn(8, generator=g), torch.randn(8, generator=g)
    affine = group_norm_affine((mean, var), 4, 1e-6, w, b, torch.float32, 8)
    stacked = apply_affine(torch.cat(tiles), affine)
    assert torch.equal(stacked, torch.cat([apply_affine(t, affine) for t in tiles]))
    with pytest.raises(ValueError, match="batch of 5"):
        apply_affine(torch.randn(5, 8, 2, 2), affine)


@pytest.mark.parametrize("bad", [0, -2, 1.5, True])
def test_tile_batch_must_be_a_positive_int(bad):
    with pytest.raises(ValueError, match="tile_batch must be an int >= 1"):
        RunOptions(tile_batch=bad)
    with pytest.raises(ValueError, match="tile_batch must be an int >= 1"):
        Choices(4, "device", tile_batch=bad)
