"""--model X.safetensors --config FOLDER: an original-format (LDM) single-file checkpoint of a tiny SD
pipeline, written by our own diffusers -> LDM key mapper (ldm_format.py), loaded offline through
diffusers' from_single_file and compared with the folder it came from, weight by weight and pixel by pixel."""

import json
import sys

import numpy as np
import pytest
import torch
from ldm_format import CLIP_PREFIX, UNET_PREFIX, VAE_PREFIX, pipeline_to_ldm, unet_to_ldm, vae_to_ldm
from PIL import Image
from tiny_sd import char_tokenizer, text_encoder, unet_config, vae_config
from typer.testing import CliRunner

from tilewise.cli import app, main
from tilewise.pipelines import generate, load_pipeline

D = 32


def _jitter(model):
    """Perturb every weight: no two tensors keep a shared default (norms are 1 and 0 when built), so a
    mapper that swaps or drops a tensor cannot pass unnoticed."""
    g = torch.Generator().manual_seed(sum(p.numel() for p in model.parameters()))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return model


def _unet(**kw):
    from diffusers import UNet2DConditionModel

    cfg = unet_config(D)
    cfg.update(kw)
    return _jitter(UNet2DConditionModel(**cfg))


def _vae(**kw):
    from diffusers import AutoencoderKL

    cfg = vae_config()
    cfg.update(kw)
    return _jitter(AutoencoderKL(**cfg))


@pytest.fixture(scope="module")
def sd(tmp_path_factory):
    """(diffusers folder, original-format .safetensors) of one tiny seeded SD-1.x pipeline."""
    from diffusers import DDIMScheduler, StableDiffusionPipeline
    from safetensors.torch import save_file

    root = tmp_path_factory.mktemp("single")
    torch.manual_seed(0)
    text = text_encoder(D)
    tok_dir = root / "tok"
    tok_dir.mkdir()
    pipe = StableDiffusionPipeline(
        vae=_vae(),
        text_encoder=_jitter(text),
        tokenizer=char_tokenizer(tok_dir),
        unet=_unet(),
        scheduler=DDIMScheduler(clip_sample=False, steps_offset=1),
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    pipe.save_pretrained(root / "sd")
    save_file(pipeline_to_ldm(pipe), str(root / "tiny-sd.safetensors"))
    return root / "sd", root / "tiny-sd.safetensors"


def _assert_same_weights(got, want, name):
    g, w = got.state_dict(), want.state_dict()
    assert sorted(g) == sorted(w), f"{name}: parameter names differ"
    differ = [k for k in w if not torch.equal(g[k], w[k])]
    assert not differ, f"{name}: {len(differ)} of {len(w)} tensors differ, e.g. {differ[:3]}"


def test_checkpoint_is_in_original_ldm_layout(sd):
    from safetensors import safe_open

    _, ckpt = sd
    with safe_open(str(ckpt), "pt") as f:
        keys = set(f.keys())
        q = f.get_tensor(VAE_PREFIX + "decoder.mid.attn_1.q.weight")
    assert all(k.startswith((UNET_PREFIX, VAE_PREFIX, CLIP_PREFIX + "text_model.")) for k in keys)
    for k in (  # landmarks of the CompVis layout, as in released SD-1.x checkpoints
        UNET_PREFIX + "input_blocks.0.0.weight",
        UNET_PREFIX + "input_blocks.2.0.op.weight",  # downsampler after block 0 (L=1)
        UNET_PREFIX + "middle_block.1.transformer_blocks.0.attn2.to_k.weight",
        UNET_PREFIX + "output_blocks.1.2.conv.weight",  # upsampler after an attention slot
        UNET_PREFIX + "out.2.weight",
        VAE_PREFIX + "encoder.down.0.block.0.norm1.weight",
        VAE_PREFIX + "decoder.up.3.upsample.conv.weight",
        CLIP_PREFIX + "text_model.embeddings.position_embedding.weight",
    ):
        assert k in keys, k
    assert q.shape == (16, 16, 1, 1)  # LDM's 1x1-conv attention


def test_single_file_round_trip_is_exact(sd):
    from diffusers import StableDiffusionPipeline

    folder, ckpt = sd
    ref = StableDiffusionPipeline.from_pretrained(folder, local_files_only=True)
    got = StableDiffusionPipeline.from_single_file(str(ckpt), config=str(folder), local_files_only=True)
    for name in ("unet", "vae", "text_encoder"):
        _assert_same_weights(getattr(got, name), getattr(ref, name), name)
    assert type(got.scheduler) is type(ref.scheduler)
    assert got.tokenizer("brick").input_ids == ref.tokenizer("brick").input_ids


@pytest.mark.parametrize(
    "unet_kw,vae_kw",
    [
        (
            dict(
                block_out_channels=(32, 32, 64),
                layers_per_block=2,
                down_block_types=("CrossAttnDownBlock2D", "DownBlock2D", "CrossAttnDownBlock2D"),
                up_block_types=("CrossAttnUpBlock2D", "UpBlock2D", "CrossAttnUpBlock2D"),
            ),
            dict(
                block_out_channels=(8, 16, 16),
                down_block_types=("DownEncoderBlock2D",) * 3,
                up_block_types=("UpDecoderBlock2D",) * 3,
                layers_per_block=2,
            ),
        ),
        (
            dict(
                block_out_channels=(32,),
                layers_per_block=3,
                down_block_types=("CrossAttnDownBlock2D",),
                up_block_types=("CrossAttnUpBlock2D",),
            ),
            dict(
                block_out_channels=(8,),
                down_block_types=("DownEncoderBlock2D",),
                up_block_types=("UpDecoderBlock2D",),
            ),
        ),
    ],
)
def test_mapper_is_general_in_blocks_and_layers(tmp_path, unet_kw, vae_kw):
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from safetensors.torch import save_file

    torch.manual_seed(1)
    unet, vae = _unet(**unet_kw), _vae(**vae_kw)
    unet.save_config(tmp_path / "unet")
    vae.save_config(tmp_path / "vae")
    ldm = unet_to_ldm(unet.state_dict(), unet.config.layers_per_block)
    ldm.update(vae_to_ldm(vae.state_dict(), len(vae.config.up_block_types)))
    save_file({k: v.contiguous() for k, v in ldm.items()}, str(tmp_path / "m.safetensors"))
    kw = dict(config=str(tmp_path), local_files_only=True)
    ckpt = str(tmp_path / "m.safetensors")
    _assert_same_weights(UNet2DConditionModel.from_single_file(ckpt, subfolder="unet", **kw), unet, "unet")
    _assert_same_weights(AutoencoderKL.from_single_file(ckpt, subfolder="vae", **kw), vae, "vae")


def test_torch_ckpt_loads_the_same_weights(sd, tmp_path):
    from safetensors.torch import load_file

    folder, ckpt = sd
    torch.save({"state_dict": load_file(str(ckpt))}, tmp_path / "tiny-sd.ckpt")  # Lightning's nesting
    got, want = load_pipeline(tmp_path / "tiny-sd.ckpt", config=folder), load_pipeline(folder)
    for name in ("unet", "vae", "text_encoder"):
        _assert_same_weights(getattr(got.pipe, name), getattr(want.pipe, name), name)


def _other_architecture(folder, tmp_path):
    import shutil

    shutil.copytree(folder, tmp_path / "other")
    _unet(layers_per_block=2).save_config(tmp_path / "other" / "unet")
    return tmp_path / "other"


@pytest.mark.parametrize(
    "case,needle",
    [
        ("other config", r"does not fit the architecture of --config '.*other': size mismatch for up_blocks"),
        ("no up block", r"lacks 12 of the 208 unet weights that --config '.*sd' describes"),
        ("no text encoder", r"does not fit the architecture .*CLIPTextModel.* missing"),
    ],
)
def test_checkpoint_that_does_not_fit_the_config_is_refused(sd, tmp_path, case, needle):
    """diffusers loads with strict=False: a weight the file lacks would stay random, silently."""
    from safetensors.torch import load_file, save_file

    folder, ckpt = sd
    if case == "other config":
        folder = _other_architecture(folder, tmp_path)
    else:
        drop = "output_blocks.3." if case == "no up block" else CLIP_PREFIX
        kept = {k: v for k, v in load_file(str(ckpt)).items() if drop not in k}
        ckpt = tmp_path / "part.safetensors"
        save_file(kept, str(ckpt))
    with pytest.raises(ValueError, match=needle) as info:
        load_pipeline(ckpt, config=folder)
    assert "\n" not in str(info.value)


def test_generation_from_single_file_equals_folder(sd):
    folder, ckpt = sd
    args = dict(width=64, height=48, steps=2, seed=5, tile_size=4, overlap=2, vae_tile=4, progress=False)
    want = generate(load_pipeline(folder), "brick", **args).image
    got = generate(load_pipeline(ckpt, config=folder), "brick", **args).image
    assert want.shape == (1, 3, 48, 64)
    assert torch.equal(got, want)


def _png(path):
    with Image.open(path) as im:
        return np.asarray(im.convert("RGB"))


def test_cli_generate_single_file_writes_the_folder_image(sd, tmp_path):
    folder, ckpt = sd
    runner = CliRunner()
    common = "generate --prompt grass --width 64 --height 32 --tile 4 --overlap 2 --steps 2 --vae-tile 4"
    common = [*common.split(), "--seed", "2", "--quiet"]
    runs = {
        "file": ["--model", str(ckpt), "--config", str(folder)],
        "folder": ["--model", str(folder)],
    }
    for name, model in runs.items():
        out = str(tmp_path / f"{name}.png")
        result = runner.invoke(app, [*common, *model, "--out", out], catch_exceptions=False)
        assert result.exit_code == 0, result.output
    a, b = _png(tmp_path / "file.png"), _png(tmp_path / "folder.png")
    assert a.shape == (32, 64, 3) and np.array_equal(a, b)


def test_cli_single_file_without_config_is_one_clear_line(sd, tmp_path, monkeypatch, capsys):
    _, ckpt = sd
    monkeypatch.chdir(tmp_path)
    argv = ["tilewise", "generate", "--prompt", "x", "--model", str(ckpt), "--out", "o.png", "--quiet"]
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit) as exit_info:
        main()
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: ") and "Traceback" not in err
    assert "--config FOLDER" in err and str(ckpt) in err and "offline" in err
    assert not list(tmp_path.iterdir()), "no output file may be left behind"


def test_bad_config_is_named(sd, tmp_path):
    folder, ckpt = sd
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match=r"'.*/nowhere' does not exist"):
        load_pipeline(ckpt, config=tmp_path / "nowhere")
    with pytest.raises(ValueError, match=r"'.*/empty' has no model_index.json"):
        load_pipeline(ckpt, config=empty)
    with pytest.raises(ValueError, match=r"applies to a single-file --model only.* is a folder"):
        load_pipeline(folder, config=folder)
    with pytest.raises(ValueError, match=r"needs a single-file --model"):
        load_pipeline(None, config=folder)
    index = json.loads((folder / "model_index.json").read_text())
    (empty / "model_index.json").write_text(json.dumps({**index, "_class_name": "NoSuchPipeline"}))
    with pytest.raises(ValueError, match=r"names pipeline class 'NoSuchPipeline'"):
        load_pipeline(ckpt, config=empty)


def test_help_shows_a_single_file_example():
    for command in ("generate", "upscale", "decode", "encode", "analyze", "plan", "compare"):
        out = CliRunner().invoke(app, [command, "--help"]).output
        text = " ".join(out.replace("\u2502", " ").split())  # help text without rich's box borders
        assert "--config" in text and "--model sd15.safetensors --config sd15-folder" in text, command
