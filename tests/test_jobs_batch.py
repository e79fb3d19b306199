"""Batch jobs with one model load (issue #32): `generate --prompts FILE --out DIR` and `upscale DIR --out
DIR` on the embedded model; each output equals the one-image command's, a failed item is reported and
the rest go on (exit 6), a rerun makes only what is missing."""

import json

import numpy as np
import pytest
from PIL import Image

from tilewise.cli import main
from tilewise.errors import BadRequest
from tilewise.jobs.batch import GenerateRunner, UpscaleRunner, image_items, read_prompts, run_batch

STEPS = ["--steps", "2", "-q"]


def _cli(*args) -> int:
    with pytest.raises(SystemExit) as e:
        main([str(a) for a in args])
    return e.value.code


def _png(path):
    with Image.open(path) as im:
        return np.asarray(im.convert("RGB"))


@pytest.fixture(scope="module")
def loaded():
    from tilewise.pipelines import load_pipeline

    return load_pipeline(None)


PROMPTS = [
    "grass",
    json.dumps({"prompt": "brick", "width": 32, "height": 48, "seed": 3, "regions": ["0,0,16,48:gravel"]}),
    "",
    json.dumps({"prompt": "a size the model refuses", "width": 30}),
    '{"prompt": oops}',
]


def test_generate_batch_equals_each_single_image_and_reports_failures(tmp_path, loaded):
    from tilewise.pipelines import GenerateOptions, parse_region, run_generate

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    out = tmp_path / "out"
    assert _cli("generate", "--prompts", prompts, "--out", out, "--width", 32, "--height", 32, *STEPS) == 6
    assert sorted(p.name for p in out.iterdir()) == ["00001.png", "00002.png", "failed.jsonl"]
    failed = {d["name"]: d["error"] for d in map(json.loads, (out / "failed.jsonl").read_text().splitlines())}
    assert set(failed) == {"00004.png", "00005.png"}
    assert "multiples of 8" in failed["00004.png"] and "not JSON" in failed["00005.png"]
    for name, opts in (("00001.png", dict(prompt="grass", width=32, height=32)),
                       ("00002.png", dict(prompt="brick", width=32, height=48, seed=3,
                                          regions=[parse_region("0,0,16,48:gravel")]))):
        single = tmp_path / f"single_{name}"
        run_generate(loaded, GenerateOptions(**opts, steps=2, out=str(single), progress=False))
        assert np.array_equal(_png(out / name), _png(single)), name
    # a rerun makes only what is missing (the kept image is not touched); the model already loaded here
    kept = (out / "00002.png").stat().st_mtime_ns
    first = _png(out / "00001.png")
    (out / "00001.png").unlink()
    base = GenerateOptions("", 32, 32, steps=2, progress=False)
    again = run_batch(lambda: GenerateRunner(loaded, base), read_prompts(prompts), out, progress=False)
    assert again.done == ["00001.png"] and again.kept == ["00002.png"] and list(again.failed) == [
        "00004.png", "00005.png"]
    assert (out / "00002.png").stat().st_mtime_ns == kept and np.array_equal(_png(out / "00001.png"), first)


def test_upscale_folder_equals_each_single_upscale(tmp_path, loaded):
    from tilewise.diffusion import UpscaleOptions, run_upscale

    src = tmp_path / "in"
    (src / "sub").mkdir(parents=True)
    rng = np.random.default_rng(0)
    for name in ("a.png", "sub/b.png"):
        Image.fromarray(rng.integers(0, 256, (24, 16, 3), np.uint8)).save(src / name)
    (src / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n not really")
    out = tmp_path / "out"
    job = UpscaleOptions(scale=2, strength=0.5, tile_size=4, overlap=0, num_inference_steps=2, disable=True)
    result = run_batch(lambda: UpscaleRunner(loaded, job), image_items(src), out, progress=False)
    assert result.done == ["a.png", "sub/b.png"] and list(result.failed) == ["broken.png"]
    assert "BadInputFile" in result.failed["broken.png"]
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*.png")) == ["a.png", "sub/b.png"]
    from tilewise.sources import read_image

    cond = loaded.encode("", "")
    for name in ("a.png", "sub/b.png"):
        want = run_upscale(loaded.pipe, read_image(src / name).tensor((0.0, 1.0)), job, guidance_scale=5.0,
                           **cond)
        got = _png(out / name)
        assert got.shape == (48, 32, 3)
        ref = np.round(want[0].permute(1, 2, 0).clamp(0, 1).numpy() * 255)
        assert np.abs(got.astype(float) - ref).max() <= 1, name


def test_bad_requests_before_the_model_loads(tmp_path):
    (tmp_path / "empty.txt").write_text("\n# a comment\n")
    with pytest.raises(BadRequest, match="no prompt line"):
        read_prompts(tmp_path / "empty.txt")
    assert _cli("generate", "--out", tmp_path / "o") == 2  # neither --prompt nor --prompts
    (tmp_path / "p.txt").write_text("grass\n")
    assert _cli("generate", "--prompt", "x", "--prompts", tmp_path / "p.txt", "--out", tmp_path / "o") == 2
    assert _cli("generate", "--prompt", "x", "--ray", "local", "--out", tmp_path / "o.png") == 2


def test_without_ray_the_commands_say_how_to_install_it(tmp_path, monkeypatch, capsys):
    import sys

    monkeypatch.setitem(sys.modules, "ray", None)  # import ray now raises ImportError
    (tmp_path / "p.txt").write_text("grass\n")
    assert _cli("generate", "--prompts", tmp_path / "p.txt", "--out", tmp_path / "o", "--ray", "local") == 2
    assert "pip install 'tilewise[ray]'" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()  # refused before any work
