"""The `tilewise` command over a real (tiny, seeded) diffusers pipeline folder loaded with --model."""

import json
import re
import sys

import numpy as np
import pytest
import torch
from PIL import Image
from tiny_sd import char_tokenizer, text_encoder, unet_config, vae_config
from typer.testing import CliRunner

from tilewise.cli import app, main

D = 32


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny SD pipeline saved as a diffusers folder: what a user's --model points at."""
    from diffusers import AutoencoderKL, DDIMScheduler, StableDiffusionPipeline, UNet2DConditionModel

    root = tmp_path_factory.mktemp("model")
    torch.manual_seed(0)
    unet = UNet2DConditionModel(**unet_config(D))
    vae = AutoencoderKL(**vae_config())
    text = text_encoder(D)
    tok_dir = root / "tok"
    tok_dir.mkdir()
    pipe = StableDiffusionPipeline(
        vae=vae,
        text_encoder=text,
        tokenizer=char_tokenizer(tok_dir),
        unet=unet,
        scheduler=DDIMScheduler(clip_sample=False, steps_offset=1),
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    pipe.save_pretrained(root / "sd")
    return root / "sd"


runner = CliRunner()


def _run(*args):
    result = runner.invoke(app, [str(a) for a in args], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.output


def _png(path):
    with Image.open(path) as im:
        return np.asarray(im.convert("RGB"))


def _no_temporaries(folder):
    left = [p.name for p in folder.iterdir() if p.name.startswith(".") or p.suffix == ".tmp"]
    assert not left, f"temporary files left behind: {left}"


def test_help_shows_examples_and_defaults():
    out = _run("generate", "--help")
    assert "Example:" in out and "default: 20" in out.replace("[", "").replace("]", "")
    for command in ("upscale", "decode", "encode", "analyze", "plan", "compare", "buckets", "report"):
        assert "Example:" in _run(command, "--help")


def test_generate_with_regions_is_deterministic_and_atomic(model_dir, tmp_path):
    args = [
        "generate",
        "--model",
        model_dir,
        "--prompt",
        "grass",
        "--width",
        128,
        "--height",
        64,
        "--region",
        "0,0,64,64:brick",
        "--region",
        "64,0,128,64:gravel",
        "--tile",
        8,
        "--overlap",
        4,
        "--steps",
        2,
        "--vae-tile",
        4,
        "--seed",
        3,
        "--quiet",
    ]
    _run(*args, "--out", tmp_path / "a.png", "--report", tmp_path / "run")
    _run(*args, "--out", tmp_path / "b.png")
    a, b = _png(tmp_path / "a.png"), _png(tmp_path / "b.png")
    assert a.shape == (64, 128, 3)
    assert np.array_equal(a, b), "same seed, same image"
    html = (tmp_path / "run" / "report.html").read_text()
    assert "y = a" in html and "data:image/png;base64" in html and "plan" in html.lower()
    costs = json.loads((tmp_path / "run" / "costs.json").read_text())
    assert len(costs) >= 3 and all(c["seconds"] > 0 for c in costs)  # the real model's measured curve
    _no_temporaries(tmp_path)


def test_exact_decode_from_file_matches_untiled_decode(model_dir, tmp_path):
    from diffusers import AutoencoderKL
    from safetensors.torch import save_file

    vae = AutoencoderKL.from_pretrained(model_dir / "vae")
    sf = vae.config.scaling_factor
    z = torch.randn(1, 4, 11, 13, generator=torch.Generator().manual_seed(0))
    save_file({"latents": z * sf}, str(tmp_path / "z.safetensors"))
    out = _run(
        "decode",
        tmp_path / "z.safetensors",
        "--model",
        model_dir,
        "--out",
        tmp_path / "x.png",
        "--tile",
        4,
        "--staging",
        "host",
        "--quiet",
    )
    assert "plan" in out
    with torch.no_grad():
        ref = vae.decode(z).sample[0]
    want = ((ref.clamp(-1, 1) + 1) * 127.5).round().permute(1, 2, 0).numpy().astype(np.int16)
    got = _png(tmp_path / "x.png").astype(np.int16)
    assert got.shape == (88, 104, 3)
    assert np.abs(got - want).max() <= 1  # exact tiling; at most a rounding tie differs by one level
    _no_temporaries(tmp_path)


def test_encode_writes_latents_equal_to_untiled_mean(model_dir, tmp_path):
    from diffusers import AutoencoderKL
    from safetensors.torch import load_file

    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 256, (48, 72, 3), dtype=np.uint8)).save(tmp_path / "in.png")
    _run(
        "encode",
        tmp_path / "in.png",
        "--model",
        model_dir,
        "--out",
        tmp_path / "z.safetensors",
        "--tile",
        2,
        "--quiet",
    )
    vae = AutoencoderKL.from_pretrained(model_dir / "vae")
    x = torch.from_numpy(_png(tmp_path / "in.png")).permute(2, 0, 1)[None].float() / 127.5 - 1
    with torch.no_grad():
        ref = vae.encode(x).latent_dist.mean * vae.config.scaling_factor
    got = load_file(str(tmp_path / "z.safetensors"))["latents"]
    assert got.shape == ref.shape and (got - ref).abs().max().item() <= 1e-4


def test_plan_prints_and_draws(model_dir, tmp_path):
    out = _run(
        "plan",
        "--model",
        model_dir,
        "--width",
        512,
        "--height",
        256,
        "--tile",
        8,
        "--image",
        tmp_path / "plan.png",
    )
    assert "tiles" in out and "estimated device peak" in out
    assert (tmp_path / "plan.png").read_bytes()[:4] == b"\x89PNG"


def test_compare_reports_exact_and_diffusers_errors(model_dir, tmp_path):
    out = _run(
        "compare",
        "--model",
        model_dir,
        "--size",
        "24x16",
        "--tile",
        8,
        "--heatmap",
        tmp_path / "h.png",
        "--quiet",
    )
    exact = float(re.search(r"tilewise exact\s+max (\S+)", out).group(1))
    theirs = float(re.search(r"diffusers enable_tiling\s+max (\S+)", out).group(1))
    assert theirs > 100 * exact  # the comparison row is there and measured, not assumed
    assert exact <= 1e-4
    assert (tmp_path / "h.png").is_file()


def test_analyze_names_the_blockers(model_dir):
    out = _run("analyze", "--model", model_dir, "--size", 16)
    assert "exact_tileable: no" in out and "GroupNorm" in out.replace("group_norm", "GroupNorm")
    assert "whole output" in out


def test_buckets_explain_without_profiling():
    out = _run("buckets", "--request", "800x1200", "--request", "2048x512", "--policy", "pad", "--no-profile")
    assert "bucket" in out and out.count("->") == 2


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["generate", "--prompt", "x", "--width", "100", "--height", "64", "--out", "o.png"], "multiples of"),
        (["generate", "--prompt", "x", "--region", "1,2,3:oops", "--out", "o.png"], "x0,y0,x1,y1:prompt"),
        (["decode", "missing.safetensors", "--out", "o.png", "--model", "/no/such/model"], "does not exist"),
    ],
)
def test_errors_are_one_clear_line(argv, needle, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["tilewise", *argv])
    with pytest.raises(SystemExit) as exit_info:
        main()
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and needle in err and "Traceback" not in err
    assert len(err.splitlines()) == 1
    assert not list(tmp_path.iterdir()), "no output file may be left behind"
