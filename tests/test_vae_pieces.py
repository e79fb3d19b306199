"""Fast mode in pieces (GPU plans): the estimated part cut at its resolution changes, the value between
two pieces held whole, so a tile's halo spans its piece, not the whole part. Same values and
statistics as one piece, fewer FLOPs; plans checked against counted runs."""

import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from counting import build_vae, count, fake  # noqa: E402
from test_counting import _encode_run  # noqa: E402  (tv.encode counted, the posterior apart)
from vae_support import kl_vae, structured_latent  # noqa: E402

import tilewise as tw  # noqa: E402
from tilewise.vae.devices import CUDA  # noqa: E402
from tilewise.vae.fast.split import fast_split, piece_cuts, split_pieces, split_program  # noqa: E402
from tilewise.vae.plan.make import make_plan, request  # noqa: E402

# A GPU whose launches cost nothing: its plans take pieces wherever they save FLOPs (pieces add launches:
# at the small test sizes the stock CUDA profile takes them in some plans and not in others).
FREE_LAUNCHES = CUDA.replace(launch_s=0.0)
DEAR_LAUNCHES = CUDA.replace(launch_s=1e-3)  # (and one whose launches cost so much that one piece pays)
NARROW = dict(blocks=(16, 32, 32, 32), groups=8)


@pytest.mark.parametrize("kind", ["decode", "encode"])
def test_pieces_are_cut_at_the_resolution_changes_and_rejoin_the_part(kind):
    tv = tw.TiledVAE(kl_vae("sd"), mode="fast", progress=False)
    p = tv.program(kind)
    first, second = split_program(p, fast_split(p, tv.job(kind).kind, tv.mode, tv.settings.fast))
    part = second if kind == "decode" else first
    cuts = piece_cuts(p, tv.job(kind).kind, tv.mode, tv.settings.fast)
    assert len(cuts) == 2  # (SD: three resolution changes, the part starts / ends at one of them)
    if kind == "decode":  # before an upsampling
        assert all(part.ops[c].kind == "resample" for c in cuts)
    else:  # after a downsampling
        assert all(part.ops[c - 1].kind == "conv" and part.ops[c - 1].stride[0] == 2 for c in cuts)
    pieces = split_pieces(part, cuts)
    assert [op for q in pieces for op in q.ops] == part.ops
    assert pieces[0].input == part.input and pieces[-1].output == part.output
    assert all(a.output == b.input for a, b in zip(pieces, pieces[1:]))
    assert [q.name for q in pieces] == [f"{part.name}[piece {j} of 3]" for j in (1, 2, 3)]
    exact = tw.TiledVAE(kl_vae("sd"), progress=False)
    assert piece_cuts(p, tv.job(kind).kind, exact.mode, exact.settings.fast) == ()  # (exact mode: none)
    flux = tw.TiledVAE(kl_vae("flux"), mode="fast", progress=False)
    assert piece_cuts(tw.TiledVAE(kl_vae("flux"), progress=False).program(kind), tv.job(kind).kind, flux.mode,
                      flux.settings.fast) == ()


@pytest.mark.parametrize("kind,staging", [("decode", "device"), ("encode", "device"), ("decode", "disk"),
                                          pytest.param("encode", "disk", marks=pytest.mark.slow)])  # (~50 s)
def test_fast_mode_in_pieces_computes_what_one_piece_does(kind, staging):
    vae = kl_vae("sd")
    t = structured_latent(1, 4, 32, 24) if kind == "decode" else structured_latent(1, 3, 256, 192)
    t = t if kind == "decode" else t.clamp(-1, 1)

    def run(tv):
        with torch.no_grad():
            return tv.decode(t).sample if kind == "decode" else tv.encode(t).latent_dist.mean

    outs, plans = {}, {}
    for name, prof in (("one", DEAR_LAUNCHES), ("pieces", FREE_LAUNCHES)):
        tv = tw.TiledVAE(vae, tile_size=8, mode="fast", staging=staging, progress=False, device_kind=prof)
        plans[name] = tv.plan(tuple(t.shape), kind=kind)
        outs[name] = run(tv)
    assert plans["one"].fast_cuts == () and len(plans["pieces"].fast_cuts) == 2
    assert "in 3 pieces" in str(plans["pieces"])
    assert plans["pieces"].flops < plans["one"].flops
    # the same statistics and values, computed on smaller regions (float rounding apart: 1.1e-5 measured)
    assert (outs["pieces"] - outs["one"]).abs().max() <= 1e-4
    with torch.no_grad():
        ref = vae.decode(t).sample if kind == "decode" else vae.encode(t).latent_dist.mean
    assert (outs["pieces"] - ref).abs().max() > 1e-3  # (an approximation was compared)
    # with every tile sampled and no low pass, fast mode is exact mode, in pieces too
    tv = tw.TiledVAE(vae, tile_size=8, mode="fast", fast_sample=1.0, fast_low=0, staging=staging,
                     progress=False, device_kind=FREE_LAUNCHES)
    assert len(tv.plan(tuple(t.shape), kind=kind).fast_cuts) == 2
    assert (run(tv) - ref).abs().max() <= 1e-4


@pytest.mark.parametrize("kind,budget", [("decode", None), ("encode", None), ("decode", 6_000_000)])
def test_gpu_fast_plan_in_pieces_counts_what_its_run_dispatches(kind, budget):
    with fake():  # (budget: the sampled tiles do not fit at once and run staged, in every piece; the
        # sample given, so the plan does not sample fewer tiles instead: tests/test_fast_plan.py)
        vae = build_vae("sd", torch.float16, "meta", **NARROW)
        tv = tw.TiledVAE(vae, mode="fast", tile_size=16, memory_budget=budget, progress=False,
                         device_kind=FREE_LAUNCHES, fast_sample=0.5 if budget else None)
        t = torch.randn(1, 4, 64, 64) if kind == "decode" else torch.randn(1, 3, 256, 256)
        t = t.to("meta", torch.float16)
        plan = tv.plan(tuple(t.shape), kind=kind)
        ask = request(tv.settings, tv.job(kind), plan.tile_size, plan.staging).replace(fast_cuts=())
        one = make_plan(tv.settings, tv.job(kind), tuple(t.shape), ask)
        # (the pieces' saving apart from what the plan recomputes: free launches make that worth it)
        kept = make_plan(tv.settings, tv.job(kind), tuple(t.shape), plan.choices.replace(recompute=(),
                                                                                   low_recompute=()))
        if kind == "decode":
            with count("meta") as c:
                tv.decode(t)
        else:
            c = _encode_run(tv, t)
    names = [q.name for q in plan.passes]
    assert plan.fast_cuts and "other tiles (piece 2 of" in " ".join(names)
    assert (budget is not None) == any(n.startswith("sampled tiles, staged") for n in names)
    assert kept.flops < one.flops and not one.fast_cuts and kept.fast_cuts == plan.fast_cuts
    assert abs(plan.flops - c.flops) <= 1e-3 * c.flops and plan.syncs == c.syncs
    assert abs(plan.launches - c.launches) <= 0.03 * c.launches
    assert c.device_peak("meta") <= plan.peak <= 1.15 * c.device_peak("meta")
    assert budget is None or plan.peak <= budget


def test_gpu_fast_plan_at_2048_px_takes_pieces_and_its_low_pass_in_one_tile():
    with fake():  # (planned only: the SD-shaped decode at 2048 px within 4 GiB, float16)
        vae = build_vae("sd", torch.float16, "meta")
        tv = tw.TiledVAE(vae, mode="fast", memory_budget="4GiB", progress=False, device_kind="cuda")
        plan = tv.plan((1, 4, 256, 256), kind="decode")
        ask = request(tv.settings, tv.job("decode"), plan.tile_size, plan.staging).replace(fast_cuts=())
        one = make_plan(tv.settings, tv.job("decode"), (1, 4, 256, 256), ask)
    assert plan.fast_cuts and plan.seconds < one.seconds and plan.flops < one.flops
    assert plan.peak <= 4 << 30
    low = next(q for q in plan.passes if q.name == "low pass")
    assert plan.low_tile >= 256 and low.grid == (1, 1)  # (the low pass's halos: launches, not FLOPs)
    cpu = tw.TiledVAE(vae, mode="fast", memory_budget="4GiB", progress=False, device_kind="cpu")
    with fake():
        cplan = cpu.plan((1, 4, 64, 64), kind="decode")
    assert cplan.fast_cuts == () and cplan.low_tile == 0  # (CPU plans: unchanged)
