"""The 3-D VAE plan's peak bounds the tensor bytes the tiled run holds (`measure_live_peak`), and tightly."""

import pytest

torch = pytest.importorskip("torch")

from video_vae_support import video_vae  # noqa: E402

import tilewise as tw  # noqa: E402
from tilewise.memory import measure_live_peak  # noqa: E402
from tilewise.vae.video.executor import VideoExecutor  # noqa: E402
from tilewise.vae.video.plan import make_video_plan  # noqa: E402

SLACK = 1.5  # the plan's peak over the live peak, at most


def _latent(frames, h, w, chans=4, seed=0):
    return torch.randn(1, chans, frames, h, w, generator=torch.Generator().manual_seed(seed))


def _peaks(name, shape, tile, order, staging):
    tv = tw.TiledVAE(video_vae(name), tile_size=tile, progress=False)
    plan = make_video_plan(tv.settings, tv.job("decode"), shape, staging=staging, order=order)
    p = tv.program("decode")
    ex = VideoExecutor(p, plan.tile_size, p.input, staging=staging, order=order, progress=False)
    z = _latent(*shape[2:], chans=shape[1])
    with torch.no_grad():
        _, live = measure_live_peak(lambda: ex.run(z).output)
    return plan.peak, live


@pytest.mark.parametrize("name,frames,order,staging", [
    ("wan2.1", 3, "frames", "device"), ("wan2.1", 3, "tiles", "host"), ("qwen", 2, "tiles", "device"),
    ("ltx0.9.0", 3, "frames", "device"), ("ltx0.9.0", 3, "tiles", "host"), ("ltx2", 2, "tiles", "device"),
    ("hunyuan", 2, "frames", "device"), ("cosmos", 3, "tiles", "host")])
def test_plan_peak_bounds_the_live_bytes_of_the_run(name, frames, order, staging):
    plan, live = _peaks(name, (1, 4, frames, 9, 8), 4, order, staging)
    assert live <= plan <= SLACK * live, (name, plan, live, plan / live)


def test_a_traced_ops_temporaries_are_measured_from_what_it_runs():
    """LTX-Video's RMS norms (movedim, pow, mean, rsqrt, mul, ... as one Pointwise) hold a full copy beside
    their output; its layer norm only its moments."""
    from tilewise.locality.ops import OpKind
    from tilewise.vae.video.live import traced_temps

    p = tw.TiledVAE(video_vae("ltx0.9.0"), tile_size=4, progress=False).program("decode")
    chans = p.channels()
    temps = {op.describe(): traced_temps(op, chans[op.src[0]], 3)[0] for op in p.ops
             if op.kind is OpKind.POINTWISE and op.fn is not None}
    norms = [t for d, t in temps.items() if "rsqrt" in d]
    others = [t for d, t in temps.items() if "rsqrt" not in d]  # (a layer norm: its per-position moments)
    assert norms and all(t >= 1 for t in norms), temps
    assert others and all(t < 0.5 for t in others), temps


def test_a_cpu_plan_counts_what_host_staging_keeps_in_its_peak():
    """On a CPU host memory is the device's own: staging="host" saves none of it, so a CPU plan's peak
    counts the staged values it keeps there (HunyuanVideo's whole-video values between its GroupNorms)."""
    tv = tw.TiledVAE(video_vae("hunyuan"), tile_size=3, progress=False)
    host = tv.plan((1, 4, 2, 7, 9), staging="host")
    device = tv.plan((1, 4, 2, 7, 9), staging="device")
    assert host.host_bytes > 0 and host.peak >= device.peak and host.peak >= host.host_bytes
