"""`tilewise generate --frames N` over a video pipeline folder: a tiny WanPipeline (UMT5 text encoder, letter
tokenizer, Wan 2.1 VAE) saved with save_pretrained (tests/tiny_folders.py).

Oracles: the stock pipeline with the same prompt, seed and steps (one tile covering the latent: every
frame PNG equals its frame up to 8-bit rounding); several tiles and frame windows: the stock output's
shape. Refusals: the exit status of their kind, before the pipeline runs, nothing written. diffusers 0.42
loads a saved Wan transformer only with the accelerate package (tilewise[video], in the test extra):
without it the folder is refused by name, and that refusal is what runs here.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch
from PIL import Image
from typer.testing import CliRunner

pytest.importorskip("diffusers")

from tiny_folders import wan_folder  # noqa: E402

from tilewise.cli import app, main  # noqa: E402

runner = CliRunner()
W, H, FRAMES = 80, 48, 9  # a 10 x 6 latent of 3 frames
SIZE = ("--width", W, "--height", H, "--steps", 1)


ACCELERATE = importlib.util.find_spec("accelerate") is not None
needs_accelerate = pytest.mark.skipif(not ACCELERATE, reason="loading a saved WanPipeline needs accelerate "
                                      "(diffusers 0.42: WanTransformer3DModel keeps modules in float32); "
                                      "test_a_wan_folder_without_accelerate_is_refused_by_name runs instead")


@pytest.fixture(scope="module")
def wan(tmp_path_factory):
    return wan_folder(tmp_path_factory.mktemp("models"))


def _run(*args) -> str:
    result = runner.invoke(app, [str(a) for a in args], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.output


def _refused(capsys, *args) -> tuple[int, str]:
    with pytest.raises(SystemExit) as e:
        main([str(a) for a in args])
    return e.value.code, capsys.readouterr().err


@pytest.mark.skipif(ACCELERATE, reason="accelerate is installed: the folder loads (the tests above)")
def test_a_wan_folder_without_accelerate_is_refused_by_name(wan, tmp_path, capsys):
    code, err = _refused(capsys, "generate", "--model", wan, "--prompt", "fox", *SIZE, "--frames", FRAMES,
                         "--out", tmp_path / "f{:02d}.png")
    assert code == 5 and "diffusers loads transformer (WanTransformer3DModel) only with the accelerate" in err
    assert not list(tmp_path.iterdir())


@needs_accelerate
def test_generate_frames_one_tile_equals_the_stock_wan_pipeline(wan, tmp_path):
    from diffusers import DiffusionPipeline

    said = _run("generate", "--model", wan, "--prompt", "fox", *SIZE, "--frames", FRAMES, "--tile", 64,
                "--overlap", 0, "--out", tmp_path / "f{:02d}.png", "-q")
    assert f"({FRAMES} frames of {W}x{H})" in said and "1 transformer tiles per call" in said
    pipe = DiffusionPipeline.from_pretrained(wan, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    with torch.no_grad():
        ref = pipe(prompt="fox", height=H, width=W, num_frames=FRAMES, num_inference_steps=1,
                   guidance_scale=5.0, generator=torch.Generator("cpu").manual_seed(0),
                   output_type="np").frames[0]
    got = np.stack([np.asarray(Image.open(tmp_path / f"f{i:02d}.png")).astype(np.int16)
                    for i in range(FRAMES)])
    assert got.shape == (FRAMES, H, W, 3) and got.std() > 2
    assert np.abs(got - np.round(ref * 255)).max() <= 1  # 8-bit rounding of an exact tiled decode
    assert not (tmp_path / f"f{FRAMES:02d}.png").exists()


@needs_accelerate
def test_generate_frames_over_tiles_and_frame_windows_to_a_stack(wan, tmp_path):
    out = tmp_path / "video.npy"
    said = _run("generate", "--model", wan, "--prompt", "fox", *SIZE, "--frames", FRAMES, "--tile", 6,
                "--overlap", 2, "--tile-frames", 2, "--frame-overlap", 1, "--out", out, "-q")
    video = np.load(out)
    assert video.shape == (FRAMES, H, W, 3) and video.dtype == np.uint8 and video.std() > 2
    assert "(9 frames of 80x48)" in said and "4 transformer tiles per call" in said  # 2 windows x 1 x 2


@needs_accelerate
def test_generate_frames_refuses_before_the_pipeline_runs(wan, tmp_path, capsys):
    code, err = _refused(capsys, "generate", "--model", wan, "--prompt", "fox", *SIZE, "--frames", 8,
                         "--out", tmp_path / "f{:02d}.png")
    assert code == 2 and "--frames 8: WanPipeline makes 1 + 4k frames" in err and "use 5 or 9" in err
    code, err = _refused(capsys, "generate", "--model", wan, "--prompt", "fox", "--frames", FRAMES,
                         "--out", tmp_path / "one.png")
    assert code == 2 and "makes 9 frames: write them to a frame pattern" in err
    code, err = _refused(capsys, "generate", "--model", wan, "--prompt", "fox", *SIZE, "--out",
                         tmp_path / "one.png")
    assert code == 2 and "WanPipeline is a video pipeline: give --frames" in err
    code, err = _refused(capsys, "generate", "--model", wan, "--prompt", "fox", *SIZE, "--frames", FRAMES,
                         "--tile-frames", 2, "--method", "spot", "--out", tmp_path / "s.npy")
    assert code == 2 and "tile_frames (overlapping frame windows) works with method" in err
    code, err = _refused(capsys, "generate", "--model", wan, "--prompt", "fox", "--width", 72, "--height",
                         H, "--frames", FRAMES, "--out", tmp_path / "w.npy")
    assert code == 2 and "multiples of 16" in err and "are 72 and 48" in err
    assert not list(tmp_path.iterdir())
