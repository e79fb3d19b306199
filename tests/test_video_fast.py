"""Fast mode for the 3-D VAEs with GroupNorms (`tilewise.vae.video.fast`): the high-resolution part's
statistics estimated from a sample of its real tiles, then one pass with them fixed. With every tile
sampled the estimate is the exact statistics, so the run equals exact mode (fp32, <= 1e-4); with the
default sample it is a named approximation whose error is measured (these seeded narrow models'
statistics are far rougher than a trained VAE's: benchmarks/video_fast.py measures trained ones) and
bounded here as a regression; the plan says what runs and counts what the estimation pass holds."""

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("diffusers")

import video_vae_support as support  # noqa: E402

import tilewise as tw  # noqa: E402
from tilewise.vae.video.fast import FastSplit, estimation_bytes, fast_split, low_program  # noqa: E402
from tilewise.vae.video.sampled import SampledStats, sampled  # noqa: E402

TOL = 1e-4
BUILDERS = {"hunyuan": lambda: support.video_vae("hunyuan"), "mochi": lambda: support.video_vae("mochi"),
            "cosmos": lambda: support.video_vae("cosmos"), "magvit": lambda: support.video_vae("magvit"),
            "cogvideox": support.cogvideox_vae, "kvae": support.kvae_video, "allegro": support.allegro,
            "svd": support.svd}
ENCODES = ("hunyuan", "mochi", "cosmos", "magvit", "cogvideox", "kvae", "allegro")  # (SVD's encode is 2-D)
_BUILT: dict = {}


def _vae(name):
    if name not in _BUILT:
        _BUILT[name] = BUILDERS[name]()
    return _BUILT[name]


def _smooth(shape, seed: int, low: int = 2):
    """A seeded smooth (B, C, T, H, W) tensor: noise on a low x low grid per frame, bicubic upsampled."""
    b, c, t, h, w = shape
    g = torch.Generator().manual_seed(seed)
    grid = torch.randn(b, c * t, low, low, generator=g)
    return torch.nn.functional.interpolate(grid, size=(h, w), mode="bicubic").view(b, c, t, h, w)


def _decode(tv, name, z):
    if name == "svd":  # (its frames in the batch, a call of num_frames)
        b, c, t, h, w = z.shape
        return tv.decode(z.transpose(1, 2).reshape(b * t, c, h, w), num_frames=t).sample
    return tv.decode(z).sample


def _input(name, kind):
    vae = _vae(name)
    if kind == "decode":
        return _smooth((1, vae.config.get("latent_channels", 4), 3, 8, 8), seed=1)
    frames = 8 if name == "allegro" else 9
    side = 8 * tw.TiledVAE(vae, progress=False).job("encode").factor
    return _smooth((1, 3, frames, side, side), seed=2, low=3).clamp(-1, 1)


def _run(name, kind, x, **options):
    tv = tw.TiledVAE(_vae(name), progress=False, **{"tile_size": 3, **options})
    with torch.no_grad():
        out = _decode(tv, name, x) if kind == "decode" else tv.encode(x).latent_dist.mode()
    return tv, out


CASES = [(n, "decode") for n in BUILDERS] + [(n, "encode") for n in ENCODES]


@pytest.mark.parametrize("name,kind", CASES)
def test_fast_mode_estimates_and_sampling_every_tile_is_exact(name, kind):
    x = _input(name, kind)
    _, exact = _run(name, kind, x, tile_size=64)  # (one tile: the untiled program)
    tv, fast = _run(name, kind, x, mode="fast")
    _, every = _run(name, kind, x, mode="fast", fast_sample=1.0)
    assert (every - exact).abs().max() <= TOL  # (every tile sampled: the statistics are the exact ones)
    err = (fast - exact).pow(2).mean().sqrt() / exact.pow(2).mean().sqrt()
    # a named approximation: measured 0.008-0.62 relative rms on these seeded narrow models (their 8x8
    # latents give the default low pass 2x2 ones); on trained statistics, benchmarks/video_fast.py
    assert 1e-4 < err < 0.8
    plan = tv.plan(tuple(x.shape), kind=kind)
    assert plan.mode == "fast" and plan.estimate_peak > 0 and "estimated from a sample" in str(plan)


@pytest.mark.parametrize("name,kind", [("hunyuan", "decode"), ("mochi", "encode"), ("kvae", "decode")])
def test_the_estimation_pass_holds_what_the_plan_counts(name, kind):
    """The sampled tiles' regions and caches: counted (`held_bytes`, in `estimation_bytes`) as the pass
    holds them; a decode's head output beside them. Its fixed GroupNorms cut no segment of the run."""
    tv = tw.TiledVAE(_vae(name), tile_size=2, mode="fast", progress=False)
    job = tv.job(kind)
    x = _input(name, kind)
    split = fast_split(tv.settings, job, tuple(x.shape))
    assert isinstance(split, FastSplit)
    given = {job.program.input: x}
    head = 0
    if kind == "decode":
        with torch.no_grad():
            given[split.cut] = split.head.run_steps(x)
        head = given[split.cut].numel() * 4
    shapes = job.program.shapes(tuple(x.shape[-2:]))
    est = SampledStats(job.program, split.part, split.cut, sampled(shapes, split.cut, 2, 0.5))
    with torch.no_grad():
        stats = est.run(given)
    assert set(stats) == {(i, k) for i in split.fixed for k in range(len(job.program.chunks(x.shape[2])))}
    assert estimation_bytes(tv.settings, job, split, tuple(x.shape), 2) == est.held_peak + head
    assert est.held_peak > 0


def test_what_fast_mode_cannot_cut_runs_exact_and_the_plan_says_why():
    x = _input("hunyuan", "decode")
    _, exact = _run("hunyuan", "decode", x, tile_size=64)
    for options, why in (({"fast_estimator": "crops"}, "'tiles' only"),
                         ({"tile_size": 8}, "fits one tile")):
        tv = tw.TiledVAE(_vae("hunyuan"), mode="fast", progress=False, **{"tile_size": 2, **options})
        with torch.no_grad():
            assert (tv.decode(x).sample - exact).abs().max() <= TOL
        plan = tv.plan(tuple(x.shape))
        assert plan.mode == "exact" and why in str(plan)
    tv = tw.TiledVAE(support.video_vae("hunyuan15"), tile_size=2, mode="fast", progress=False)
    assert "has none: the run is exact" in str(tv.plan((1, 32, 2, 6, 6)))


def test_fast_mode_within_a_budget_plans_below_exact_mode():
    """Fast mode stages nothing between the estimated part's GroupNorms: within the same budget its plan
    holds less than exact mode's at the same tile (HunyuanVideo decode, staged on the device)."""
    shape = (1, 4, 3, 16, 16)
    exact, fast = (tw.TiledVAE(_vae("hunyuan"), tile_size=4, mode=mode, progress=False)
                   .plan(shape, staging="device") for mode in ("exact", "fast"))
    assert fast.staged_peak < exact.staged_peak and fast.segments < exact.segments


def test_fast_mode_has_no_backward_and_says_so():
    tv = tw.TiledVAE(_vae("hunyuan"), tile_size=3, mode="fast", progress=False)
    z = _input("hunyuan", "decode").requires_grad_(True)
    with pytest.raises(RuntimeError, match="no backward in fast mode"):
        tv.decode(z)


def test_the_estimation_holds_its_regions_in_host_memory_where_the_run_stages_there():
    """staging="host": the sampled tiles' regions and a decode's head output wait in host memory (a GPU
    plan counts them there), and the run equals the one staged on the device."""
    x = _input("mochi", "decode")
    runs = {st: _run("mochi", "decode", x, mode="fast", staging=st)[1] for st in ("device", "host")}
    assert (runs["host"] - runs["device"]).abs().max() <= 1e-6
    tv = tw.TiledVAE(_vae("mochi"), tile_size=3, mode="fast", device_kind="cuda", progress=False)
    plans = {st: tv.plan(tuple(x.shape), staging=st) for st in runs}
    job = tv.job("decode")
    split = fast_split(tv.settings, job, tuple(x.shape))
    held = estimation_bytes(tv.settings, job, split, tuple(x.shape), plans["host"].tile_size)
    assert plans["host"].host_bytes >= held > 0
    assert plans["host"].estimate_peak < plans["device"].estimate_peak


@pytest.mark.parametrize("factor", [2, 4])
def test_the_low_pass_reduces_every_slice_an_upsampler_resamples_alike(factor):
    """HunyuanVideo's upsampler resamples its first frame and the rest apart: the low pass takes the same
    mean on both, so the frames it joins are of one size and its last GroupNorm reads a value `factor`
    times smaller (taking the factor per op reduced the first frame only at fast_low 2)."""
    p = tw.TiledVAE(_vae("hunyuan"), tile_size=2, mode="fast", progress=False).job("decode").program
    small, left = low_program(p, (8, 8), factor)
    shapes, full = small.shapes((8, 8)), p.shapes((8, 8))
    joins = [op for op in small.ops if len(op.src) > 1 and op.src[0] in shapes and op.src[1] in shapes]
    assert joins and all(shapes[op.src[0]] == shapes[op.src[1]] for op in joins)
    norm = small.ops[-1]
    assert left == 1 and shapes[norm.src[0]][0] * factor == full[norm.src[0]][0]
