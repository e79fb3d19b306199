"""Bucketing a dataset (issue #32): 200 photos of mixed sizes and a few corrupt files, as a folder, as
webdataset shards and as a Hugging Face dataset saved to disk; the manifest's rows against BucketPlanner."""

import io
import json
import tarfile

import numpy as np
import pytest
from jobs_support import CORRUPT, TRUNCATED, make_images, png_bytes, write_folder
from PIL import Image
from typer.testing import CliRunner

from tilewise.buckets import BucketPlanner
from tilewise.cli import app
from tilewise.errors import BadInputFile, BadRequest
from tilewise.jobs import bucket_dataset, open_dataset, read_manifest
from tilewise.jobs.manifest import scaled_request

AREA, STEP = 64 * 64, 16


@pytest.fixture(scope="module")
def images():
    return make_images(200)


@pytest.fixture(scope="module")
def folder(tmp_path_factory, images):
    return write_folder(tmp_path_factory.mktemp("photos"), images)


@pytest.fixture(scope="module")
def manifest(folder, tmp_path_factory):
    out = tmp_path_factory.mktemp("m") / "manifest.jsonl"
    bucket_dataset(folder, out, area=AREA, step=STEP, progress=False)
    return read_manifest(out)


def test_one_row_per_image_and_every_unreadable_file_listed_with_its_reason(manifest, images):
    keys = [r.key for r in manifest.rows]
    assert len(keys) == len(set(keys)) == len(images) + 1  # + the truncated body: its header reads
    assert TRUNCATED in keys and not any(k.endswith(".txt") for k in keys)
    skipped = dict(manifest.skipped)
    assert set(skipped) == set(CORRUPT)
    assert "empty" in skipped["bad/empty.jpg"] and "not an image" in skipped["bad/noise.png"]
    assert "truncated or corrupt" in skipped["bad/cut.png"]
    assert [r.index for r in manifest.rows] == list(range(len(manifest.rows)))


def test_sizes_are_the_files_own(manifest, folder, images):
    by_key = {r.key: r for r in manifest.rows}
    for i, a in enumerate(images):
        key = f"d{i % 3}/{i:04d}.{'jpg' if i % 4 == 3 else 'png'}"
        assert (by_key[key].width, by_key[key].height) == (a.shape[1], a.shape[0])


def test_rows_are_what_bucket_planner_assigns(manifest):
    planner = BucketPlanner(area=AREA, step=STEP)
    assert manifest.planner().buckets == planner.buckets
    for r in manifest.rows:
        assert r.scaled == scaled_request(planner, "pad", r.width, r.height)
        assert r.assignment == planner.assign(*r.scaled, policy="pad")
        assert r.bucket in planner.buckets and r.scaled[0] <= r.bucket[0] and r.scaled[1] <= r.bucket[1]
        ratio = (r.scaled[0] / r.width) / (r.scaled[1] / r.height)
        assert abs(ratio - 1) < 0.1  # the scale keeps the aspect (sides floored)
        mc = r.micro_conditioning
        y0, y1, x0, x1 = r.assignment.content_box
        assert mc["original_size"] == (r.height, r.width) and mc["target_size"] == (y1 - y0, x1 - x0)
        assert r.explanation.startswith(f"File {r.width}x{r.height}")


def test_transform_gives_the_bucket_and_the_mask_marks_the_padding(manifest, folder):
    data = open_dataset(folder)
    f = manifest.header["planner"]["latent_factor"]
    for r in manifest.rows[:40]:
        if r.key == TRUNCATED:
            continue
        x = r.transform(data.pixels(r.key))
        assert x.shape == (r.bucket[1], r.bucket[0], 3)
        y0, y1, x0, x1 = r.assignment.content_box
        pad = np.ones(x.shape[:2], bool)
        pad[y0:y1, x0:x1] = False
        assert (x[pad] == 0).all()  # padding is the fill (0)
        mask = r.assignment.mask
        assert mask.shape == (r.bucket[1] // f, r.bucket[0] // f)
        assert np.isclose(mask.mean(), pad.mean())
        my0, my1, mx0, mx1 = r.to_json()["mask_box"]  # the latent cells with content
        inside = np.zeros(mask.shape, bool)
        inside[my0:my1, mx0:mx1] = True
        assert (mask[~inside] == 1).all() and (mask[inside] < 1).all()


@pytest.mark.parametrize("policy", ["resize", "crop", "auto"])
def test_other_policies_rows_match_the_planner(folder, tmp_path, policy):
    res = bucket_dataset(folder, tmp_path / "m.jsonl", area=AREA, step=STEP, policy=policy, progress=False)
    planner = BucketPlanner(area=AREA, step=STEP)
    back = read_manifest(tmp_path / "m.jsonl")
    assert [r.to_json() for r in back.rows] == [r.to_json() for r in res.manifest.rows]
    for r in back.rows:
        assert r.assignment == planner.assign(*r.scaled, policy=policy)
    # every file is a row or a skipped item with a reason (none dropped silently)
    assert len(back.rows) + len(back.skipped) == 201 + len(CORRUPT)
    assert all(reason for _, reason in back.skipped)


def test_the_manifest_reads_back_equal(manifest, folder, tmp_path):
    res = bucket_dataset(folder, tmp_path / "again.jsonl", area=AREA, step=STEP, progress=False)
    assert [r.to_json() for r in res.manifest.rows] == [r.to_json() for r in manifest.rows]
    lines = (tmp_path / "again.jsonl").read_text().splitlines()
    assert json.loads(lines[0])["format"] == "tilewise-buckets" and len(lines) == 1 + 201 + len(CORRUPT)


def test_webdataset_shards_and_a_saved_hf_dataset_read_as_the_folder(images, tmp_path, manifest):
    sub = images[:30]
    shards = tmp_path / "wds"
    shards.mkdir()
    for s in range(2):
        with tarfile.open(shards / f"shard-{s:04d}.tar", "w") as tar:
            for i in range(s * 15, s * 15 + 15):
                for name, data in ((f"{i:06d}.png", png_bytes(sub[i])), (f"{i:06d}.txt", b"caption")):
                    info = tarfile.TarInfo(name)
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
    wds = open_dataset(shards)
    assert wds.kind == "webdataset" and len(wds) == 30
    assert [wds.size(k) for k in wds.keys()] == [(a.shape[1], a.shape[0]) for a in sub]
    assert (wds.pixels(wds.keys()[3]) == sub[3]).all()
    datasets = pytest.importorskip("datasets", reason="the tilewise[datasets] extra is not installed")
    from PIL import Image

    ds = datasets.Dataset.from_dict({"image": [Image.fromarray(a) for a in sub], "n": list(range(30))})
    ds.save_to_disk(str(tmp_path / "hf"))
    hf = open_dataset(tmp_path / "hf")
    assert hf.kind == "datasets" and len(hf) == 30
    assert [hf.size(k) for k in hf.keys()] == [(a.shape[1], a.shape[0]) for a in sub]
    assert (hf.pixels(hf.keys()[5]) == sub[5]).all()
    res = bucket_dataset(tmp_path / "hf", None, area=AREA, step=STEP, progress=False)
    planner = BucketPlanner(area=AREA, step=STEP)
    want = [planner.assign(*scaled_request(planner, "pad", a.shape[1], a.shape[0])).bucket for a in sub]
    assert [r.bucket for r in res.manifest.rows] == want


def test_bad_inputs_are_refused_naming_them(tmp_path):
    with pytest.raises(BadRequest, match="does not exist"):
        bucket_dataset(tmp_path / "nope", None)
    (tmp_path / "x.jsonl").write_text('{"format": "something else"}\n')
    with pytest.raises(BadInputFile, match="not a tilewise bucket manifest"):
        read_manifest(tmp_path / "x.jsonl")


def test_the_command_writes_the_manifest_and_its_summary(folder, tmp_path, manifest):
    runner = CliRunner()
    out, plot = tmp_path / "cli.jsonl", tmp_path / "cost.png"
    res = runner.invoke(app, ["buckets", str(folder), "--out", str(out), "--area", str(AREA), "--step",
                              str(STEP), "-q", "--plot", str(plot), "--repeats", "1"])
    assert res.exit_code == 0, res.output
    assert "201 images in" in res.output and f"{len(CORRUPT)} skipped" in res.output
    with Image.open(plot) as im:  # the measured cost of the buckets the dataset uses
        assert im.format == "PNG" and im.width > 100
    assert [r.to_json() for r in read_manifest(out).rows] == [r.to_json() for r in manifest.rows]
    res = runner.invoke(app, ["buckets", str(folder)])
    assert isinstance(res.exception, BadRequest) and "--out" in str(res.exception)
    res = runner.invoke(app, ["buckets", "--request", "800x1200", "--no-profile"])
    assert res.exit_code == 0 and "bucket" in res.output  # the --request form still works
