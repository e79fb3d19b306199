"""The latent cache (issue #32): shards by bucket read back equal to a direct encode of each transformed
image (the tiled encode past `tile_above` too), checksums, and a run killed mid-way continued by a rerun
with nothing lost and nothing written twice."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from jobs_support import TRUNCATED, make_images, write_folder
from torch.utils.data import DataLoader

from tilewise.cli import main
from tilewise.jobs import BucketBatchSampler, EncodeSettings, LatentDataset, bucket_dataset, encode_dataset
from tilewise.jobs.cache import plan_shards, read_shard_record, to_tensor
from tilewise.jobs.readers import open_dataset
from tilewise.models import load_default_vae

AREA, STEP = 64 * 64, 16
# the 64x64 bucket (4096 px) goes through the exact tiled VAE, the others (3072 .. 3840 px) untiled
SETTINGS = EncodeSettings(batch_size=4, tile_above=4000, tile_size=4)


@pytest.fixture(scope="module")
def vae():
    return load_default_vae()


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    root = write_folder(tmp_path_factory.mktemp("photos"), make_images(20, seed=5), corrupt=True)
    out = root.parent / "manifest.jsonl"
    bucket_dataset(root, out, area=AREA, step=STEP, progress=False)
    return root, out


@pytest.fixture(scope="module")
def cache(dataset, vae, tmp_path_factory):
    root, manifest = dataset
    out = tmp_path_factory.mktemp("cache")
    result = encode_dataset(manifest, out, vae=vae, shard_size=4, settings=SETTINGS, progress=False)
    return out, result


def _direct(vae, data, rows):
    """The oracle: the untiled VAE on the transformed images of one bucket, scaled as a pipeline's latents."""
    x = torch.stack([to_tensor(r.transform(data.pixels(r.key))) for r in rows])
    with torch.no_grad():
        mean = vae.encode(x).latent_dist.mean
    return mean * vae.config.scaling_factor


def test_cache_reads_back_equal_to_a_direct_encode(cache, dataset, vae):
    out, result = cache
    ds = LatentDataset(out)
    data = open_dataset(dataset[0])
    assert result.rows == len(ds) == 20 and set(result.failed) == {TRUNCATED}
    by_bucket = {}
    for i, row in enumerate(ds.manifest.rows):
        by_bucket.setdefault(row.bucket, []).append(i)
    for idx in by_bucket.values():
        want = _direct(vae, data, [ds.manifest.rows[i] for i in idx])
        for i, z in zip(idx, want):
            item, row = ds[i], ds.manifest.rows[i]
            assert item["latents"].shape == z.shape
            assert (item["latents"] - z).abs().max() <= 1e-4, row.key
            assert torch.equal(item["mask"], torch.from_numpy(row.assignment.mask))
            assert tuple(item["original_size"].tolist()) == (row.height, row.width)
    tiled = [b for b in by_bucket if b[0] * b[1] > SETTINGS.tile_above]
    assert tiled and len(tiled) < len(by_bucket)  # both paths were taken


def test_shards_group_by_bucket_and_checksums_catch_a_change(cache):
    out, _ = cache
    ds = LatentDataset(out)
    for row in ds.manifest.rows:
        w, h = row.bucket
        assert row.extra["shard"].startswith(f"{w}x{h}/")
        assert row.key in ds.shard_keys(row.extra["shard"])
    assert [k for k, _ in ds.manifest.skipped][-1] == TRUNCATED  # listed with its reason, not dropped
    row = ds.manifest.rows[0]
    bad = json.loads((out / "manifest.jsonl").read_text().splitlines()[1])
    assert bad["sha256"] == row.extra["sha256"]
    bad_ds = LatentDataset(out)
    bad_ds.manifest.rows[0].extra["sha256"] = "0" * 64
    with pytest.raises(ValueError, match="does not match its sha256"):
        bad_ds[0]


def test_a_dataloader_gives_batches_of_one_bucket(cache):
    ds = LatentDataset(cache[0])
    loader = DataLoader(ds, batch_sampler=BucketBatchSampler(ds, 4, seed=1))
    n = 0
    for batch in loader:
        b = batch["latents"]
        assert b.ndim == 4 and b.shape[0] <= 4 and batch["mask"].shape == (b.shape[0], *b.shape[-2:])
        n += b.shape[0]
    assert n == len(ds)


def test_a_rerun_keeps_every_complete_shard(cache, dataset, vae):
    out, first = cache
    again = encode_dataset(dataset[1], out, vae=vae, shard_size=4, settings=SETTINGS, progress=False)
    assert again.written == 0 and again.kept == first.written + first.kept and again.rows == first.rows


def test_a_killed_run_is_continued_with_nothing_lost_or_doubled(dataset, cache, tmp_path, capsys):
    root, manifest = dataset
    out = tmp_path / "cache"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1] / "src"),
                                                        os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "tilewise.cli", "encode", str(root), "--buckets", str(manifest), "--out",
           str(out), "--shard-size", "4", "--batch-size", "4", "--tile-above", "4000", "--tile", "4", "-q"]
    # Ctrl-C after the first shard: exit 130, the shards written are complete, no temporary left
    assert _run_until(cmd, env, out, 1, signal.SIGINT) == 130
    first = list(out.glob("*/*.safetensors"))
    assert first and all(read_shard_record(p) is not None for p in first) and not list(out.glob("*/.*.part"))
    # continued, then killed outright (no clean-up) once it has written more
    _run_until(cmd, env, out, len(first) + 1, signal.SIGKILL)
    written = sorted(p.relative_to(out).as_posix() for p in out.glob("*/*.safetensors"))
    planned = len(plan_shards(_manifest(manifest), 4))
    assert len(first) < len(written) < planned, "the run was to be killed mid-way"
    mtimes = {p: (out / p).stat().st_mtime_ns for p in written}
    with pytest.raises(SystemExit) as done:  # the same command again, in this process
        main([str(a) for a in cmd[3:]])
    assert done.value.code == 0
    summary = capsys.readouterr().out
    assert f"({planned - len(written)} written, {len(written)} kept from a previous run)" in summary
    assert "1 failed" in summary and TRUNCATED in summary
    assert {p: (out / p).stat().st_mtime_ns for p in written} == mtimes  # kept, not rewritten
    assert not list(out.glob("*/.*.part"))  # the killed run's temporary is gone
    ds, clean = LatentDataset(out), LatentDataset(cache[0])
    keys = [r.key for r in ds.manifest.rows]
    assert len(keys) == len(set(keys)) and sorted(keys) == sorted(r.key for r in clean.manifest.rows)
    for i in range(len(ds)):
        # (the killed runs encoded in another process, whose torch may use another thread count: the same
        # values to float rounding, not bit for bit)
        assert torch.allclose(ds[i]["latents"], clean[i]["latents"], rtol=0, atol=1e-5)


def _run_until(cmd, env, out, shards, sig) -> int:
    """Run the command until `shards` shard files are there, then send it `sig`; its exit status."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline and len(list(out.glob("*/*.safetensors"))) < shards and proc.poll() is None:
        time.sleep(0.02)
    proc.send_signal(sig)
    return proc.wait()


def _manifest(path):
    from tilewise.jobs import read_manifest

    return read_manifest(path)


def test_within_a_memory_budget_every_bucket_is_encoded_by_the_tiled_vae_planned_within_it(vae):
    """With a budget the encoder routes every bucket through the TiledVAE, which tiles an image the budget
    cannot hold untiled (and equals the untiled encode); without one, only buckets past tile_above."""
    from tilewise.jobs.cache import LatentEncoder

    x = torch.rand(2, 3, 64, 96, generator=torch.Generator().manual_seed(3)) * 2 - 1
    with torch.no_grad():
        want = vae.encode(x).latent_dist.mean * vae.config.scaling_factor
    plain = LatentEncoder(vae, EncodeSettings(tile_above=64 * 96, tile_size=4))
    budgeted = LatentEncoder(vae, EncodeSettings(tile_above=64 * 96, tile_size=4, memory_budget="48MiB"))
    assert not plain.tiled(64 * 96) and budgeted.tiled(64 * 96)
    got = budgeted.encode(x)
    plan = budgeted._tiled_vae().plan(tuple(x.shape), kind="encode")
    assert plan.grid[0] * plan.grid[1] > 1 and plan.peak <= 48 << 20  # (tiled, within the budget)
    assert (got - want).abs().max() <= 1e-4 and (plain.encode(x) - want).abs().max() <= 1e-4
