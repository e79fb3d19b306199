"""`tilewise decode` / `encode` with a VAE folder of each 2-D family beyond AutoencoderKL (saved with
save_pretrained from tests/vae_support.py's and video_vae_support.py's tiny seeded VAEs): the latents files
in the layout the family's stock pipeline hands its denoiser (README, "Latents files"), the decode equal to
the stock VAE's decode of the same latents, the encode to the stock encode (float32, max abs <= 1e-4),
in several tiles; a class no tile program reproduces refused by name with the reason, before anything
loads."""

import json

import faults_support
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from diffusers.pipelines.flux2.pipeline_flux2 import Flux2Pipeline  # noqa: E402
from PIL import Image  # noqa: E402
from safetensors import safe_open  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from typer.testing import CliRunner  # noqa: E402
from vae_support import family_vae, tiny_vae  # noqa: E402
from video_vae_support import qwen21  # noqa: E402

from tilewise.cli import app  # noqa: E402
from tilewise.errors import BadInputFile, ModelProblem  # noqa: E402

runner = CliRunner()
TOL = 1e-4
NAMES = ["flux2", "dc", "vq", "kvae", "hunyuan", "asym", "qwen21", "tiny"]


def _vae(name: str):
    """The family's tiny VAE with non-trivial latent normalisation: a scaling factor where its config has
    one (none has a shift), Flux.2's batch-norm running statistics; Qwen-Image 2.1's mean and std as
    built; VQModel's codebook spread like the latents."""
    builders = {"qwen21": qwen21, "tiny": tiny_vae}
    vae = builders[name]() if name in builders else family_vae(name)
    if name == "flux2":
        g = torch.Generator().manual_seed(3)
        vae.bn.running_mean.copy_(torch.randn(vae.bn.running_mean.shape, generator=g))
        vae.bn.running_var.copy_(torch.rand(vae.bn.running_var.shape, generator=g) + 0.5)
    elif name in ("dc", "vq", "asym", "hunyuan"):
        vae.register_to_config(scaling_factor=0.75)
    if name == "vq":  # (a codebook spread like the latents: the scale decides which entries are nearest)
        with torch.no_grad():
            emb = vae.quantize.embedding.weight
            emb.copy_(torch.randn(emb.shape, generator=torch.Generator().manual_seed(5)))
    return vae


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Each family's VAE saved as a VAE folder: name -> (folder, the VAE)."""
    root = tmp_path_factory.mktemp("vaes")
    out = {}
    for name in NAMES:
        vae = _vae(name)
        vae.save_pretrained(root / name)
        out[name] = (root / name, vae)
    return out


def _run(*args):
    result = runner.invoke(app, [str(a) for a in args], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.output


def _fails(capsys, *args, code: int) -> str:
    """The one error line of a command that fails (through the CLI's entry point), with its exit code."""
    got, errors, err = faults_support.run(list(args), capsys)
    assert got == code and len(errors) == 1, err
    return errors[0]


def _raw(name: str, vae, z):
    """The oracle: a latents file's tensor as the family's stock pipeline hands it to the VAE's decode."""
    if name == "flux2":  # Flux2Pipeline.__call__'s decode step
        mean = vae.bn.running_mean.view(1, -1, 1, 1)
        std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps)
        return Flux2Pipeline._unpatchify_latents(z * std + mean)
    if name == "qwen21":  # QwenImage21Pipeline.__call__'s
        mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
        std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)
        return z * std + mean
    return z / (vae.config.get("scaling_factor") or 1.0)  # SanaPipeline's, LDMPipeline's (VQ), ...


def _file(name: str, vae, raw):
    """The oracle: an encode's raw latent as the family's stock pipeline normalises it."""
    if name == "flux2":  # Flux2Pipeline._encode_vae_image
        mean = vae.bn.running_mean.view(1, -1, 1, 1)
        std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps)
        return (Flux2Pipeline._patchify_latents(raw) - mean) / std
    if name == "qwen21":  # QwenImage21Pipeline._encode_vae_image
        mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
        std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)
        return (raw - mean) / std
    return raw * (vae.config.get("scaling_factor") or 1.0)


def _stock_encode(vae, x):
    """The raw latent of the stock encode's own output class."""
    out = vae.encode(x)
    if hasattr(out, "latent_dist"):
        return out.latent_dist.mode()
    return out.latent if hasattr(out, "latent") else out.latents


def _tiles(text: str) -> int:
    rows, cols = text.split("tiles: ", 1)[1].split()[0].split("x")
    return int(rows) * int(cols)


@pytest.mark.parametrize("name", NAMES)
def test_decode_writes_the_stock_decode_of_the_pipeline_latents(folders, tmp_path, name):
    folder, vae = folders[name]
    c = next(vae.config[k] for k in ("latent_channels", "z_channels", "z_dim") if vae.config.get(k))
    c = 4 * c if name == "flux2" else c  # (its 2x2 patches)
    shape = {"flux2": (1, c, 3, 4), "qwen21": (1, c, 1, 5, 7)}.get(name, (1, c, 6, 8))
    z = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    save_file({"latents": z}, str(tmp_path / "z.safetensors"))
    text = _run("decode", tmp_path / "z.safetensors", "--model", folder, "--out", tmp_path / "x.npy",
                "--bits", 32, "--tile", 2, "--quiet")
    assert _tiles(text) > 1
    with torch.no_grad():
        want = vae.decode(_raw(name, vae, z)).sample  # (VQModel: quantised, as its decode's default)
    want = want[:, :, 0] if name == "qwen21" else want
    got = np.load(tmp_path / "x.npy")  # (H, W, C) float32: the decode as it is, unclamped
    assert got.shape == tuple(want[0].permute(1, 2, 0).shape)
    assert np.abs(got - want[0].permute(1, 2, 0).numpy()).max() <= TOL


@pytest.mark.parametrize("name", NAMES)
def test_encode_writes_the_pipeline_latents_of_the_stock_encode(folders, tmp_path, name):
    folder, vae = folders[name]
    f = {"flux2": 4, "hunyuan": 4, "qwen21": 4, "tiny": 8}.get(name, 2)  # (Flux.2: 2 x its 2x2 patches)
    channels = 4 if name == "qwen21" else 3  # (Qwen-Image 2.1 encodes RGBA)
    rng = np.random.default_rng(2)
    pixels = rng.integers(0, 256, (6 * f, 8 * f, channels), dtype=np.uint8)
    Image.fromarray(pixels).save(tmp_path / "in.png")
    text = _run("encode", tmp_path / "in.png", "--model", folder, "--out", tmp_path / "z.safetensors",
                "--tile", 2, "--quiet")
    assert _tiles(text) > 1
    x = torch.from_numpy(pixels).permute(2, 0, 1)[None].float() / 127.5 - 1
    x = x.unsqueeze(2) if name == "qwen21" else x
    with torch.no_grad():
        want = _file(name, vae, _stock_encode(vae, x))
    got = load_file(str(tmp_path / "z.safetensors"))["latents"]
    assert got.shape == want.shape and (got - want).abs().max() <= TOL
    with safe_open(str(tmp_path / "z.safetensors"), "pt") as f:
        assert f.metadata()["vae"] == type(vae).__name__


def test_decode_of_the_encoded_file_through_a_pipeline_folder_loads_only_its_vae(folders, tmp_path):
    """A pipeline folder whose vae/ is a DC-AE (its model_index lists the vae alone: only vae/ is read)."""
    folder, vae = folders["dc"]
    pipe = tmp_path / "sana"
    (pipe / "vae").mkdir(parents=True)
    vae.save_pretrained(pipe / "vae")
    (pipe / "model_index.json").write_text(json.dumps({"_class_name": "SanaPipeline",
                                                       "vae": ["diffusers", "AutoencoderDC"]}))
    z = torch.randn(1, 8, 6, 8, generator=torch.Generator().manual_seed(4))
    save_file({"latents": z}, str(tmp_path / "z.safetensors"))
    for model in (pipe, folder):
        _run("decode", tmp_path / "z.safetensors", "--model", model, "--out", tmp_path / f"{model.name}.npy",
             "--bits", 32, "--tile", 2, "--quiet")
    assert np.array_equal(np.load(tmp_path / "sana.npy"), np.load(tmp_path / "dc.npy"))


def test_latents_files_of_another_layout_are_refused_naming_the_shape(folders, tmp_path, capsys):
    save_file({"latents": torch.randn(1, 8, 6, 8)}, str(tmp_path / "z.safetensors"))  # (not patchified)
    err = _fails(capsys, "decode", tmp_path / "z.safetensors", "--model", folders["flux2"][0], "--out",
                 tmp_path / "x.png", code=BadInputFile.exit_code)
    assert "has 8 channels (shape [1, 8, 6, 8])" in err and "32-channel" in err
    save_file({"latents": torch.randn(1, 4, 2, 5, 7)}, str(tmp_path / "t.safetensors"))
    err = _fails(capsys, "decode", tmp_path / "t.safetensors", "--model", folders["qwen21"][0], "--out",
                 tmp_path / "x.png", code=BadInputFile.exit_code)
    assert "(1, C, 1, h, w) (T must be 1)" in err and not (tmp_path / "x.png").exists()
    Image.fromarray(np.zeros((8, 10, 3), np.uint8)).save(tmp_path / "in.png")  # (Flux.2 here: sides of 4 k)
    err = _fails(capsys, "encode", tmp_path / "in.png", "--model", folders["flux2"][0], "--out",
                 tmp_path / "z2.safetensors", code=BadInputFile.exit_code)
    assert "is 10x8; both sides must be multiples of 4" in err and not (tmp_path / "z2.safetensors").exists()


def _refused_folders(root):
    """A tiny ConsistencyDecoderVAE and a tiny audio VAE (AutoencoderOobleck), saved with save_pretrained."""
    import diffusers as d

    torch.manual_seed(0)
    two = ("DownEncoderBlock2D",) * 2
    d.ConsistencyDecoderVAE(
        encoder_block_out_channels=(16, 32), encoder_down_block_types=two, encoder_layers_per_block=1,
        encoder_norm_num_groups=8, decoder_block_out_channels=(16, 32), decoder_layers_per_block=1,
        decoder_down_block_types=("ResnetDownsampleBlock2D",) * 2, decoder_norm_num_groups=8,
        decoder_up_block_types=("ResnetUpsampleBlock2D",) * 2).save_pretrained(root / "consistency")
    d.AutoencoderOobleck(encoder_hidden_size=8, downsampling_ratios=[2, 2], channel_multiples=[1, 2],
                         decoder_channels=8, decoder_input_channels=4).save_pretrained(root / "audio")
    return {"ConsistencyDecoderVAE": root / "consistency", "AutoencoderOobleck": root / "audio"}


def test_a_class_no_tile_program_reproduces_is_refused_by_name_with_the_reason(tmp_path, capsys):
    from tilewise.locality.classes import REFUSED

    save_file({"latents": torch.randn(1, 4, 6, 8)}, str(tmp_path / "z.safetensors"))
    Image.fromarray(np.zeros((16, 16, 3), np.uint8)).save(tmp_path / "in.png")
    for name, folder in _refused_folders(tmp_path).items():
        for args in (("decode", tmp_path / "z.safetensors"), ("encode", tmp_path / "in.png")):
            out = tmp_path / ("out.png" if args[0] == "decode" else "out.safetensors")
            err = _fails(capsys, *args, "--model", folder, "--out", out, code=ModelProblem.exit_code)
            assert f"holds a {name}, which tilewise does not tile: {REFUSED[name]}" in err
    assert not any(p.name.startswith("out") for p in tmp_path.iterdir())


def test_a_class_tiled_from_python_only_is_refused_saying_so(tmp_path, capsys, monkeypatch):
    """Every class of PYTHON_ONLY is one TiledVAE tiles; a folder of such a class (here one put in the table
    for the test besides VidTok, the one the CLI does not take yet) is refused from its config.json,
    saying what is missing, before anything loads."""
    from tilewise.locality.classes import PYTHON_ONLY
    from tilewise.vae.families import FAMILIES

    assert all(name in FAMILIES and not FAMILIES[name].refused for name in PYTHON_ONLY)
    monkeypatch.setitem(PYTHON_ONLY, "AutoencoderKLExample", "its latents are not tried through the CLI yet")
    save_file({"latents": torch.randn(1, 4, 2, 6, 8)}, str(tmp_path / "z.safetensors"))
    for name, why in PYTHON_ONLY.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps({"_class_name": name}))
        err = _fails(capsys, "decode", tmp_path / "z.safetensors", "--model", tmp_path / name, "--out",
                     tmp_path / "out.mp4", code=ModelProblem.exit_code)
        assert (f"holds a {name}: tilewise tiles it from Python (tw.TiledVAE), but `decode` / "
                f"`encode --model` do not take it yet ({why})") in err
    assert not (tmp_path / "out.mp4").exists()


def test_qwen_image_21_decodes_to_an_rgba_png_within_one_level(folders, tmp_path):
    folder, vae = folders["qwen21"]
    z = torch.randn(1, 4, 1, 5, 7, generator=torch.Generator().manual_seed(6))
    save_file({"latents": z[0]}, str(tmp_path / "z.safetensors"))  # (one image's (C, 1, h, w))
    _run("decode", tmp_path / "z.safetensors", "--model", folder, "--out", tmp_path / "x.png", "--tile", 2,
         "--quiet")
    with torch.no_grad():
        want = vae.decode(_raw("qwen21", vae, z)).sample[0, :, 0]
    want = ((want.clamp(-1, 1) + 1) * 127.5).permute(1, 2, 0).numpy()
    with Image.open(tmp_path / "x.png") as im:
        assert im.mode == "RGBA"
        got = np.asarray(im).astype(np.float32)
    assert got.shape == want.shape == (20, 28, 4) and np.abs(got - want).max() <= 0.5 + 1e-3  # (rounding)


def test_the_classes_the_cli_reads_agree_with_the_family_table():
    from tilewise.locality.classes import IMAGE_VAES, REFUSED
    from tilewise.vae.families import FAMILIES

    assert all(name in FAMILIES and not FAMILIES[name].refused and not FAMILIES[name].video
               for name in IMAGE_VAES)
    assert {n for n, f in FAMILIES.items() if f.refused} == set(REFUSED)
    assert all(FAMILIES[name].refused == why for name, why in REFUSED.items())


@pytest.mark.slow
@pytest.mark.parametrize("name", ["flux2", "qwen21"])
def test_decode_and_encode_on_two_ranks_equal_the_stock_vae(folders, tmp_path, name):
    """--nproc 2 (torchrun, gloo): each rank its band of tile rows, rank 0 converts and writes."""
    import os
    import subprocess
    import sys

    if not (torch.distributed.is_available() and torch.distributed.is_gloo_available()):
        pytest.skip("torch.distributed with gloo is needed")
    folder, vae = folders[name]
    z = torch.randn((1, 32, 4, 4) if name == "flux2" else (1, 4, 1, 8, 6),
                    generator=torch.Generator().manual_seed(7))
    save_file({"latents": z}, str(tmp_path / "z.safetensors"))
    pixels = np.random.default_rng(8).integers(0, 256, (32, 24, 4 if name == "qwen21" else 3), dtype=np.uint8)
    Image.fromarray(pixels).save(tmp_path / "in.png")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for args in (("decode", "z.safetensors", "--out", "x.npy", "--bits", "32"),
                 ("encode", "in.png", "--out", "e.safetensors")):
        argv = [sys.executable, "-m", "tilewise.cli", *args, "--model", str(folder), "--tile", "2", "--nproc",
                "2", "-q"]
        run = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
        assert run.returncode == 0 and "launching 2 ranks" in run.stderr, run.stderr[-3000:]
    x = torch.from_numpy(pixels).permute(2, 0, 1)[None].float() / 127.5 - 1
    with torch.no_grad():
        want = vae.decode(_raw(name, vae, z)).sample
        enc = _file(name, vae, _stock_encode(vae, x.unsqueeze(2) if name == "qwen21" else x))
    want = (want[:, :, 0] if name == "qwen21" else want)[0].permute(1, 2, 0).numpy()
    assert np.abs(np.load(tmp_path / "x.npy") - want).max() <= TOL
    assert (load_file(str(tmp_path / "e.safetensors"))["latents"] - enc).abs().max() <= TOL


def _pipeline_folder(root, index: dict, parts: dict):
    """A pipeline folder: model_index.json listing `index` ({component: class}) and each part saved."""
    root.mkdir(parents=True)
    (root / "model_index.json").write_text(json.dumps(
        {"_class_name": index.pop("_class_name"), **{k: ["diffusers", v] for k, v in index.items()}}))
    for name, vae in parts.items():
        vae.save_pretrained(root / name)
    return root


@pytest.mark.parametrize("pipeline, part, name", [("KandinskyV22Pipeline", "movq", "vq"),
                                                  ("LDMTextToImagePipeline", "vqvae", "kl")])
def test_a_pipeline_folder_whose_vae_is_another_component_round_trips_equal_to_stock(
        folders, tmp_path, pipeline, part, name):
    """Kandinsky keeps its VQModel as movq/, LDM its VAE as vqvae/ (an AutoencoderKL for the text-to-image
    pipeline): decode / encode --model <pipeline folder> find it by its class and load it alone."""
    from vae_support import kl_vae

    vae = folders["vq"][1] if name == "vq" else kl_vae("sdxl")
    f = 2 if name == "vq" else 4
    cls = type(vae).__name__
    pipe = _pipeline_folder(tmp_path / "pipe", {"_class_name": pipeline, part: cls, "scheduler": None},
                            {part: vae})
    pixels = np.random.default_rng(7).integers(0, 256, (6 * f, 8 * f, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(tmp_path / "in.png")
    _run("encode", tmp_path / "in.png", "--model", pipe, "--out", tmp_path / "z.safetensors", "--tile", 2,
         "--quiet")
    _run("decode", tmp_path / "z.safetensors", "--model", pipe, "--out", tmp_path / "x.npy", "--bits", 32,
         "--tile", 2, "--quiet")
    x = torch.from_numpy(pixels).permute(2, 0, 1)[None].float() / 127.5 - 1
    with torch.no_grad():
        want_z = _file(name, vae, _stock_encode(vae, x))
        got_z = load_file(str(tmp_path / "z.safetensors"))["latents"]
        want_x = vae.decode(_raw(name, vae, got_z)).sample[0].permute(1, 2, 0).numpy()
    got_x = np.load(tmp_path / "x.npy")
    assert got_z.shape == want_z.shape and got_x.shape == want_x.shape
    print(f"{part}/ {cls}: encode max abs {float((got_z - want_z).abs().max()):.2e}, decode "
          f"{float(np.abs(got_x - want_x).max()):.2e}")
    assert (got_z - want_z).abs().max() <= TOL and np.abs(got_x - want_x).max() <= TOL


def test_a_pipeline_folder_with_two_vae_components_and_no_vae_is_refused_naming_them(folders, tmp_path,
                                                                                     capsys):
    vq = folders["vq"][1]
    pipe = _pipeline_folder(tmp_path / "pipe", {"_class_name": "Odd", "movq": "VQModel", "vqvae": "VQModel"},
                            {"movq": vq, "vqvae": vq})
    save_file({"latents": torch.randn(1, 4, 6, 8)}, str(tmp_path / "z.safetensors"))
    Image.fromarray(np.zeros((16, 16, 3), np.uint8)).save(tmp_path / "in.png")
    for args in (("decode", tmp_path / "z.safetensors"), ("encode", tmp_path / "in.png")):
        out = tmp_path / ("out.png" if args[0] == "decode" else "out.safetensors")
        err = _fails(capsys, *args, "--model", pipe, "--out", out, code=ModelProblem.exit_code)
        assert "has no 'vae' component but 2 VAE components ('movq' (VQModel), 'vqvae' (VQModel))" in err
        assert str(pipe / "movq") in err
    assert not any(p.name.startswith("out") for p in tmp_path.iterdir())
