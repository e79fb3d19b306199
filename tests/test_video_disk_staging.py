"""staging="disk" for 3-D VAEs: staged values of each step in files (`run.staging.DiskValue`, laid out
(B, T, H, W, C)), exact against the untiled decode / encode (fp32, max abs <= 1e-4), files gone afterwards
and after an error, the plan's peak and the live tensors without them, "auto" choosing disk only where no
in-memory plan fits, refusals by name."""

import glob
import os

import pytest

torch = pytest.importorskip("torch")

from video_vae_support import latent, video, video_vae  # noqa: E402

import tilewise as tw  # noqa: E402
from tilewise.memory import measure_live_peak  # noqa: E402
from tilewise.vae.video.executor import VideoExecutor  # noqa: E402

TOL = 1e-4


def _files(folder) -> list[str]:
    return glob.glob(os.path.join(str(folder), "tilewise-stage-*", "*")) + glob.glob(
        os.path.join(str(folder), "tilewise-stage-*"))


@pytest.mark.parametrize("family", ["wan2.1", "mochi"])
def test_disk_staged_decode_is_exact_and_leaves_no_files(family, tmp_path):
    vae = video_vae(family)
    tv = tw.TiledVAE(vae, tile_size=2, staging="disk", stage_dir=str(tmp_path), progress=False)
    z = latent(3, 5, 3, seed=1)
    with torch.no_grad():
        ref = vae.decode(z).sample
        out = tv.decode(z).sample
    assert (out - ref).abs().max() <= TOL
    assert tv.last_staged_peak > 0 and _files(tmp_path) == []


@pytest.mark.parametrize("family", ["wan2.1", "mochi"])
def test_disk_staged_encode_is_exact(family, tmp_path):
    vae = video_vae(family)
    tv = tw.TiledVAE(vae, tile_size=1, staging="disk", stage_dir=str(tmp_path), progress=False)
    x = video(7, 16, 24, seed=2)
    with torch.no_grad():
        ref = vae.encode(x).latent_dist
        out = tv.encode(x).latent_dist
    assert (out.mean - ref.mean).abs().max() <= TOL and (out.logvar - ref.logvar).abs().max() <= TOL
    assert _files(tmp_path) == []


def test_files_are_removed_after_an_error_mid_run(tmp_path):
    vae = video_vae("mochi")
    tv = tw.TiledVAE(vae, tile_size=2, progress=False)
    p = tv.program("decode")
    ex = VideoExecutor(p, 2, p.input, staging="disk", stage_dir=str(tmp_path), progress=False)
    seen = []
    z = latent(2, 5, 3)

    def emit(t0, box, block):
        seen.append(_files(tmp_path))
        raise RuntimeError("sink failed")

    with pytest.raises(RuntimeError, match="sink failed"), torch.no_grad():
        ex.run(z, emit=emit)
    assert seen and seen[0], "files existed mid-run"
    assert _files(tmp_path) == []


def test_the_plan_counts_disk_staged_values_apart_from_memory():
    vae = video_vae("mochi")
    tv = tw.TiledVAE(vae, tile_size=2, progress=False)
    shape = (1, 4, 3, 5, 3)
    host, disk = tv.plan(shape, staging="host"), tv.plan(shape, staging="disk")
    assert disk.disk_bytes == disk.staged_peak == host.staged_peak > 0
    assert disk.peak < host.peak and disk.host_bytes == 0
    assert "in disk files" in str(disk)


def test_disk_staged_values_are_not_live_tensors():
    # measure_live_peak counts tensor storages; the files are read (preadv) into fresh boxes and written
    # (pwritev) from the write's copy, never mapped as tensors: the staged bytes leave the live peak
    vae = video_vae("mochi")
    z = latent(3, 8, 8, seed=3)
    live, plans = {}, {}
    for staging in ("host", "disk"):
        tv = tw.TiledVAE(vae, tile_size=4, staging=staging, progress=False)
        plans[staging] = tv.plan(tuple(z.shape))
        with torch.no_grad():
            _, live[staging] = measure_live_peak(tv.decode, z)
    staged = plans["disk"].disk_bytes
    assert staged == plans["host"].staged_peak > 0
    assert live["host"] - live["disk"] >= 0.75 * staged
    assert live["disk"] <= 1.05 * plans["disk"].peak


def test_auto_staging_goes_to_disk_only_where_no_in_memory_plan_fits():
    vae = video_vae("mochi")
    shape = (1, 4, 3, 8, 8)
    floor = min(tw.TiledVAE(vae, tile_size=t, progress=False).plan(shape, staging=s).peak
                for t in (4, 8) for s in ("device", "host"))
    roomy = tw.TiledVAE(vae, memory_budget=floor * 4, progress=False).plan(shape)
    assert roomy.staging.value in ("device", "host")
    tight = tw.TiledVAE(vae, memory_budget=int(floor * 0.8), progress=False)
    p = tight.plan(shape)
    assert p.staging.value == "disk" and p.peak <= int(floor * 0.8)
    z = latent(3, 8, 8, seed=3)
    with torch.no_grad():
        assert (tight.decode(z).sample - vae.decode(z).sample).abs().max() <= TOL
    with pytest.raises(ValueError, match="no plan fits"):  # (asked for host: never disk)
        tw.TiledVAE(vae, memory_budget=int(floor * 0.8), staging="host", progress=False).plan(shape)


def test_disk_staging_is_refused_by_name_with_a_process_group_and_with_gradients():
    vae = video_vae("wan2.1")
    p = tw.TiledVAE(vae, tile_size=2, progress=False).program("decode")
    with pytest.raises(ValueError, match="process group.*staging='disk'"):
        VideoExecutor(p, 2, p.input, staging="disk", group=object())
    tv = tw.TiledVAE(vae, tile_size=2, staging="disk", progress=False)
    z = latent(2, 5, 3).requires_grad_(True)
    with pytest.raises(ValueError, match="staging='disk' is for no_grad"):
        tv.decode(z)
