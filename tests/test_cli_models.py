"""The CLI over transformer pipeline folders (SD3, Flux) and the upscale options of issue 18.

Folders saved with `save_pretrained` from tiny real pipelines with real text encoders and tokenizers
(tests/tiny_folders.py); the oracle for `generate` is the stock pipeline called with the same prompt,
seed and steps (one tile covering the latent: the PNG equals its image up to 8-bit rounding).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from typer.testing import CliRunner

pytest.importorskip("diffusers")

from tiny_folders import flux_folder, sd3_folder  # noqa: E402

from tilewise.cli import app  # noqa: E402

runner = CliRunner()
W, H = 64, 48  # pixels; the VAEs have 2 px per latent pixel: a 24x32 latent


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {"sd3": sd3_folder(root), "flux": flux_folder(root)}


def _run(*args):
    result = runner.invoke(app, [str(a) for a in args], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.output


def _refused(*args) -> str:
    result = runner.invoke(app, [str(a) for a in args])
    assert result.exit_code != 0 and isinstance(result.exception, ValueError), result.output
    return str(result.exception)


def _png(path) -> np.ndarray:
    with Image.open(path) as im:
        return np.asarray(im.convert("RGB")).astype(np.int16)


@pytest.mark.parametrize("name", ["sd3", "flux"])
def test_generate_takes_a_transformer_folder_and_one_tile_equals_the_stock_pipeline(name, folders, tmp_path):
    from diffusers import DiffusionPipeline

    out = tmp_path / f"{name}.png"
    said = _run("generate", "--model", folders[name], "--prompt", "grass", "--width", W, "--height", H,
                "--steps", 2, "--tile", 64, "--overlap", 0, "--out", out, "-q")
    assert "1 transformer tiles per call" in said
    pipe = DiffusionPipeline.from_pretrained(folders[name], local_files_only=True,
                                             **({"text_encoder_3": None, "tokenizer_3": None}
                                                if name == "sd3" else {}))
    pipe.set_progress_bar_config(disable=True)
    extra = {"negative_prompt": ""} if name == "sd3" else {}
    with torch.no_grad():
        ref = pipe(prompt="grass", height=H, width=W, num_inference_steps=2, guidance_scale=5.0,
                   generator=torch.Generator("cpu").manual_seed(0), output_type="np", **extra).images[0]
    got = _png(out)
    assert got.shape == (H, W, 3) and got.std() > 2
    assert np.abs(got - np.round(ref * 255)).max() <= 1  # 8-bit rounding of an exact tiled decode


def test_generate_on_several_tiles_with_a_region_and_upscale_on_a_transformer_folder(folders, tmp_path):
    out = tmp_path / "regions.png"
    _run("generate", "--model", folders["sd3"], "--prompt", "grass", "--region", "0,0,32,48:brick",
         "--width", W, "--height", H, "--steps", 2, "--tile", 16, "--overlap", 8, "--out", out, "-q")
    assert _png(out).shape == (H, W, 3)
    big = tmp_path / "big.png"
    said = _run("upscale", out, "--model", folders["flux"], "--scale", 2, "--strength", 0.5, "--steps", 2,
                "--tile", 32, "--overlap", 16, "--prompt", "grass", "--out", big, "-q")
    assert _png(big).shape == (2 * H, 2 * W, 3) and "(128x96, 8-bit) from 64x48" in said


def test_transformer_folders_refuse_what_does_not_apply(folders, tmp_path):
    msg = _refused("generate", "--model", folders["flux"], "--prompt", "grass", "--scheduler", "euler",
                   "--out", tmp_path / "x.png")
    assert "--scheduler euler applies to UNet pipelines; FluxPipeline keeps its own" in msg
    msg = _refused("generate", "--model", folders["flux"], "--prompt", "grass", "--width", 66, "--height", H,
                   "--out", tmp_path / "x.png")
    assert "positive multiples of 4 but are 66 and 48" in msg
    Image.fromarray(np.zeros((16, 16, 3), np.uint8)).save(tmp_path / "in.png")
    msg = _refused("upscale", tmp_path / "in.png", "--model", folders["flux"], "--inversion-steps", 2,
                   "--out", tmp_path / "y.png")
    assert "inversion_steps needs a DDPM-family scheduler" in msg


# ---- upscale --controlnet FOLDER --inversion-steps N on a UNet folder ------------------------------------
@pytest.fixture(scope="module")
def sd_with_controlnet(tmp_path_factory):
    """The tiny SD pipeline folder of test_cli and a ControlNet of its shape, saved as folders."""
    import tiny_pipes as tp
    from diffusers import AutoencoderKL, DDIMScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from tiny_sd import char_tokenizer, text_encoder, unet_config, vae_config

    root = tmp_path_factory.mktemp("sdcn")
    torch.manual_seed(0)
    (root / "tok").mkdir()
    pipe = StableDiffusionPipeline(vae=AutoencoderKL(**vae_config()), text_encoder=text_encoder(32),
                                   tokenizer=char_tokenizer(root / "tok"),
                                   unet=UNet2DConditionModel(**unet_config(32)),
                                   scheduler=DDIMScheduler(clip_sample=False, steps_offset=1),
                                   safety_checker=None, feature_extractor=None, requires_safety_checker=False)
    pipe.save_pretrained(root / "sd")
    tp._controlnet().save_pretrained(root / "cn")
    rng = np.random.default_rng(0)
    Image.fromarray((rng.random((24, 16, 3)) * 255).astype(np.uint8)).save(root / "in.png")
    return root


def test_upscale_with_a_controlnet_folder_and_inversion(sd_with_controlnet, tmp_path):
    root = sd_with_controlnet
    common = ["upscale", root / "in.png", "--model", root / "sd", "--scale", 2, "--strength", 0.5,
              "--steps", 4, "--tile", 4, "--overlap", 2, "--prompt", "grass", "-q"]
    outs = {}
    for name, extra in {"plain": [], "controlnet": ["--controlnet", root / "cn", "--controlnet-scale", 0.8],
                        "both": ["--controlnet", root / "cn", "--inversion-steps", 2]}.items():
        _run(*common, *extra, "--out", tmp_path / f"{name}.png")
        outs[name] = _png(tmp_path / f"{name}.png")
    assert all(o.shape == (48, 32, 3) for o in outs.values())
    assert np.abs(outs["controlnet"] - outs["plain"]).max() > 2  # the ControlNet takes part
    assert np.abs(outs["both"] - outs["controlnet"]).max() > 2  # inversion instead of fresh noise
    msg = _refused(*common, "--controlnet", root / "sd", "--out", tmp_path / "x.png")
    assert "is not a diffusers model folder: it has no config.json" in msg
    msg = _refused(*common, "--controlnet", root / "sd" / "unet", "--out", tmp_path / "x.png")
    assert "holds a UNet2DConditionModel, not a diffusers ControlNet" in msg
