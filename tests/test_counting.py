"""Counting what runs dispatch (benchmarks/counting.py), and plans checked against the counts.

The counts are the same on any machine: fake tensors on the meta device dispatch what a real CPU run
does, so sizes and devices that cannot run here are counted there.
"""

import contextlib
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from counting import build_vae, count, fake  # noqa: E402

import tilewise as tw  # noqa: E402
from tilewise.vae.devices import CPU, CUDA  # noqa: E402

NARROW = dict(blocks=(16, 32, 32, 32), groups=8)


def _on(device: str):
    return fake() if device == "meta" else contextlib.nullcontext()


def _counted(device, run, *args):
    with count(device) as c:
        run(*args)
    return c


def _encode_run(tv, x):
    """tv.encode(x) without the posterior's own kernels (what the plan covers is the program)."""
    from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution

    with count(x.device.type) as c:
        h = tv.encode(x).latent_dist.parameters
    with count(x.device.type) as d:
        DiagonalGaussianDistribution(torch.empty_like(h))
    c.launches -= d.launches
    return c


def test_fake_meta_run_counts_what_a_cpu_run_counts():
    got = {}
    for device in ("cpu", "meta"):
        with _on(device):
            vae = build_vae("sd", torch.float32, device, **NARROW)
            z = torch.randn(1, 4, 16, 16, device=device)
            tv = tw.TiledVAE(vae, tile_size=8, progress=False, device_kind="cuda")
            got[device] = [_counted(device, vae.decode, z), _counted(device, tv.decode, z)]
    for real, meta in zip(got["cpu"], got["meta"], strict=True):
        assert (real.launches, real.views, real.syncs, real.flops) == (meta.launches, meta.views, meta.syncs,
                                                                       meta.flops)
        assert real.ops == meta.ops and real.device_peak("cpu") == meta.device_peak("meta") > 0


@pytest.mark.parametrize("kind", ["decode", "encode"])
@pytest.mark.parametrize("staging,query_chunk", [("device", 4096), ("host", 4096), ("device", 64)])
def test_gpu_plan_counts_flops_launches_transfers_and_peak_of_the_run(kind, staging, query_chunk):
    with fake():  # (query_chunk 64: keys and values made in bands, projected into their stores)
        vae = build_vae("sd", torch.float16, "meta", **NARROW)
        tv = tw.TiledVAE(vae, tile_size=8, staging=staging, progress=False, device_kind="cuda",
                         query_chunk=query_chunk)
        t = torch.randn(1, 4, 16, 16) if kind == "decode" else torch.randn(1, 3, 128, 128)
        t = t.to("meta", torch.float16)
        plan = tv.plan(tuple(t.shape), kind=kind)
        c = _counted("meta", tv.decode, t) if kind == "decode" else _encode_run(tv, t)
    assert plan.device == "cuda" and "planned for: cuda" in str(plan)
    assert plan.flops == c.flops and plan.syncs == c.syncs
    assert abs(plan.launches - c.launches) <= 0.03 * c.launches
    assert (plan.h2d, plan.d2h) == (c.h2d, c.d2h)
    assert (c.d2h > 0) == (staging == "host") and c.h2d > (1 << 20 if staging == "host" else 0)
    assert c.device_peak("meta") <= plan.peak <= 1.15 * c.device_peak("meta")


def test_gpu_plans_run_whole_tiles_and_no_im2col_bands():
    from tilewise.locality import lower

    with fake():
        vae = build_vae("sd", torch.float32, "meta", **NARROW)
        z = torch.randn(1, 4, 16, 16, device="meta")
        convs = sum(op.kind == "conv" for op in lower(vae.decoder).ops) + 1  # and post_quant_conv
        runs = {}
        # (bands of 4 MiB: a few per tile, enough to show them; smaller bands count many more ops, slowly)
        banded = CPU.replace(conv_workspace=1 << 20, band_bytes=4 << 20)
        for name, prof in (("cuda", CUDA), ("cpu", banded)):
            tv = tw.TiledVAE(vae, tile_size=8, progress=False, device_kind=prof)
            runs[name] = (tv.plan(tuple(z.shape)), _counted("meta", tv.decode, z))
    plan, c = runs["cuda"]
    assert plan.band_bytes is None and plan.grid == (2, 2)
    assert c.ops["convolution"] == 4 * convs  # every conv once per tile: no bands of any kind
    small_plan, small = runs["cpu"]
    assert small_plan.band_bytes == 4 << 20 and small.ops["convolution"] > 4 * convs
    assert small.launches > c.launches


def test_gpu_settle_takes_the_untiled_run_when_it_fits_and_stays_within_smaller_budgets():
    with fake():
        vae = build_vae("sd", torch.float16, "meta", **NARROW)
        z = torch.randn(1, 4, 32, 32, device="meta", dtype=torch.float16)
        untiled = _counted("meta", vae.decode, z)
        kinds = {}
        for budget in (2 * untiled.device_peak("meta"), untiled.device_peak("meta") // 2,
                       untiled.device_peak("meta") // 6):
            tv = tw.TiledVAE(vae, memory_budget=int(budget), progress=False, device_kind="cuda")
            plan = tv.plan(tuple(z.shape))
            c = _counted("meta", tv.decode, z)
            kinds[budget] = (plan.untiled, plan.staging)
            assert c.device_peak("meta") <= plan.peak <= budget  # device peak within the budget, measured
            if plan.untiled:
                assert c.launches <= untiled.launches + 40  # (its pads apart: the untiled decode itself)
    assert list(kinds.values())[0] == (True, "device")
    assert all(not u for u, _ in list(kinds.values())[1:])


@contextlib.contextmanager
def _staged_decode():
    """Under fake tensors: a narrow SD VAE, a 32x32 latent, and the peaks of its device- and host-staged
    CUDA plans at tile 8 (hi, lo) with the host-staged wrapper."""
    with fake():
        vae = build_vae("sd", torch.float16, "meta", **NARROW)
        z = torch.randn(1, 4, 32, 32, device="meta", dtype=torch.float16)
        dev = tw.TiledVAE(vae, tile_size=8, staging="device", progress=False, device_kind="cuda")
        host = tw.TiledVAE(vae, tile_size=8, staging="host", progress=False, device_kind="cuda")
        yield vae, z, dev.plan(tuple(z.shape)).peak, host.plan(tuple(z.shape)).peak, host


def test_device_plan_places_what_fits_on_the_device_and_the_rest_in_host_memory():
    with _staged_decode() as (vae, z, hi, lo, host):
        # (a link slow beside the compute: what host staging moves is not hidden under this small decode's
        # kernels, so placing values on the device pays)
        slow = CUDA.replace(link_bytes_s=5e9)
        tv = tw.TiledVAE(vae, memory_budget=(hi + lo) // 2, progress=False, device_kind=slow)
        plan = tv.plan(tuple(z.shape))
        c = _counted("meta", tv.decode, z)
    assert plan.staging == "device+host" and 0 < len(plan.on_device) < len(plan.stages)
    where = {s.where for s in plan.stages}  # (the rest in host memory, whole or split at a row: with
    # chains recomputed, the values left wholly in host memory may be none)
    assert "device" in where and where & {"host", "device+host"}
    assert where <= {"device", "host", "device+host"}
    assert c.device_peak("meta") <= plan.peak <= (hi + lo) // 2
    assert 0 < c.h2d < host.plan(tuple(z.shape)).h2d and plan.d2h == c.d2h


def test_split_placement_prints_what_its_run_moves_and_moves_less_than_whole_values():
    from tilewise.vae.plan.make import make_plan

    with _staged_decode() as (vae, z, hi, lo, _):
        slow = CUDA.replace(link_bytes_s=5e9)  # (as above: the transfers are what the placement saves)
        budgets, got = ((hi + lo) // 2,), []
        for budget in budgets:
            tv = tw.TiledVAE(vae, memory_budget=budget, progress=False, device_kind=slow)
            plan = tv.plan(tuple(z.shape))
            c = _counted("meta", tv.decode, z)
            whole = make_plan(tv.settings, tv.job("decode"), tuple(z.shape), plan.choices.replace(split=()))
            got.append((plan, c, whole))
        cpu = tw.TiledVAE(vae, memory_budget=48 << 20, progress=False, device_kind="cpu").plan(tuple(z.shape))
    for budget, (plan, c, whole) in zip(budgets, got, strict=True):
        assert plan.staging == "device+host" and plan.choices.split  # (values split at a row)
        assert "device+host" in {s.where for s in plan.stages}
        assert (plan.h2d, plan.d2h) == (c.h2d, c.d2h) and plan.flops == c.flops  # (to the byte)
        assert abs(plan.launches - c.launches) <= 0.03 * c.launches
        assert c.device_peak("meta") <= plan.peak <= budget
        assert plan.staging_floor <= c.h2d + c.d2h < whole.h2d + whole.d2h
    assert cpu.device == "cpu" and cpu.choices.split == () and cpu.staging != "device+host"


def test_re_placement_measures_its_room_on_the_all_host_plan_too():
    from tilewise.vae.plan.memo import remembered
    from tilewise.vae.plan.settle import place

    with _staged_decode() as (vae, z, hi, lo, _):
        slow = CUDA.replace(link_bytes_s=5e9)
        budget = (hi + lo) // 2
        tv = tw.TiledVAE(vae, memory_budget=budget, progress=False, device_kind=slow)
        plan = tv.plan(tuple(z.shape))
        job, shape = tv.job("decode"), tuple(z.shape)
        with remembered():  # (settle's recomputation and batches re-place with the plan's own choices)
            again = place(tv.settings, job, shape, plan.choices)
            fresh = place(tv.settings, job, shape, plan.choices.replace(on_device=frozenset(), split=()))
    assert plan.staging == "device+host" and plan.on_device
    assert again.peak <= budget and fresh.peak <= budget
    assert again.seconds <= fresh.seconds  # (the placements of the all-host room are among its own)
    with fake():  # SD decode at 4096 px within 16 GiB: the placement that keeps the re-placed plan's
        # values on the device recomputes 6 values and moves 26 MiB; measured on the all-host room alone,
        # 3 values and 6.0 GiB
        big = build_vae("sd", torch.float16, "meta")
    gpu = CUDA.replace(host_memory=64 << 30)
    plan = tw.TiledVAE(big, memory_budget=16 << 30, progress=False, device_kind=gpu).plan((1, 4, 512, 512))
    assert plan.staging == "device+host" and plan.h2d + plan.d2h < 64 << 20 and plan.peak <= 16 << 30


def test_split_placement_run_on_real_values_equals_the_stock_decode():
    vae = build_vae("sd", torch.float32, "cpu", **NARROW)
    z = torch.randn(1, 4, 32, 32, generator=torch.Generator().manual_seed(0))
    kw = dict(progress=False, device_kind=CUDA.replace(link_bytes_s=5e9))
    hi, lo = (tw.TiledVAE(vae, tile_size=8, staging=st, **kw).plan(tuple(z.shape)).peak
              for st in ("device", "host"))
    tv = tw.TiledVAE(vae, memory_budget=(hi + lo) // 2, **kw)
    plan = tv.plan(tuple(z.shape))
    with torch.no_grad():
        out, ref = tv.decode(z).sample, vae.decode(z).sample
    assert plan.choices.split and not plan.untiled
    assert (out - ref).abs().max() <= 1e-4


def test_device_profile_time_model_and_bad_kinds():
    prof = CUDA.replace(flops=1e12, flops_fp32=5e11, launch_s=1e-5, link_bytes_s=1e9)
    assert prof.seconds(2e12, 1000, 3e9, half=True) == pytest.approx(2 + 0.01 + 3)
    assert prof.seconds(2e12, 0, 0, half=False) == pytest.approx(4)
    assert prof.hidden(2e12, 1000, 3e9, half=True) == pytest.approx(2.01)  # (copies outlast the compute)
    assert prof.hidden(2e12, 0, 1e9, half=True) == pytest.approx(1)
    with pytest.raises(ValueError, match="device_kind must be.*'tpu'"):
        tw.TiledVAE(build_vae("sd", torch.float32, "cpu", **NARROW), device_kind="tpu")


def test_gpu_fast_mode_whose_one_tile_covers_the_latent_runs_untiled_and_cpu_plans_do_not():
    vae = build_vae("sd", torch.float32, "cpu", **NARROW)
    z = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = vae.decode(z).sample
    gpu = tw.TiledVAE(vae, tile_size=8, mode="fast", progress=False, device_kind="cuda")
    cpu = tw.TiledVAE(vae, tile_size=8, mode="fast", progress=False, device_kind="cpu")
    from tilewise.vae.plan.settle import settle  # (the plan a run follows)

    assert settle(gpu.settings, gpu.job("decode"), tuple(z.shape)).untiled
    assert not settle(cpu.settings, cpu.job("decode"), tuple(z.shape)).untiled
    budgeted = tw.TiledVAE(vae, mode="fast", memory_budget="1GiB", progress=False, device_kind="cuda")
    assert budgeted.plan(tuple(z.shape)).untiled
    c = _counted("cpu", gpu.decode, z)
    assert (gpu.decode(z).sample - ref).abs().max() <= 1e-4  # the untiled run itself: exact
    assert c.launches <= _counted("cpu", vae.decode, z).launches + 40  # (its pads and finite check apart)
    assert _counted("cpu", cpu.decode, z).launches > 2 * c.launches  # (CPU plans keep fast mode's passes)


@pytest.mark.slow  # (~50 s of plan search at a tight budget)
def test_gpu_plan_streams_attention_keys_values_from_host_memory_when_they_do_not_fit():
    with fake():
        # (a wide middle: global attention's keys and values are the biggest thing a segment holds)
        vae = build_vae("sd", torch.float16, "meta", blocks=(8, 8, 8, 128), groups=8)
        z = torch.randn(1, 4, 64, 64, device="meta", dtype=torch.float16)
        roomy = tw.TiledVAE(vae, memory_budget=6_000_000, progress=False, device_kind="cuda").plan(z.shape)
        tv = tw.TiledVAE(vae, memory_budget=2_000_000, progress=False, device_kind="cuda")
        plan = tv.plan(tuple(z.shape))
        c = _counted("meta", tv.decode, z)
        # unstreamed from host staging: its one band of keys and values reads the input and its tokens
        host = tw.TiledVAE(vae, tile_size=16, staging="host", progress=False, device_kind="cuda")
        whole, h = host.plan(tuple(z.shape)), _counted("meta", host.decode, z)
    assert h.device_peak("meta") <= whole.peak <= 1.15 * h.device_peak("meta")
    assert roomy.kv_chunk == 0 and plan.kv_chunk > 0 and plan.query_rows > 0
    assert "streamed" in str(plan) and plan.attention_bytes < roomy.attention_bytes
    assert plan.flops == c.flops and plan.syncs == c.syncs
    assert abs(plan.launches - c.launches) <= 0.03 * c.launches
    assert (plan.h2d, plan.d2h) == (c.h2d, c.d2h)
    assert c.device_peak("meta") <= plan.peak <= min(1.15 * c.device_peak("meta"), 2_000_000)


def test_streamed_plan_run_on_real_values_equals_the_stock_decode():
    vae = build_vae("sd", torch.float32, "cpu", blocks=(8, 8, 8, 128), groups=8)
    z = torch.randn(1, 4, 64, 64, generator=torch.Generator().manual_seed(0))
    tv = tw.TiledVAE(vae, progress=False, device_kind="cuda", memory_budget=3_600_000)
    plan = tv.plan(tuple(z.shape))
    with torch.no_grad():
        out, ref = tv.decode(z).sample, vae.decode(z).sample
    assert plan.kv_chunk > 0 and not plan.untiled
    assert (out - ref).abs().max() <= 1e-4


def test_gpu_plan_reads_the_next_tile_ahead_unless_only_a_plan_without_fits():
    from tilewise.vae.plan.make import make_plan, request

    with fake():
        vae = build_vae("sd", torch.float16, "meta", **NARROW)
        z = torch.randn(1, 4, 32, 32, device="meta", dtype=torch.float16)
        tv = tw.TiledVAE(vae, staging="host", progress=False, device_kind="cuda")
        ahead, plain = (make_plan(tv.settings, tv.job("decode"), tuple(z.shape),
                                  request(tv.settings, tv.job("decode"), 16, "host").replace(read_ahead=a))
                        for a in (True, False))
        assert ahead.read_ahead and not plain.read_ahead and plain.peak < ahead.peak
        assert ahead.seconds < plain.seconds and ahead.h2d == plain.h2d  # (the same reads, earlier)
        assert "inputs read while a tile runs" in str(ahead)
        tight = tw.TiledVAE(vae, staging="host", memory_budget=plain.peak + 1, progress=False,
                            device_kind="cuda")
        plan = tight.plan(tuple(z.shape))
        c = _counted("meta", tight.decode, z)
        would = make_plan(tight.settings, tight.job("decode"), tuple(z.shape),
                          request(tight.settings, tight.job("decode"), plan.tile_size, "host"))
        roomy = tw.TiledVAE(vae, staging="host", memory_budget=ahead.peak, progress=False, device_kind="cuda")
        chosen = roomy.plan(tuple(z.shape))
    assert plan.tile_size >= 16 and not plan.read_ahead and would.peak > tight.memory_budget
    assert (plan.h2d, plan.d2h) == (c.h2d, c.d2h)
    assert c.device_peak("meta") <= plan.peak <= tight.memory_budget
    assert chosen.tile_size >= 16 and chosen.read_ahead


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_statistics_kernels_are_the_counted_constants(dtype):
    from tilewise.locality.affine import group_norm_affine
    from tilewise.vae.plan import op_costs as counts
    from tilewise.vae.run.stats import GroupStats

    with fake():
        xs = [torch.randn(1, 64, 9, 7, device="meta", dtype=dtype) for _ in range(3)]
        w, b = torch.randn(64, device="meta", dtype=dtype), torch.randn(64, device="meta", dtype=dtype)
        acc, one = GroupStats(8, 0), GroupStats(8, 0)
        with count("meta") as adds:
            for x in xs:
                acc.add(x)
        one.add(xs[0])
        with count("meta") as merge:
            stats = acc.result()
        with count("meta") as single:
            one.result()
        with count("meta") as affine:
            group_norm_affine(stats, 8, 1e-6, w, b, dtype, 64)
    half = dtype == torch.float16
    assert adds.launches == 3 * (counts.WELFORD + half)
    assert merge.launches == counts.MERGE + 1 and single.launches == 1 + 1  # (float32 moments widened)
    assert affine.launches == counts.AFFINE


@pytest.mark.parametrize("kind,fast_low,budget", [("decode", 4, None), ("decode", 0, None),
                                                  ("encode", 4, None), ("decode", 4, 6_000_000),
                                                  ("decode", 4, 12_000_000)])
def test_gpu_fast_plan_counts_the_estimators_statistics(kind, fast_low, budget):
    # (budget: the sampled tiles do not fit at once and run staged, one at a time, on regions
    # back-propagated through the whole part, with no finite checks; host staging, and tiles at the
    # image border whose convolutions pad an upsampled input: it dies before the convolution's output
    # is made, as the plan has it; the sample given, so the plan does not sample fewer tiles instead)
    with fake():
        vae = build_vae("sd", torch.float16, "meta", **NARROW)
        tv = tw.TiledVAE(vae, mode="fast", tile_size=16, fast_low=fast_low, memory_budget=budget,
                         progress=False, device_kind="cuda", fast_sample=0.5 if budget else None)
        t = torch.randn(1, 4, 64, 64) if kind == "decode" else torch.randn(1, 3, 256, 256)
        t = t.to("meta", torch.float16)
        plan = tv.plan(tuple(t.shape), kind=kind)
        c = _counted("meta", tv.decode, t) if kind == "decode" else _encode_run(tv, t)
    names = [q.name for q in plan.passes]
    assert ("low pass" in names) == (fast_low > 0) and len(names) >= 3
    assert (budget is not None) == ("sampled tiles, staged" in names)
    assert abs(plan.launches - c.launches) <= 0.03 * c.launches
    assert abs(plan.flops - c.flops) <= 1e-3 * c.flops and plan.syncs == c.syncs
    # what the plan prints crossing the link, to the byte (the statistics' merge weights included)
    assert (plan.h2d, plan.d2h) == (c.h2d, c.d2h)
    assert (budget is not None) == (c.h2d > 0 and c.d2h > 0)
    assert c.device_peak("meta") <= plan.peak <= 1.15 * c.device_peak("meta")
    assert budget is None or plan.peak <= budget


def test_staging_floor_is_the_least_any_placement_moves():
    """The floor's greedy covering against a linear program over every fractional placement (scipy's
    linprog): random lifetimes, sizes and room."""
    from scipy.optimize import linprog

    from tilewise.vae.plan.records import staging_floor

    rng = np.random.default_rng(0)
    for _ in range(200):
        segs, n = int(rng.integers(1, 8)), int(rng.integers(1, 7))
        life = {}
        for k in range(n):
            a = int(rng.integers(0, segs))
            life[f"v{k}"] = (a, int(rng.integers(a, segs)))
        size = {v: int(rng.integers(1, 50)) for v in life}
        budget, held = 100, [int(rng.integers(0, 100)) for _ in range(segs)]
        names = list(life)
        # minimise the bytes off the device, x_v in [0, size_v], each segment's excess covered
        rows = [[-1 if life[v][0] <= i <= life[v][1] else 0 for v in names] for i in range(segs)]
        need = [-(sum(size[v] for v in names if life[v][0] <= i <= life[v][1]) - (budget - held[i]))
                for i in range(segs)]
        lp = linprog(np.ones(n), A_ub=rows, b_ub=need, bounds=[(0, size[v]) for v in names])
        if not lp.success:  # (held beyond the budget: no placement fits)
            continue
        assert staging_floor(budget, held, life, size) == pytest.approx(2 * lp.fun, abs=1e-6)


def _random_pass(rng, segs: int, n: int, unit: int = 50):
    """Random lifetimes, reader segments (the last of a lifetime always one), sizes and working sets."""
    life, readers = {}, {}
    for k in range(n):
        a = int(rng.integers(0, segs))
        z = int(rng.integers(a + 1, segs + 1)) if a + 1 < segs else a + 1
        life[f"v{k}"] = (a, z)
        readers[f"v{k}"] = frozenset({z} | {s for s in range(a + 1, z) if rng.random() < 0.5})
    size = {v: int(rng.integers(1, unit)) for v in life}
    held = [int(rng.integers(0, 2 * unit)) for _ in range(segs + 1)]
    return life, readers, size, held


def test_staging_floor_with_readers_is_below_every_placement_linear_program():
    """The floor with reader segments against the linear program of its bound over every fractional
    placement, segment by segment (x: bytes of a value off the device at a segment; M: bytes ever off;
    T >= M and T >= the bytes off at its readers; least M + T): never above it, never below the
    one-read floor, and above it where values are off at several of their readers."""
    from scipy.optimize import linprog

    from tilewise.vae.plan.records import staging_floor

    rng, tighter = np.random.default_rng(1), 0
    for _ in range(200):
        life, readers, size, held = _random_pass(rng, int(rng.integers(2, 7)), int(rng.integers(1, 6)))
        budget, names = 100, list(life)
        cells = [(v, i) for v in names for i in range(life[v][0], life[v][1] + 1)]
        nx, nv = len(cells), len(names)
        cost = np.r_[np.zeros(nx), np.ones(2 * nv)]  # [x..., M..., T...]
        rows, rhs = [], []
        for i in range(len(held)):  # each segment's excess off the device
            rows.append([-1.0 if c[1] == i else 0.0 for c in cells] + [0.0] * 2 * nv)
            rhs.append(-(sum(size[v] for v in names if life[v][0] <= i <= life[v][1]) - (budget - held[i])))
        for j, (v, _) in enumerate(cells):  # M_v >= x_{v,i}
            row = [0.0] * (nx + 2 * nv)
            row[j], row[nx + names.index(v)] = 1.0, -1.0
            rows.append(row)
            rhs.append(0.0)
        for k, v in enumerate(names):  # T_v >= M_v, T_v >= sum of x at its readers
            row = [0.0] * (nx + 2 * nv)
            row[nx + k], row[nx + nv + k] = 1.0, -1.0
            rows.append(row)
            rhs.append(0.0)
            row = [1.0 if c[0] == v and c[1] in readers[v] else 0.0 for c in cells] + [0.0] * 2 * nv
            row[nx + nv + k] = -1.0
            rows.append(row)
            rhs.append(0.0)
        bounds = [(0, size[c[0]]) for c in cells] + [(0, None)] * 2 * nv
        lp = linprog(cost, A_ub=rows, b_ub=rhs, bounds=bounds)
        if not lp.success:  # (held beyond the budget: no placement fits)
            continue
        floor = staging_floor(budget, held, life, size, readers)
        once = staging_floor(budget, held, life, size)
        assert once <= floor <= lp.fun + 1e-6
        tighter += floor > once
    assert tighter > 20


def _least_moved(budget, held, life, readers, size) -> float:
    """The least host<->device units any placement moves, by search over every unit's on / off schedule
    (a unit made on the device; off: written out once; back at a reader it is off at, or at any segment
    for one unit read, after which it may stay)."""
    import itertools

    def cost(v, sched):  # (sched[k]: on the device at segment a + k)
        a, z = life[v]
        if all(sched):
            return 0
        c = 1  # (written out once)
        for i in range(a + 1, z + 1):
            on, was = sched[i - a], sched[i - a - 1]
            c += (not on and i in readers[v]) + (on and not was and i - 1 not in readers[v])
        return c

    per = {}
    for v, (a, z) in life.items():
        scheds = list(itertools.product((True, False), repeat=z - a + 1))
        per[v] = [(sum(cost(v, s) for s in combo), [sum(not s[i] for s in combo) for i in range(z - a + 1)])
                  for combo in itertools.combinations_with_replacement(scheds, size[v])]
    best = float("inf")
    for pick in itertools.product(*per.values()):
        total = sum(p[0] for p in pick)
        if total >= best:
            continue
        off = [0] * len(held)
        for v, p in zip(life, pick, strict=True):
            for k, n in enumerate(p[1]):
                off[life[v][0] + k] += n
        if all(sum(size[v] for v in life if life[v][0] <= i <= life[v][1]) - off[i] <= budget - held[i]
               for i in range(len(held))):
            best = total
    return best


def test_staging_floor_with_readers_is_below_the_least_any_unit_placement_moves():
    """The floor with reader segments against an exhaustive search of tiny passes (2-3 values of 1-2
    units, up to 4 segments): a lower bound, and equal to it in some."""
    from tilewise.vae.plan.records import staging_floor

    rng, equal = np.random.default_rng(2), 0
    for _ in range(60):
        life, readers, size, held = _random_pass(rng, int(rng.integers(2, 4)), int(rng.integers(2, 4)), 3)
        held = [int(rng.integers(0, 4)) for _ in held]
        budget = 5
        least = _least_moved(budget, held, life, readers, size)
        if least == float("inf"):
            continue
        floor = staging_floor(budget, held, life, size, readers)
        assert floor <= least
        equal += floor == least
    assert equal > 5


def test_exact_gpu_plans_print_the_staging_floor_and_move_no_less():
    with _staged_decode() as (vae, z, hi, lo, _):
        for budget in (lo, (hi + lo) // 2, 4 * hi):
            tv = tw.TiledVAE(vae, memory_budget=budget, progress=False,
                             device_kind=CUDA.replace(link_bytes_s=5e9))
            plan = tv.plan(tuple(z.shape))
            c = _counted("meta", tv.decode, z)
            if plan.untiled:  # (the biggest budget: one tile, nothing staged)
                assert budget == 4 * hi and plan.staging_floor is None and c.h2d + c.d2h < 1 << 20
                continue
            assert plan.staging_floor > 0 and "staging floor at this budget" in str(plan)
            assert c.h2d + c.d2h >= plan.staging_floor  # (a lower bound: what the run moves, counted)
    assert tw.TiledVAE(vae, progress=False).plan((1, 4, 32, 32)).staging_floor is None  # (no budget)
