"""Measured bucket cost: profiler on a tiny real UNet, cost fits and plot, choose_buckets vs brute force."""

import itertools
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tilewise.buckets import BucketPlanner, BucketProfile, BucketTiming, choose_buckets, profile_buckets
from tilewise.buckets.choice import feasible

SIDE = st.integers(1, 8).map(lambda n: n * 16)
BUCKET = st.tuples(SIDE, SIDE)


def brute_total(reqs, costs, chosen, policy, B=1, ae=0.1, area=0.25):
    """Oracle: each request to its cheapest feasible chosen bucket; a bucket with n requests costs
    ceil(n / B) full batches of B requests (inf if some request has no feasible bucket)."""
    n = dict.fromkeys(chosen, 0)
    for r in reqs:
        options = [b for b in chosen if feasible(r, b, policy, ae, area)]
        if not options:
            return math.inf
        n[min(options, key=lambda b: costs[b])] += 1
    return sum(math.ceil(m / B) * B * costs[b] for b, m in n.items())


def brute_best(reqs, costs, k, policy, B=1):
    """Oracle: the minimum total over every k-subset of the candidates."""
    return min(brute_total(reqs, costs, c, policy, B) for c in itertools.combinations(sorted(costs), k))


cases = st.fixed_dictionaries(
    {
        "cands": st.lists(BUCKET, min_size=1, max_size=7, unique=True),
        "shrink": st.lists(
            st.tuples(st.integers(0, 6), st.integers(0, 40), st.integers(0, 40)), min_size=1, max_size=12
        ),
        "k": st.integers(1, 4),
        "batch": st.integers(1, 3),
        "policy": st.sampled_from(["pad", "resize"]),
        "seed": st.integers(0, 10**6),
    }
)


def setup(case):
    """Candidates with random positive costs (not monotone in area: measured costs need not be)."""
    g = torch.Generator().manual_seed(case["seed"])
    cands = case["cands"]
    costs = {b: float(torch.rand((), generator=g)) + 0.01 for b in cands}
    if case["policy"] == "pad":  # requests a little smaller than some candidate, so covers usually exist
        reqs = [
            (max(1, cands[i % len(cands)][0] - dw), max(1, cands[i % len(cands)][1] - dh))
            for i, dw, dh in case["shrink"]
        ]
    else:  # near-exact aspect and area of some candidate (feasible under resize)
        reqs = [(cands[i % len(cands)][0] + dw % 2, cands[i % len(cands)][1]) for i, dw, _ in case["shrink"]]
    return costs, reqs, min(case["k"], len(costs)), case["batch"]


@given(case=cases)
def test_exhaustive_choice_equals_brute_force(case):
    """method='exhaustive' (and 'auto' on small sets) attains the brute-force minimum total cost."""
    costs, reqs, k, B = setup(case)
    best = brute_best(reqs, costs, k, case["policy"], B)
    if not math.isfinite(best):
        with pytest.raises(ValueError):
            choose_buckets(reqs, costs, k, case["policy"], method="exhaustive", batch_size=B)
        return
    for method in ("exhaustive", "auto"):
        ch = choose_buckets(reqs, costs, k, case["policy"], method=method, batch_size=B)
        assert ch.exact and len(ch.buckets) == k
        assert ch.total_cost == pytest.approx(best, rel=1e-12)
        assert brute_total(reqs, costs, ch.buckets, case["policy"], B) == pytest.approx(best, rel=1e-12)
        check_assignment(ch, reqs, costs, case["policy"])


def check_assignment(ch, reqs, costs, policy):
    """Every request goes to the cheapest feasible chosen bucket; rows add up to the total."""
    for r in reqs:
        b = ch.assignment[tuple(r)]
        assert b in ch.buckets and feasible(r, b, policy, 0.1, 0.25)
        assert costs[b] == min(costs[c] for c in ch.buckets if feasible(r, c, policy, 0.1, 0.25))
    rows = ch.rows()
    assert sum(row["requests"] for row in rows) == len(reqs)
    assert all(row["batches"] == math.ceil(row["requests"] / ch.batch_size) for row in rows)
    assert sum(row["total_cost"] for row in rows) == pytest.approx(ch.total_cost, rel=1e-12)


@given(case=cases)
def test_greedy_is_swap_optimal_and_bounded_by_brute_force(case):
    """method='greedy' never beats the optimum and no single swap improves its result."""
    costs, reqs, k, B = setup(case)
    best = brute_best(reqs, costs, k, case["policy"], B)
    try:
        ch = choose_buckets(reqs, costs, k, case["policy"], method="greedy", batch_size=B)
    except ValueError:
        assert not math.isfinite(best)
        return
    assert not ch.exact and ch.total_cost >= best - 1e-12
    if k == 1:
        assert ch.total_cost == pytest.approx(best, rel=1e-12)
    for out, new in itertools.product(ch.buckets, set(costs) - set(ch.buckets)):
        trial = sorted([b for b in ch.buckets if b != out] + [new])
        assert brute_total(reqs, costs, trial, case["policy"], B) >= ch.total_cost - 1e-12
    check_assignment(ch, reqs, costs, case["policy"])


def test_faster_bucket_despite_more_padding_reports_both():
    """A bigger bucket measured cheaper wins; the report shows its extra padded tokens beside the time."""
    costs = {(64, 64): 0.010, (64, 128): 0.004, (128, 128): 0.020}
    ch = choose_buckets([(64, 64)] * 3 + [(60, 120)], costs, 1, "pad")
    assert ch.buckets == [(64, 128)] and ch.total_cost == pytest.approx(4 * 0.004)
    (row,) = ch.rows()
    assert row["tokens"] == 4 * 8 * 16
    assert row["padded_tokens"] == pytest.approx((3 * 64 * 64 + 64 * 128 - 60 * 120) / 64)
    table = ch.table()
    assert "padded tokens" in table and "64x128" in table and "4.00" in table
    p = ch.planner(step=64)
    assert p.buckets == [(64, 128)] and p.assign(64, 64).bucket == (64, 128)


def test_short_batches_are_paid_in_full():
    """batch_size=2: one request each in two buckets costs two full batches; consolidating costs one."""
    costs = {(64, 64): 1.0, (128, 64): 1.2, (128, 128): 5.0}
    reqs = [(60, 60), (120, 60)]
    ch1 = choose_buckets(reqs, costs, 2, "pad")
    assert ch1.buckets == [(64, 64), (128, 64)] and ch1.total_cost == pytest.approx(2.2)
    ch2 = choose_buckets(reqs, costs, 2, "pad", batch_size=2)
    assert ch2.buckets == [(128, 64), (128, 128)] and ch2.total_cost == pytest.approx(2.4)
    assert [r["batches"] for r in ch2.rows()] == [1, 0]


@pytest.mark.parametrize(
    "args,kwargs,words",
    [
        (([(64, 64)], {(64, 64): 1.0}, 0), {}, ["k must be a positive integer, got 0"]),
        (([(64, 64)], {(64, 64): 1.0}, 2), {}, ["k=2", "1 costed"]),
        (([(64, 64)], {(64, 64): 1.0}, 1, "crop"), {}, ["'crop'"]),
        (([(64, 64)], {(64, 64): 1.0}, 1), {"method": "anneal"}, ["'anneal'"]),
        (([(200, 64)], {(64, 64): 1.0}, 1), {}, ["(200, 64)", "policy='pad'"]),
        (([(64, 128), (128, 64)], {(64, 128): 1.0, (128, 64): 1.0}, 1), {}, ["k=1", "raise k"]),
        (([], {(64, 64): 1.0}, 1), {}, ["empty"]),
        (([(0, 64)], {(64, 64): 1.0}, 1), {}, ["request width", "0"]),
    ],
)
def test_choose_bad_input_names_values(args, kwargs, words):
    """Bad choose_buckets input raises ValueError quoting the values."""
    with pytest.raises(ValueError) as e:
        choose_buckets(*args, **kwargs)
    assert all(w in str(e.value) for w in words), str(e.value)


# ---- profiler -----------------------------------------------------------------------------------
def test_profiler_shapes_calls_and_cfg():
    """Each bucket is called warmup + repeats times at (batch * 2 under CFG, C, H/f, W/f) in the dtype."""
    seen = []
    prof = profile_buckets(
        lambda x: seen.append((tuple(x.shape), x.dtype)),
        [(64, 32), (16, 48)],
        batch_size=3,
        guidance=7.0,
        dtype="bfloat16",
        repeats=4,
        warmup=2,
        order="interleaved",
        disable=True,
    )
    a, b = ((6, 4, 4, 8), torch.bfloat16), ((6, 4, 6, 2), torch.bfloat16)
    assert seen == [a, a, b, b] + [a, b] * 4  # warm-up per shape, then rounds interleaved over shapes
    seen.clear()
    profile_buckets(lambda x: seen.append(x.shape), [(64, 32), (16, 48)], repeats=3, warmup=1)
    assert seen == [(1, 4, 4, 8), (1, 4, 6, 2)] + [(1, 4, 4, 8)] * 3 + [(1, 4, 6, 2)] * 3
    seen.clear()
    t = prof.timings[0]
    assert len(t.times) == 4 and t.tokens == 32 and t.batch_size == 3
    assert t.per_request == pytest.approx(t.median / 3) and t.spread >= 0
    assert set(prof.costs()) == {(64, 32), (16, 48)} and prof.dtype == "bfloat16"
    assert prof.costs("min")[(64, 32)] == pytest.approx(min(t.times) / 3)
    assert prof.costs("min")[(64, 32)] <= prof.costs()[(64, 32)]
    with pytest.raises(ValueError, match="statistic must be 'median' or 'min', got 'mean'"):
        prof.costs("mean")
    seen.clear()
    profile_buckets(
        lambda x: seen.append(x.shape[0]), [(8, 8)], batch_size=2, guidance=1.0, repeats=1, warmup=0
    )
    assert seen == [2]


@pytest.mark.parametrize(
    "kwargs,words",
    [
        ({"buckets": [(60, 64)]}, ["latent_factor=8", "(60, 64)"]),
        ({"buckets": []}, ["latent_factor=8"]),
        ({"buckets": [(64, 64)], "repeats": 0}, ["repeats", "0"]),
        ({"buckets": [(64, 64)], "warmup": -1}, ["warmup", "-1"]),
        ({"buckets": [(64, 64)], "batch_size": 0}, ["batch_size", "0"]),
        ({"buckets": [(64, 64)], "order": "random"}, ["'random'", "interleaved"]),
    ],
)
def test_profiler_bad_input(kwargs, words):
    """Bad profiler input raises ValueError quoting the values."""
    with pytest.raises(ValueError) as e:
        profile_buckets(lambda x: x, **kwargs)
    assert all(w in str(e.value) for w in words), str(e.value)


def tiny_unet():
    """A real diffusers UNet2DConditionModel from a tiny config with seeded random weights."""
    from diffusers import UNet2DConditionModel

    torch.manual_seed(0)
    return UNet2DConditionModel(
        sample_size=8,
        in_channels=4,
        out_channels=4,
        block_out_channels=(8, 16),
        layers_per_block=1,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=16,
        attention_head_dim=4,
        norm_num_groups=4,
    ).eval()


def test_profiler_on_tiny_real_unet_then_choose(tmp_path):
    """Profile one UNet step with CFG on CPU per bucket, then choose buckets from the measured costs."""
    unet = tiny_unet()
    emb = torch.randn(1, 3, 16, generator=torch.Generator().manual_seed(1))
    outs = []

    def step(x):
        out = unet(x, 10, encoder_hidden_states=emb.expand(len(x), -1, -1)).sample
        outs.append(out.shape == x.shape and bool(torch.isfinite(out).all()))
        return out

    planner = BucketPlanner(buckets=[(64, 64), (128, 64), (64, 128), (128, 128)], step=32)
    prof = profile_buckets(step, planner, batch_size=1, guidance=5.0, repeats=2, warmup=1, disable=True)
    assert all(outs) and len(outs) == 4 * 3
    assert [t.shape for t in prof.timings] == [(2, 4, 16, 8), (2, 4, 8, 8), (2, 4, 16, 16), (2, 4, 8, 16)]
    assert all(t.median > 0 for t in prof.timings) and "ms/request" in prof.table()
    ch = choose_buckets([(60, 60), (120, 60), (60, 120), (100, 100)], prof, 2, "pad")
    assert len(ch.buckets) == 2 and (128, 128) in ch.buckets  # only 128x128 holds the 100x100 request
    assert ch.total_cost == pytest.approx(
        brute_best([(60, 60), (120, 60), (60, 120), (100, 100)], prof.costs(), 2, "pad")
    )
    png = prof.plot(tmp_path / "cost.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and list(tmp_path.iterdir()) == [png]


def test_fits_recover_closed_form():
    """Least-squares fits recover exact polynomial costs: y = a + b x (linear) and a + b x + c x^2."""

    def profile(f):
        ts = [
            BucketTiming((8 * n, 8), (1, 4, 1, n), 1, (f(n) + 2e-3, f(n), f(n) + 1e-3))
            for n in (1, 3, 4, 7, 12)
        ]
        return BucketProfile(ts, 1.0, "float32", "cpu")

    c, rms = profile(lambda x: 2e-3 + 5e-4 * x + 3e-5 * x * x).fit(2, "min")
    assert c == pytest.approx([2e-3, 5e-4, 3e-5], rel=1e-8) and rms < 1e-12
    c, rms = profile(lambda x: 2e-3 + 5e-4 * x + 3e-5 * x * x).fit(2)  # the median is 1 ms above the min
    assert c == pytest.approx([3e-3, 5e-4, 3e-5], rel=1e-8) and rms < 1e-12
    c, rms = profile(lambda x: 1e-3 + 2e-4 * x).fit(1, "min")
    assert c == pytest.approx([1e-3, 2e-4], rel=1e-8) and rms < 1e-12
    with pytest.raises(ValueError, match="degree-2 fit needs at least 3 buckets, got 2"):
        BucketProfile(profile(lambda x: x).timings[:2], 1.0, "float32", "cpu").fit(2)
