"""`tilewise decode` / `encode --model` with the video VAEs whose pipelines lay their latents out their own
way (`pipelines.video_latents`): a tiny SVD temporal decoder, a tiny Cosmos VAE, and tiny HunyuanVideo 1.5,
Magvit and CogVideoX VAEs saved with save_pretrained; decode and encode equal the stock VAE's decode /
encode of the same latents (fp32, <= 1e-4), SVD's in calls of --decode-chunk-size frames as its pipeline's
decode_latents, Cosmos' scaled per channel and frame and by its scheduler's sigma_data, the other three by
scaling_factor alone as their pipelines' decode steps; bad input refused naming the value, with its exit
code. KVAE video's raw latents (no scaling: no pipeline uses it yet) and Kandinsky 6 SR's (z * scaling_factor,
its pixels / 128 - 1 as Kandinsky6SRPipeline's) go through the other video VAEs' route; Allegro's
(z * scaling_factor, as AllegroPipeline's decode_latents) against the one pass its own tiling approximates.
"""

import copy
import json

import faults_support
import numpy as np
import pytest
from PIL import Image

torch = pytest.importorskip("torch")

from safetensors import safe_open  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from typer.testing import CliRunner  # noqa: E402
from video_vae_support import allegro, cogvideox_vae, kandinsky6_sr, kvae_video, magvit, video_vae  # noqa: E402

from tilewise.cli import app  # noqa: E402
from tilewise.errors import BadInputFile, BadRequest, ModelProblem  # noqa: E402
from tilewise.vae.video_allegro import allegro_decode, allegro_encode  # noqa: E402

runner = CliRunner()
TOL = 1e-4
SF = 0.5  # the SVD folder's scaling_factor
# the Cosmos folder's latents_mean / latents_std: 4 channels x 3 latent frames, viewed (1, 4, 3, 1, 1)
MEAN = [0.1 * i - 0.5 for i in range(12)]
STD = [0.5 + 0.1 * i for i in range(12)]


def _run(*args):
    result = runner.invoke(app, [str(a) for a in args], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.output


def _fails(capsys, *args, code: int) -> str:
    """The one error line of a command that fails (through the CLI's entry point), with its exit code."""
    got, errors, err = faults_support.run(list(args), capsys)
    assert got == code and len(errors) == 1, err
    return errors[0]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """The SVD VAE of tests/test_svd_vae.py (scaling_factor 0.5) and the Cosmos VAE of the video tests (its
    latents normalised per channel and frame), each saved as a VAE folder."""
    from test_svd_vae import VAE

    root = tmp_path_factory.mktemp("models")
    svd = copy.deepcopy(VAE)
    svd.register_to_config(scaling_factor=SF)
    svd.save_pretrained(root / "svd")
    cosmos = copy.deepcopy(video_vae("cosmos"))
    cosmos.register_to_config(latents_mean=MEAN, latents_std=STD)
    cosmos.save_pretrained(root / "cosmos")
    return {"svd": root / "svd", "cosmos": root / "cosmos", "svd_vae": svd, "cosmos_vae": cosmos}


def _svd_decode(vae, raw, chunk: int):
    """StableVideoDiffusionPipeline.decode_latents of raw (1, C, T, h, w) latents, unscaled: calls of
    `chunk` frames, each decode(rows, num_frames=its frames); (T, H, W, C) as the .npy holds it."""
    rows = raw.permute(0, 2, 1, 3, 4).flatten(0, 1)
    with torch.no_grad():
        frames = [vae.decode(rows[a : a + chunk], num_frames=len(rows[a : a + chunk])).sample
                  for a in range(0, len(rows), chunk)]
    return torch.cat(frames).permute(0, 2, 3, 1).numpy()


@pytest.mark.parametrize("chunk", [None, 2])
def test_svd_folder_decodes_in_calls_of_decode_chunk_size(folders, tmp_path, chunk):
    """3 latent frames, 2x3 tiles: in one call (the pipeline's default) or in calls of 2 and 1 frames."""
    vae = folders["svd_vae"]
    raw = torch.randn(1, 4, 3, 5, 7, generator=torch.Generator().manual_seed(1))
    save_file({"latents": raw * SF}, str(tmp_path / "z.safetensors"))
    args = ["--decode-chunk-size", chunk] if chunk else []
    text = _run("decode", tmp_path / "z.safetensors", "--model", folders["svd"], "--out", tmp_path / "v.npy",
                "--bits", 32, "--tile", 3, "--quiet", *args)
    assert "tiles: 2x3" in text
    got, want = np.load(tmp_path / "v.npy"), _svd_decode(vae, raw, chunk or 3)
    assert got.shape == want.shape == (3, 10, 14, 3) and np.abs(got - want).max() <= TOL
    other = _svd_decode(vae, raw, 3 if chunk else 2)  # (the chunking is part of the result: frames mix)
    assert np.abs(other - want).max() > 1e-3


def test_svd_folder_encodes_each_frame_and_decodes_the_file_back(folders, tmp_path):
    vae = folders["svd_vae"]
    video = np.random.default_rng(2).uniform(-1, 1, (3, 10, 14, 3)).astype(np.float32)
    np.save(tmp_path / "v.npy", video)
    _run("encode", tmp_path / "v.npy", "--model", folders["svd"], "--out", tmp_path / "z.safetensors",
         "--tile", 3, "--quiet")
    with torch.no_grad():
        mean = vae.encode(torch.from_numpy(video).permute(0, 3, 1, 2)).latent_dist.mean  # (each frame)
    want = mean.permute(1, 0, 2, 3)[None] * SF  # (1, C, T, h, w)
    got = load_file(str(tmp_path / "z.safetensors"))["latents"]
    assert got.shape == want.shape == (1, 4, 3, 5, 7) and (got - want).abs().max() <= TOL
    with safe_open(str(tmp_path / "z.safetensors"), "pt") as f:
        assert f.metadata()["normalised"] == "z * scaling_factor"
    _run("decode", tmp_path / "z.safetensors", "--model", folders["svd"], "--out", tmp_path / "back.npy",
         "--bits", 32, "--tile", 3, "--quiet")
    back = np.load(tmp_path / "back.npy")
    assert np.abs(back - _svd_decode(vae, got / SF, 3)).max() <= TOL


def _cosmos_norm(frames: int):
    shape = (1, 4, -1, 1, 1)
    return torch.tensor(MEAN).view(shape)[:, :, :frames], torch.tensor(STD).view(shape)[:, :, :frames]


def test_cosmos_folder_encodes_and_decodes_with_latents_mean_std_and_sigma_data(folders, tmp_path):
    """9 frames of 24x16 (2 latent frames, 3x2 latent px; tiles of 1 latent px): the file holds
    (raw - mean) * sigma_data / std per channel and frame (sigma_data 0.5, recorded), as
    CosmosVideoToWorldPipeline's encode; its decode is the pipeline's z * std / sigma_data + mean."""
    vae = folders["cosmos_vae"]
    video = np.random.default_rng(3).uniform(-1, 1, (9, 24, 16, 3)).astype(np.float32)
    np.save(tmp_path / "v.npy", video)
    _run("encode", tmp_path / "v.npy", "--model", folders["cosmos"], "--out", tmp_path / "z.safetensors",
         "--tile", 1, "--quiet")
    with torch.no_grad():
        raw = vae.encode(torch.from_numpy(video).permute(3, 0, 1, 2)[None]).latent_dist.mode()
    mean, std = _cosmos_norm(2)
    got = load_file(str(tmp_path / "z.safetensors"))["latents"]
    assert got.shape == raw.shape == (1, 4, 2, 3, 2)
    assert (got - (raw - mean) * 0.5 / std).abs().max() <= TOL
    with safe_open(str(tmp_path / "z.safetensors"), "pt") as f:
        assert f.metadata()["sigma_data"] == "0.5"
    _run("decode", tmp_path / "z.safetensors", "--model", folders["cosmos"], "--out", tmp_path / "back.npy",
         "--bits", 32, "--tile", 1, "--quiet")
    with torch.no_grad():
        ref = vae.decode(got * std / 0.5 + mean).sample[0].permute(1, 2, 3, 0).numpy()
    back = np.load(tmp_path / "back.npy")
    assert back.shape == ref.shape == (9, 24, 16, 3) and np.abs(back - ref).max() <= TOL


def test_a_cosmos_pipeline_folder_gives_its_schedulers_sigma_data(folders, tmp_path):
    """A pipeline folder (its vae/ loaded alone): sigma_data from scheduler/scheduler_config.json, for
    latents without metadata (a pipeline's own); a file's recorded sigma_data comes first."""
    from diffusers import EDMEulerScheduler

    vae = folders["cosmos_vae"]
    pipe = tmp_path / "pipe"
    vae.save_pretrained(pipe / "vae")
    EDMEulerScheduler(sigma_data=0.25).save_pretrained(pipe / "scheduler")
    (pipe / "model_index.json").write_text(json.dumps({
        "_class_name": "CosmosTextToWorldPipeline", "vae": ["diffusers", "AutoencoderKLCosmos"],
        "scheduler": ["diffusers", "EDMEulerScheduler"]}))
    z = torch.randn(1, 4, 2, 2, 3, generator=torch.Generator().manual_seed(4))
    mean, std = _cosmos_norm(2)
    with torch.no_grad():
        ref = {s: vae.decode(z * std / s + mean).sample[0].permute(1, 2, 3, 0).numpy() for s in (0.25, 2.0)}
    save_file({"latents": z}, str(tmp_path / "plain.safetensors"))
    save_file({"latents": z}, str(tmp_path / "meta.safetensors"), metadata={"sigma_data": "2.0"})
    for name, s in (("plain", 0.25), ("meta", 2.0)):
        _run("decode", tmp_path / f"{name}.safetensors", "--model", pipe, "--out", tmp_path / f"{name}.npy",
             "--bits", 32, "--tile", 2, "--quiet")
        assert np.abs(np.load(tmp_path / f"{name}.npy") - ref[s]).max() <= TOL, name


def test_bad_input_is_refused_naming_the_value(folders, tmp_path, capsys):
    cosmos, svd = folders["cosmos"], folders["svd"]
    save_file({"latents": torch.randn(1, 4, 4, 2, 3)}, str(tmp_path / "long.safetensors"))
    save_file({"latents": torch.randn(1, 4, 2, 2, 3)}, str(tmp_path / "bad.safetensors"),
              metadata={"sigma_data": "-1"})
    save_file({"latents": torch.randn(1, 3, 2, 5, 7)}, str(tmp_path / "c3.safetensors"))
    out = tmp_path / "v.npy"
    err = _fails(capsys, "decode", tmp_path / "long.safetensors", "--model", cosmos, "--out", out,
                 code=BadInputFile.exit_code)
    assert "the latents have 4 frames" in err and "cover 3 (4 channels x 3 frames)" in err
    err = _fails(capsys, "decode", tmp_path / "bad.safetensors", "--model", cosmos, "--out", out,
                 code=BadInputFile.exit_code)
    assert "records sigma_data='-1': a positive number is valid" in err
    err = _fails(capsys, "decode", tmp_path / "long.safetensors", "--model", cosmos, "--out", out,
                 "--decode-chunk-size", 2, code=BadRequest.exit_code)
    assert "--decode-chunk-size applies to SVD's temporal decoder" in err and "AutoencoderKLCosmos" in err
    err = _fails(capsys, "decode", tmp_path / "c3.safetensors", "--model", svd, "--out", out,
                 code=BadInputFile.exit_code)
    assert "has 3 channels" in err and "4-channel latents" in err
    assert not out.exists()


# HunyuanVideo15Pipeline's, EasyAnimatePipeline's and CogVideoXPipeline's VAEs
SCALED = ("hunyuan15", "magvit", "cogvideox")


@pytest.fixture(scope="module")
def scaled(tmp_path_factory):
    """The tiny HunyuanVideo 1.5, Magvit and CogVideoX VAEs of their Python tests (scaling_factor 0.5; the
    CogVideoX config also naming a shift_factor and latents_mean / latents_std, which its pipelines never
    read), each saved as a VAE folder when first asked for: name -> (folder, the VAE)."""
    root, built = tmp_path_factory.mktemp("scaled"), {}

    def folder(name: str):
        if name not in built:
            vae = cogvideox_vae() if name == "cogvideox" else copy.deepcopy(video_vae(name))
            vae.register_to_config(scaling_factor=SF)
            if name == "cogvideox":
                vae.register_to_config(shift_factor=0.3, latents_mean=MEAN[:4], latents_std=STD[:4])
            vae.save_pretrained(root / name)
            built[name] = (root / name, vae)
        return built[name]

    return folder


# (HunyuanVideo 1.5 slow: each CLI call lowers its decode and encode, and tracing its encoder runs the stock
# mid-block's causal mask, built in a Python loop over the tokens: ~15 s of the 20 s on 2 cores; the same
# layout is Magvit's and CogVideoX's, its folder's route the refusal test's)
@pytest.mark.parametrize("name", [pytest.param("hunyuan15", marks=pytest.mark.slow), "magvit", "cogvideox"])
def test_a_scaled_family_folder_decodes_and_encodes_as_its_pipeline(scaled, tmp_path, name):
    """encode: 5 frames of 24x40 -> z = the posterior's mean * scaling_factor, (1, 4, 2, 3, 5) in 2x3 tiles
    (the latents of CogVideoXVideoToVideoPipeline's, EasyAnimate's inpaint's, HunyuanVideo 1.5 image2video's
    encodes); decode: 3 latent frames (CogVideoX's first call of 3) as the pipelines' decode steps,
    vae.decode(z / scaling_factor)."""
    folder, vae = scaled(name)
    video = np.random.default_rng(5).uniform(-1, 1, (5, 24, 40, 3)).astype(np.float32)
    np.save(tmp_path / "v.npy", video)
    _run("encode", tmp_path / "v.npy", "--model", folder, "--out", tmp_path / "e.safetensors", "--tile", 2,
         "--quiet")
    with torch.no_grad():
        want = vae.encode(torch.from_numpy(video).permute(3, 0, 1, 2)[None]).latent_dist.mode() * SF
    got = load_file(str(tmp_path / "e.safetensors"))["latents"]
    assert got.shape == want.shape == (1, 4, 2, 3, 5) and (got - want).abs().max() <= TOL
    with safe_open(str(tmp_path / "e.safetensors"), "pt") as f:
        meta = f.metadata()
    assert meta["normalised"] == "z * scaling_factor" and meta["vae"] == type(vae).__name__
    z = torch.randn(1, 4, 3, 3, 5, generator=torch.Generator().manual_seed(6))
    save_file({"latents": z}, str(tmp_path / "z.safetensors"))
    text = _run("decode", tmp_path / "z.safetensors", "--model", folder, "--out", tmp_path / "x.npy",
                "--bits", 32, "--tile", 2, "--quiet")
    assert "tiles: 2x3" in text
    with torch.no_grad():
        want = vae.decode(z / SF).sample[0].permute(1, 2, 3, 0).numpy()
    got = np.load(tmp_path / "x.npy")
    assert got.shape == want.shape == (9, 24, 40, 3) and np.abs(got - want).max() <= TOL


def test_mode_fast_decodes_a_video_family_with_its_named_approximation(scaled, tmp_path):
    """--mode fast on a 3-D VAE with GroupNorms (Magvit): its plan says what is estimated, and the frames
    are close to the stock decode's, not equal (the estimate, measured)."""
    folder, vae = scaled("magvit")
    z = torch.randn(1, 4, 3, 6, 6, generator=torch.Generator().manual_seed(7))
    save_file({"latents": z}, str(tmp_path / "z.safetensors"))
    text = _run("decode", tmp_path / "z.safetensors", "--model", folder, "--out", tmp_path / "x.npy",
                "--bits", 32, "--tile", 2, "--mode", "fast", "--quiet")
    assert "mode=fast" in text and "estimated from a sample of its tiles" in text
    with torch.no_grad():
        want = vae.decode(z / SF).sample[0].permute(1, 2, 3, 0).numpy()
    got = np.load(tmp_path / "x.npy")
    err = np.sqrt(np.mean((got - want) ** 2) / np.mean(want**2))
    assert got.shape == want.shape and 1e-4 < err < 0.6


def test_what_the_scaled_families_cannot_take_is_refused_naming_it(scaled, tmp_path, capsys):
    """A frame count HunyuanVideo 1.5's encoder cannot take (from the headers, before the VAE is lowered);
    CogVideoX's pipeline latents left frames first; a Magvit whose GroupNorms span each chunk's frames."""
    np.save(tmp_path / "v4.npy", np.zeros((4, 24, 40, 3), np.float32))
    err = _fails(capsys, "encode", tmp_path / "v4.npy", "--model", scaled("hunyuan15")[0], "--out",
                 tmp_path / "e.safetensors", code=BadInputFile.exit_code)
    assert "v4.npy' has 4 frames: AutoencoderKLHunyuanVideo15 encodes 1 + 4 k frames" in err
    save_file({"latents": torch.randn(1, 3, 4, 3, 5)}, str(tmp_path / "ff.safetensors"))  # (1, F, C, h, w)
    err = _fails(capsys, "decode", tmp_path / "ff.safetensors", "--model", scaled("cogvideox")[0], "--out",
                 tmp_path / "x.npy", code=BadInputFile.exit_code)
    assert "has 3 channels (shape [1, 3, 4, 3, 5])" in err and "permute(0, 2, 1, 3, 4)" in err
    magvit(spatial_group_norm=False).save_pretrained(tmp_path / "magvit")
    save_file({"latents": torch.randn(1, 4, 2, 3, 5)}, str(tmp_path / "z.safetensors"))
    err = _fails(capsys, "decode", tmp_path / "z.safetensors", "--model", tmp_path / "magvit", "--out",
                 tmp_path / "x.npy", code=ModelProblem.exit_code)
    assert "TiledVAE cannot tile AutoencoderKLMagvit: its GroupNorms (spatial_group_norm=False)" in err
    assert not any(p.name.startswith(("e.", "x.")) for p in tmp_path.iterdir())


@pytest.fixture(scope="module")
def chunked(tmp_path_factory):
    """The tiny KVAE video and Kandinsky 6 SR VAEs of their Python tests, saved as VAE folders."""
    root = tmp_path_factory.mktemp("chunked")
    vaes = {"kvae": kvae_video(), "k6sr": kandinsky6_sr()}
    for name, vae in vaes.items():
        vae.save_pretrained(root / name)
    return {name: (root / name, vae) for name, vae in vaes.items()}


def test_a_kvae_video_folder_encodes_and_decodes_its_raw_latents(chunked, tmp_path, capsys):
    """5 frames of 24x40 -> the posterior's mean, (1, 4, 2, 3, 5) in 2x3 tiles (no scaling_factor in its
    config: z as the VAE decodes it); 3 latent frames decoded as vae.decode(z); an encode of 4 frames refused
    from the file's header (its encode takes 1 + 4 k), nothing written."""
    folder, vae = chunked["kvae"]
    video = np.random.default_rng(5).uniform(-1, 1, (5, 24, 40, 3)).astype(np.float32)
    np.save(tmp_path / "v.npy", video)
    _run("encode", tmp_path / "v.npy", "--model", folder, "--out", tmp_path / "e.safetensors", "--tile", 2,
         "--quiet")
    with torch.no_grad():
        want = vae.encode(torch.from_numpy(video).permute(3, 0, 1, 2)[None]).latent_dist.mode()
    got = load_file(str(tmp_path / "e.safetensors"))["latents"]
    assert got.shape == want.shape == (1, 4, 2, 3, 5) and (got - want).abs().max() <= TOL
    z = torch.randn(1, 4, 3, 3, 5, generator=torch.Generator().manual_seed(6))
    save_file({"latents": z}, str(tmp_path / "z.safetensors"))
    text = _run("decode", tmp_path / "z.safetensors", "--model", folder, "--out", tmp_path / "x.npy",
                "--bits", 32, "--tile", 2, "--quiet")
    assert "tiles: 2x3" in text
    with torch.no_grad():
        want = vae.decode(z).sample[0].permute(1, 2, 3, 0).numpy()
    got = np.load(tmp_path / "x.npy")
    assert got.shape == want.shape == (9, 24, 40, 3) and np.abs(got - want).max() <= TOL
    np.save(tmp_path / "v4.npy", np.zeros((4, 24, 40, 3), np.float32))
    err = _fails(capsys, "encode", tmp_path / "v4.npy", "--model", folder, "--out",
                 tmp_path / "f.safetensors", code=BadInputFile.exit_code)
    assert "v4.npy' has 4 frames: " in err and "1 + 4" in err
    assert not (tmp_path / "f.safetensors").exists()


def test_a_kandinsky6_sr_folder_reads_and_writes_pixels_as_its_pipeline(chunked, tmp_path):
    """8-bit frames p are encoded as Kandinsky6SRPipeline.encode_video encodes them (its K-VAE's p / 128 - 1),
    z * scaling_factor; its latents decode to 8-bit frames round((v + 1) * 128), clamped, as its
    decode_latents and the video processor give them, and to float frames as the VAE's own values."""
    folder, vae = chunked["k6sr"]
    sf = float(vae.config.scaling_factor)
    pixels = np.random.default_rng(7).integers(0, 256, (5, 24, 40, 3), dtype=np.uint8)
    for t in range(5):
        Image.fromarray(pixels[t]).save(tmp_path / f"f{t:02d}.png")
    _run("encode", tmp_path / "f{:02d}.png", "--model", folder, "--out", tmp_path / "e.safetensors", "--tile",
         2, "--quiet")
    x = torch.from_numpy(pixels.astype(np.float32)).permute(3, 0, 1, 2)[None]
    with torch.no_grad():
        want = vae.encode(x / 128 - 1).latent_dist.mode() * sf
        other = vae.encode(x / 127.5 - 1).latent_dist.mode() * sf  # (VideoProcessor's alone)
    got = load_file(str(tmp_path / "e.safetensors"))["latents"]
    assert got.shape == want.shape == (1, 4, 2, 3, 5) and (got - want).abs().max() <= TOL
    assert (other - want).abs().max() > 1e-3  # (the rescale is seen)
    _run("decode", tmp_path / "e.safetensors", "--model", folder, "--out", tmp_path / "o{:02d}.png", "--tile",
         2, "--quiet")
    with torch.no_grad():
        v = vae.decode(got / sf).sample
    want8 = ((v + 1) * 128).round().clamp(0, 255).to(torch.uint8)[0].permute(1, 2, 3, 0).numpy()
    back = np.stack([np.asarray(Image.open(tmp_path / f"o{t:02d}.png")) for t in range(5)])
    assert back.shape == want8.shape == (5, 24, 40, 3)
    assert np.abs(back.astype(int) - want8.astype(int)).max() <= 1  # (float rounding at a half level)
    _run("decode", tmp_path / "e.safetensors", "--model", folder, "--out", tmp_path / "o.npy", "--bits", 32,
         "--tile", 2, "--quiet")
    assert np.abs(np.load(tmp_path / "o.npy") - v[0].permute(1, 2, 3, 0).numpy()).max() <= TOL


def test_an_allegro_folder_decodes_and_encodes_as_the_one_pass(tmp_path, capsys):
    """3 latent frames of 3x5 (2x3 tiles) -> 12 frames of 24x40, frames along T as every family's (its
    decode returns them first, (B, T, C, H, W)): the one pass of z / scaling_factor (its own decode runs
    only through its blended cubes); 8 frames -> (1, 4, 2, 3, 5), the one pass's mean * scaling_factor; 6
    frames refused from the video's header (its encode takes 4 k), nothing written."""
    vae = allegro(blocks=4)
    vae.save_pretrained(tmp_path / "allegro")
    folder, sf = tmp_path / "allegro", float(vae.config.scaling_factor)
    z = torch.randn(1, 4, 3, 3, 5, generator=torch.Generator().manual_seed(6))
    save_file({"latents": z}, str(tmp_path / "z.safetensors"))
    text = _run("decode", tmp_path / "z.safetensors", "--model", folder, "--out", tmp_path / "x.npy",
                "--bits", 32, "--tile", 2, "--quiet")
    assert "tiles: 2x3" in text
    video = np.random.default_rng(5).uniform(-1, 1, (8, 24, 40, 3)).astype(np.float32)
    np.save(tmp_path / "v.npy", video)
    _run("encode", tmp_path / "v.npy", "--model", folder, "--out", tmp_path / "e.safetensors", "--tile", 2,
         "--quiet")
    with torch.no_grad():
        want = allegro_decode(vae, z / sf)[0].permute(1, 2, 3, 0).numpy()
        mean = allegro_encode(vae, torch.from_numpy(video).permute(3, 0, 1, 2)[None]).chunk(2, dim=1)[0]
    got = np.load(tmp_path / "x.npy")
    assert got.shape == want.shape == (12, 24, 40, 3) and np.abs(got - want).max() <= TOL
    got = load_file(str(tmp_path / "e.safetensors"))["latents"]
    assert got.shape == mean.shape == (1, 4, 2, 3, 5) and (got - mean * sf).abs().max() <= TOL
    with safe_open(str(tmp_path / "e.safetensors"), "pt") as f:
        assert f.metadata()["normalised"] == "z * scaling_factor"
    np.save(tmp_path / "v6.npy", video[:6])
    err = _fails(capsys, "encode", tmp_path / "v6.npy", "--model", folder, "--out",
                 tmp_path / "f.safetensors", code=BadInputFile.exit_code)
    assert "v6.npy' has 6 frames: AutoencoderKLAllegro encodes a multiple of 4 frames" in err
    assert not (tmp_path / "f.safetensors").exists()
