"""The batch jobs on a local Ray cluster started here (issue #32): outputs equal to the one-process job,
and a worker killed mid-job (it exits on its first attempt at one item) costs nothing: the job finishes
with every output there once."""

import json
import os
from pathlib import Path

import numpy as np
import pytest
from jobs_support import CrashOnce, make_images, write_folder
from PIL import Image

ray = pytest.importorskip("ray", reason="the tilewise[ray] extra (ray[data]) is not installed")

from tilewise.jobs import LatentDataset, RayRunner, bucket_dataset, encode_dataset  # noqa: E402
from tilewise.jobs.batch import RunnerFactory, read_prompts, run_batch  # noqa: E402

HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def cluster():
    path = os.pathsep.join([str(HERE.parent / "src"), str(HERE)])
    ray.init(num_cpus=2, include_dashboard=False, runtime_env={"env_vars": {"PYTHONPATH": path}},
             logging_level="WARNING")
    ray.data.DataContext.get_current().enable_progress_bars = False
    yield
    ray.shutdown()


def _crash_at(marker, victim):
    def wrap(factory):
        return CrashOnce(factory.kind, factory.config, marker=str(marker), victim=victim)

    return wrap


def test_cache_on_two_workers_with_one_killed_equals_one_process(cluster, tmp_path):
    root = write_folder(tmp_path / "photos", make_images(10, seed=7), corrupt=False)
    manifest = tmp_path / "m.jsonl"
    bucket_dataset(root, manifest, area=64 * 64, step=16, progress=False)
    one = encode_dataset(manifest, tmp_path / "one", shard_size=3, progress=False)
    marker = tmp_path / "killed"
    runner = RayRunner("local", workers=2, wrap=_crash_at(marker, "64x64/00000.safetensors"))
    many = encode_dataset(manifest, tmp_path / "ray", shard_size=3, progress=False, ray=runner)
    assert marker.exists(), "the worker was to be killed once"
    assert many.written == one.written and many.rows == one.rows == 10
    a, b = LatentDataset(tmp_path / "one"), LatentDataset(tmp_path / "ray")
    assert [r.key for r in a.manifest.rows] == [r.key for r in b.manifest.rows]
    assert len({r.key for r in b.manifest.rows}) == 10  # none twice
    # equal up to float summation order (Ray gives a 1-CPU task one thread, this process has more)
    err = max((a[i]["latents"] - b[i]["latents"]).abs().max().item() for i in range(len(a)))
    print(f"max |one process - ray| over the latents: {err:.2e}")
    assert err <= 1e-5


def test_generate_on_ray_equals_one_process(cluster, tmp_path):
    prompts = tmp_path / "p.txt"
    prompts.write_text("grass\n" + json.dumps({"prompt": "brick", "seed": 2}) + "\ngravel\n")
    items = read_prompts(prompts)
    config = json.dumps({"options": {"width": 32, "height": 32, "steps": 2, "progress": False}})
    one = run_batch(RunnerFactory("generate", config), items, tmp_path / "one", progress=False)
    marker = tmp_path / "killed"
    runner = RayRunner("local", workers=2, wrap=_crash_at(marker, "00002.png"))
    many = runner.run(RunnerFactory("generate", config), items, tmp_path / "ray")
    assert marker.exists() and many.done == one.done == ["00001.png", "00002.png", "00003.png"]
    assert not many.failed and sorted(p.name for p in (tmp_path / "ray").iterdir()) == one.done
    for name in one.done:
        with Image.open(tmp_path / "one" / name) as x, Image.open(tmp_path / "ray" / name) as y:
            d = np.abs(np.asarray(x).astype(int) - np.asarray(y).astype(int))
        print(f"{name}: max |one process - ray| {d.max()} of 255, mean {d.mean():.4f}")
        assert d.max() <= 1 and d.mean() < 0.01, name  # float summation order, then 8-bit rounding


def test_the_generate_command_with_ray_local_writes_what_one_process_writes(cluster, tmp_path, caplog):
    """`tilewise generate --prompts FILE --out DIR --ray local` (joining the cluster this module started):
    the same files as without --ray, one failed line reported with exit code 6."""
    from tilewise.cli import main

    prompts = tmp_path / "p.txt"
    prompts.write_text("grass\n" + json.dumps({"prompt": "brick", "width": 30}) + "\ngravel\n")
    codes = {}
    for name, extra in (("one", []), ("ray", ["--ray", "local", "--workers", "2"])):
        with pytest.raises(SystemExit) as e:
            main(["generate", "--prompts", str(prompts), "--out", str(tmp_path / name), "--width", "32",
                  "--height", "32", "--steps", "2", "-q", *extra])
        codes[name] = e.value.code
    assert codes == {"one": 6, "ray": 6}  # (the 30 px line fails in both)
    assert "Dataset" in caplog.text and "execution finished" in caplog.text  # (Ray Data ran the second)
    names = sorted(p.name for p in (tmp_path / "one").iterdir())
    assert names == ["00001.png", "00003.png", "failed.jsonl"]
    assert sorted(p.name for p in (tmp_path / "ray").iterdir()) == names
    for name in names[:2]:
        with Image.open(tmp_path / "one" / name) as x, Image.open(tmp_path / "ray" / name) as y:
            d = np.abs(np.asarray(x).astype(int) - np.asarray(y).astype(int))
        assert d.max() <= 1 and d.mean() < 0.01, name  # float summation order, then 8-bit rounding
