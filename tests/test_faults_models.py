"""Catalogue of broken model folders (issue 33), run in process: pipeline folders (the embedded model
saved with save_pretrained, then one part broken), --config folders, VAE and ControlNet folders.

Each case asserts the exit code (5: model problem, 2: a path that is not there), one `error:` line naming
the component and the file that is broken (not the pipeline folder alone, not the latents), no traceback,
no diffusers notice before it, and nothing left in the working folder. Faults that JSON and headers show
are refused before anything loads, for every command; those only loading shows, as the load fails.
"""

import json
import shutil

import numpy as np
import pytest
import torch
from faults_support import BAD_REQUEST, MODEL, refused
from faults_support import quiet_diffusers as _quiet  # noqa: F401 (a fixture, used by name below)
from PIL import Image
from safetensors.torch import save_file

pytestmark = pytest.mark.usefixtures("_quiet")


def _edit_json(path, **changes):
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


def _truncate(path, keep=3000):
    path.write_bytes(path.read_bytes()[:keep])


# fault: what it does to a copy of the pipeline folder
FAULTS = {
    "vae-json": lambda f: (f / "vae" / "config.json").write_text('{"_class_name": "AutoencoderKL",'),
    "vae-no-weights": lambda f: (f / "vae" / "diffusion_pytorch_model.safetensors").unlink(),
    "vae-truncated": lambda f: _truncate(f / "vae" / "diffusion_pytorch_model.safetensors"),
    "unet-missing": lambda f: shutil.rmtree(f / "unet"),
    "unet-config-list": lambda f: (f / "unet" / "config.json").write_text("[]"),
    "scheduler-json": lambda f: (f / "scheduler" / "scheduler_config.json").write_text("{oops"),
    "scheduler-empty": lambda f: (f / "scheduler" / "scheduler_config.json").unlink(),
    "index-list": lambda f: (f / "model_index.json").write_text("[1]"),
    "index-no-class": lambda f: _edit_json(f / "model_index.json", _class_name=None),
    # only loading shows these
    "index-unknown-class": lambda f: _edit_json(f / "model_index.json", _class_name="NoSuchPipeline"),
    "vae-mismatch": lambda f: _edit_json(f / "vae" / "config.json", block_out_channels=[64, 64, 64, 64]),
}
NEEDLES = {
    "vae-json": ["vae/config.json", "not valid JSON", "component 'vae' (AutoencoderKL)"],
    "vae-no-weights": ["component 'vae' (AutoencoderKL)", "no weights file"],
    "vae-truncated": ["vae/diffusion_pytorch_model.safetensors", "truncated or corrupt"],
    "unet-missing": ["component 'unet' (UNet2DConditionModel)", "/unet' is missing"],
    "unet-config-list": ["unet/config.json", "not a JSON object"],
    "scheduler-json": ["scheduler/scheduler_config.json", "not valid JSON"],
    "scheduler-empty": ["component 'scheduler' (DDIMScheduler)", "holds no config.json"],
    "index-list": ["model_index.json", "not a JSON object"],
    "index-no-class": ["model_index.json", "_class_name"],
    "index-unknown-class": ["cannot be loaded"],
    "vae-mismatch": ["component 'vae' (AutoencoderKL", "cannot be loaded", "size mismatch"],
}
LOADS = ("index-unknown-class", "vae-mismatch")


@pytest.fixture(scope="module")
def D(tmp_path_factory):
    """The embedded pipeline saved as a folder, one broken copy per fault, a ControlNet folder, inputs."""
    from tilewise.models import load_default_controlnet, load_default_pipeline

    d = tmp_path_factory.mktemp("model-folders")
    load_default_pipeline().save_pretrained(d / "sd")
    for fault, breaks in FAULTS.items():
        shutil.copytree(d / "sd", d / fault)
        breaks(d / fault)
    shutil.copytree(d / "sd" / "vae", d / "vae-folder")
    (d / "empty").mkdir()
    load_default_controlnet().save_pretrained(d / "cn")
    for name in ("cn-json", "cn-no-weights", "cn-truncated", "cn-not-a-controlnet"):
        shutil.copytree(d / "cn", d / name)
    (d / "cn-json" / "config.json").write_text("{")
    (d / "cn-no-weights" / "diffusion_pytorch_model.safetensors").unlink()
    _truncate(d / "cn-truncated" / "diffusion_pytorch_model.safetensors")
    _edit_json(d / "cn-not-a-controlnet" / "config.json", _class_name="AutoencoderKL")
    save_file({"latents": torch.randn(1, 4, 4, 4)}, str(d / "z.safetensors"))
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(d / "in.png")
    (d / "ckpt.safetensors").write_bytes((d / "z.safetensors").read_bytes())
    return d


def _argv(command, model, D):
    head = {"decode": ["decode", D / "z.safetensors", "--out", "o.png"],
            "encode": ["encode", D / "in.png", "--out", "z.safetensors"],
            "generate": ["generate", "--prompt", "grass", "--width", "64", "--height", "64", "--steps", "2",
                         "--out", "o.png"],
            "upscale": ["upscale", D / "in.png", "--out", "up.png", "--steps", "4"]}[command]
    return head + ["--model", model]


COMMANDS = ("decode", "encode", "generate", "upscale")
CASES = [(fault, command) for fault in sorted(FAULTS) for command in COMMANDS
         if fault not in LOADS or command in ("decode", "generate")]


@pytest.mark.parametrize("text", [
    # diffusers with accelerate (low_cpu_mem_usage), and torch's load_state_dict without it
    "Cannot load because decoder.conv_norm_out.bias expected shape torch.Size([64]), but got "
    "torch.Size([32]). If you want to instead overwrite randomly initialized weights, ...",
    "Error(s) in loading state_dict for AutoencoderKL:\n\tsize mismatch for decoder.conv_norm_out.bias: "
    "copying a param with shape torch.Size([32]) from checkpoint, the shape in current model is "
    "torch.Size([64]).",
])
def test_a_weight_of_the_wrong_shape_is_read_in_both_wordings(text):
    from tilewise.pipelines.folders import shape_mismatch

    assert shape_mismatch(RuntimeError(text)) == ("decoder.conv_norm_out.bias", "[64]", "[32]")
    assert shape_mismatch(RuntimeError("Cannot copy out of meta tensor")) is None


@pytest.mark.parametrize("fault,command", CASES, ids=[f"{c}-{f}" for f, c in CASES])
def test_broken_pipeline_folder(fault, command, D, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    line = refused(_argv(command, D / fault, D), MODEL, NEEDLES[fault], capsys, tmp_path, D)
    assert "latents" not in line.split("cannot be loaded")[0]  # the model is named, not the input


@pytest.mark.parametrize("command", ["decode", "generate"])
@pytest.mark.parametrize("fault", ["vae-json", "unet-missing", "index-list"])
def test_broken_config_folder_of_a_checkpoint(fault, command, D, tmp_path, monkeypatch, capsys):
    """--config FOLDER gives a single file its architecture: its JSON is checked the same way (its weights
    are not used, so a folder without them is fine)."""
    monkeypatch.chdir(tmp_path)
    argv = _argv(command, D / "ckpt.safetensors", D) + ["--config", D / fault]
    refused(argv, MODEL, NEEDLES[fault], capsys, tmp_path, D)


@pytest.mark.parametrize("argv,code,needles", [
    (["generate", "--prompt", "grass", "--out", "o.png", "--model", "{D}/vae-folder"], MODEL,
     ["vae-folder", "without model_index.json"]),
    (["decode", "{D}/z.safetensors", "--out", "o.png", "--model", "{D}/empty"], MODEL,
     ["empty", "without model_index.json"]),
    (["upscale", "{D}/in.png", "--out", "up.png", "--controlnet", "{D}/cn-json"], MODEL,
     ["cn-json/config.json", "not valid JSON"]),
    (["upscale", "{D}/in.png", "--out", "up.png", "--controlnet", "{D}/cn-no-weights"], MODEL,
     ["--controlnet", "cn-no-weights", "no weights file"]),
    (["upscale", "{D}/in.png", "--out", "up.png", "--controlnet", "{D}/cn-truncated"], MODEL,
     ["cn-truncated/diffusion_pytorch_model.safetensors", "truncated or corrupt"]),
    (["upscale", "{D}/in.png", "--out", "up.png", "--controlnet", "{D}/cn-not-a-controlnet"], MODEL,
     ["holds a AutoencoderKL", "not a diffusers ControlNet"]),
    (["upscale", "{D}/in.png", "--out", "up.png", "--controlnet", "{D}/empty"], MODEL,
     ["--controlnet", "no config.json"]),
    (["upscale", "{D}/in.png", "--out", "up.png", "--controlnet", "{D}/gone"], BAD_REQUEST,
     ["--controlnet", "gone' does not exist"]),
], ids=["generate-vae-folder", "decode-empty-folder", "controlnet-json", "controlnet-no-weights",
        "controlnet-truncated", "controlnet-not-a-controlnet", "controlnet-empty", "controlnet-missing"])
def test_other_model_folders(argv, code, needles, D, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    refused([str(a).replace("{D}", str(D)) for a in argv], code, needles, capsys, tmp_path, D)
