"""`tilewise decode` / `encode` with the 3-D causal VAEs: a saved Qwen-Image pipeline folder and a saved Wan
VAE folder as --model, images and videos (frame sequences, .npy and TIFF stacks), equal to the untiled VAE."""

import copy
import re

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from PIL import Image  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from typer.testing import CliRunner  # noqa: E402
from video_vae_support import video_vae  # noqa: E402

from tilewise.cli import app  # noqa: E402
from tilewise.pipelines import load_video  # noqa: E402

runner = CliRunner()
MEAN, STD = [0.5, -0.25, 0.0, 1.0], [2.0, 0.5, 1.0, 1.5]  # the Wan folder's latent normalisation


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A tiny QwenImagePipeline saved with save_pretrained, and a Wan 2.1 VAE folder whose latents are
    normalised with a non-trivial mean and std."""
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImagePipeline, QwenImageTransformer2DModel

    root = tmp_path_factory.mktemp("models")
    torch.manual_seed(0)
    transformer = QwenImageTransformer2DModel(in_channels=16, out_channels=4, num_layers=1,
                                              attention_head_dim=8, num_attention_heads=2,
                                              joint_attention_dim=16, axes_dims_rope=(2, 2, 4)).eval()
    QwenImagePipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=video_vae("qwen"), text_encoder=None,
                      tokenizer=None, transformer=transformer).save_pretrained(root / "qwen")
    wan = copy.deepcopy(video_vae("wan2.1"))
    wan.register_to_config(latents_mean=MEAN, latents_std=STD)
    wan.save_pretrained(root / "wan-vae")
    return {"qwen": root / "qwen", "wan": root / "wan-vae", "wan_vae": wan}


def _run(*args):
    result = runner.invoke(app, [str(a) for a in args], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.output


def _norm(shape=(1, 4, 1, 1, 1)):
    return torch.tensor(MEAN).view(shape), torch.tensor(STD).view(shape)


def test_qwen_image_pipeline_folder_encodes_and_decodes_an_image(folders, tmp_path):
    """encode a PNG, then decode its latents, through the pipeline folder (only its vae/ is loaded)."""
    vae = video_vae("qwen")
    pixels = np.random.default_rng(0).integers(0, 256, (24, 40, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(tmp_path / "in.png")
    out = _run("encode", tmp_path / "in.png", "--model", folders["qwen"], "--out", tmp_path / "z.safetensors",
               "--tile", 2, "--quiet")
    assert "3-D causal VAE" in out and "tiles: 2x3" in out
    x = torch.from_numpy(pixels).permute(2, 0, 1)[None, :, None].float() / 127.5 - 1
    got = load_file(str(tmp_path / "z.safetensors"))["latents"]
    with torch.no_grad():
        ref = vae.encode(x).latent_dist.mean
        assert got.shape == ref.shape == (1, 4, 1, 3, 5) and (got - ref).abs().max() <= 1e-4
        want = vae.decode(got).sample[0, :, 0]
    _run("decode", tmp_path / "z.safetensors", "--model", folders["qwen"], "--out", tmp_path / "out.png",
         "--tile", 2, "--quiet")
    with Image.open(tmp_path / "out.png") as im:
        image = np.asarray(im).astype(int)
    want = ((want.clamp(-1, 1) + 1) * 127.5).round().permute(1, 2, 0).numpy().astype(int)
    assert image.shape == (24, 40, 3) and np.abs(image - want).max() <= 1  # a rounding tie may flip


@pytest.fixture(scope="module")
def wan_video(folders):
    """Normalised latents of 2 frames (5 video frames) and the untiled decode of the raw latents."""
    z = torch.randn(1, 4, 2, 3, 4, generator=torch.Generator().manual_seed(1))
    mean, std = _norm()
    with torch.no_grad():
        ref = folders["wan_vae"].decode(z * std + mean).sample[0]  # (C, T, H, W)
    return z, ref


@pytest.mark.parametrize("out,bits", [("f{:02d}.png", 8), ("v.npy", 32), ("v.tif", 16)])
def test_wan_vae_folder_decodes_a_video_into_each_sink(folders, wan_video, tmp_path, out, bits):
    z, ref = wan_video
    save_file({"latents": z[0]}, str(tmp_path / "z.safetensors"))  # one video's (C, T, H, W)
    text = _run("decode", tmp_path / "z.safetensors", "--model", folders["wan"], "--out", tmp_path / out,
                "--tile", 2, "--bits", bits, "--quiet")
    assert "causal steps: 2" in text
    if not out.endswith(".npy"):  # frames in order: the frame-major run (a .npy takes any order)
        assert "order=frames" in text
    got = load_video(tmp_path / out, 8)[0]  # (C, T, H, W) in [-1, 1]
    c, t, h, w = ref.shape
    assert got.shape == (c, t, h, w) == (3, 5, 24, 32)
    step = {8: 1 / 127.5, 16: 1 / 32767.5, 32: 0}[bits]  # one quantisation level (a rounding tie)
    assert (got - ref.clamp(-1, 1)).abs().max() <= step + 1e-4
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["z.safetensors"] + ([out.format(i) for i in range(5)] if "{" in out else [out]))


def test_wan_vae_folder_decodes_with_disk_staging(folders, wan_video, tmp_path):
    # (a 3-D VAE's staged values in files: the plan says so, the decode is the untiled one)
    z, ref = wan_video
    save_file({"latents": z[0]}, str(tmp_path / "z.safetensors"))
    text = _run("decode", tmp_path / "z.safetensors", "--model", folders["wan"], "--out", tmp_path / "v.npy",
                "--tile", 2, "--bits", 32, "--staging", "disk", "--quiet")
    assert "staging=disk" in text and "in disk files" in text
    got = load_video(tmp_path / "v.npy", 8)[0]
    assert (got - ref.clamp(-1, 1)).abs().max() <= 1e-4


def test_wan_vae_folder_encodes_a_video_stack_to_normalised_latents(folders, tmp_path):
    """A float (T, H, W, C) .npy of 7 frames: Wan encodes 1 + 4 k of them (5), as its encode does."""
    vae = folders["wan_vae"]
    video = np.random.default_rng(2).uniform(-1, 1, (7, 16, 24, 3)).astype(np.float32)
    np.save(tmp_path / "v.npy", video)
    out = _run("encode", tmp_path / "v.npy", "--model", folders["wan"], "--out", tmp_path / "z.safetensors",
               "--tile", 2, "--quiet")
    assert "the last 2 input frames are not encoded" in out
    mean, std = _norm()
    with torch.no_grad():
        raw = vae.encode(torch.from_numpy(video).permute(3, 0, 1, 2)[None]).latent_dist.mean
    got = load_file(str(tmp_path / "z.safetensors"))["latents"]
    assert got.shape == (1, 4, 2, 2, 3) and (got - (raw - mean) / std).abs().max() <= 1e-4


# (name, frames, pixels): LTX-Video 0.9.0 (8x, 4x), LTX-2 (16x, 8x), the HunyuanImage refiner (16x)
@pytest.mark.parametrize("name,frames,px", [("ltx0.9.0", 5, 16), ("ltx2", 9, 32), ("refiner", 5, 32),
                                            ("hunyuan", 5, 24), ("mochi", 7, 16)])
def test_vae_folder_encode_normalises_with_its_buffers_and_scaling_factor(tmp_path, name, frames, px):
    """LTX-Video and LTX-2 keep latents_mean / latents_std as buffers (saved with the weights) beside a
    config scaling_factor; the HunyuanImage refiner and HunyuanVideo have a scaling_factor only, Mochi
    config lists beside it: encode writes (z - mean) * scaling_factor / std, which decode reads back."""
    vae = copy.deepcopy(video_vae(name))
    buffers = "latents_mean" in dict(vae.named_buffers(recurse=False))
    if buffers:
        with torch.no_grad():
            vae.latents_mean.copy_(torch.tensor(MEAN))
            vae.latents_std.copy_(torch.tensor(STD))
    lists = not buffers and vae.config.get("latents_mean") is not None  # (Mochi: config lists, as Wan)
    if lists:
        vae.register_to_config(latents_mean=MEAN, latents_std=STD)
    vae.register_to_config(scaling_factor=0.5)
    vae.save_pretrained(tmp_path / "vae")
    video = np.random.default_rng(4).uniform(-1, 1, (frames, px, px, 3)).astype(np.float32)
    np.save(tmp_path / "v.npy", video)
    _run("encode", tmp_path / "v.npy", "--model", tmp_path / "vae", "--out", tmp_path / "z.safetensors",
         "--tile", 1, "--quiet")
    mean, std = _norm() if buffers or lists else (torch.zeros(()), torch.ones(()))
    with torch.no_grad():
        raw = vae.encode(torch.from_numpy(video).permute(3, 0, 1, 2)[None]).latent_dist.mean
    got = load_file(str(tmp_path / "z.safetensors"))["latents"]
    assert got.shape == raw.shape and (got - (raw - mean) * 0.5 / std).abs().max() <= 1e-4
    _run("decode", tmp_path / "z.safetensors", "--model", tmp_path / "vae", "--out", tmp_path / "v2.npy",
         "--tile", 1, "--bits", 32, "--quiet")
    with torch.no_grad():
        ref = vae.decode(raw).sample[0].permute(1, 2, 3, 0).numpy()  # (T, H, W, C), as the .npy holds
    back = np.load(tmp_path / "v2.npy")
    assert back.shape == ref.shape and np.abs(back - ref).max() <= 1e-4


def test_a_2d_vae_folder_decodes_as_its_pipeline_would(tmp_path):
    """--model may be a VAE folder of an AutoencoderKL too (loaded alone, no UNet or text encoder)."""
    from diffusers import AutoencoderKL
    from tiny_sd import vae_config

    torch.manual_seed(0)
    vae = AutoencoderKL(**vae_config()).eval()
    vae.save_pretrained(tmp_path / "sd-vae")
    z = torch.randn(1, 4, 5, 6, generator=torch.Generator().manual_seed(5))
    save_file({"latents": z * vae.config.scaling_factor}, str(tmp_path / "z.safetensors"))
    _run("decode", tmp_path / "z.safetensors", "--model", tmp_path / "sd-vae", "--out", tmp_path / "x.npy",
         "--bits", 32, "--tile", 2, "--quiet")
    with torch.no_grad():
        ref = vae.decode(z).sample[0].permute(1, 2, 0).numpy()
    got = np.load(tmp_path / "x.npy")
    assert got.shape == ref.shape == (40, 48, 3) and np.abs(got - ref).max() <= 1e-4


def test_frame_patterns_and_tiff_stacks_read_back_as_videos(tmp_path):
    import tifffile

    frames = np.random.default_rng(3).integers(0, 256, (3, 8, 16, 3), dtype=np.uint8)
    for i, f in enumerate(frames):
        Image.fromarray(f).save(tmp_path / f"f{i}.png")
    tifffile.imwrite(tmp_path / "v.tif", frames, photometric="rgb")
    want = torch.from_numpy(frames).permute(3, 0, 1, 2)[None].float() / 127.5 - 1
    for path in ("f{}.png", "v.tif"):
        assert torch.equal(load_video(tmp_path / path, 8), want)
    assert load_video(tmp_path / "f0.png", 8).shape == (1, 3, 1, 8, 16)  # an image is one frame
    with pytest.raises(ValueError, match="multiples of 16.*crop to 16x16"):
        load_video(tmp_path / "v.tif", 16)
    with pytest.raises(ValueError, match="first frame .*g0.png.* does not exist"):
        load_video(tmp_path / "g{}.png", 8)


@pytest.mark.parametrize("args,needle", [
    (["decode", "z.safetensors", "--out", "v.png"], "makes 5 frames: write them to a frame pattern"),
    (["decode", "z.safetensors", "--out", "f{:02d}.png", "--bits", 32], "--bits 32 with --out 'f{:02d}.png'"),
    (["decode", "bad.safetensors", "--out", "v.npy"], r"3 channels \(shape \[1, 3, 2, 3, 4\]\).*4-channel"),
    (["encode", "in.png", "--out", "z.safetensors"], "multiples of 8"),
    (["decode", "z.safetensors", "--out", "nowhere/f{:02d}.png"], "folder 'nowhere' does not exist"),
    (["decode", "z.safetensors", "--out", "in.png", "--no-clobber"], "'in.png' exists and replacing it was"),
    (["decode", "z.safetensors", "--out", "v.mp4"], "suffix '.mp4' is not one this command writes"),
    (["encode", "g{:02d}.png", "--out", "z2.safetensors"],
     r"no frames match 'g\{:02d\}.png': its first frame 'g00.png' does not exist"),
])
def test_bad_input_is_refused_naming_the_value_before_any_work(folders, tmp_path, monkeypatch, args, needle):
    monkeypatch.chdir(tmp_path)
    save_file({"latents": torch.zeros(1, 4, 2, 3, 4)}, "z.safetensors")
    save_file({"latents": torch.zeros(1, 3, 2, 3, 4)}, "bad.safetensors")
    Image.fromarray(np.zeros((12, 16, 3), dtype=np.uint8)).save("in.png")
    before = set(tmp_path.iterdir())
    result = runner.invoke(app, [str(a) for a in args] + ["--model", str(folders["wan"]), "--quiet"])
    assert isinstance(result.exception, ValueError), f"{args}: {result.exception!r}"
    assert re.search(needle, str(result.exception)), str(result.exception)
    assert set(tmp_path.iterdir()) == before, "no output may be left behind"
