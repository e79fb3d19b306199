"""`tilewise decode` / `encode --model` with VidTok VAE folders (tiny seeded configs of
tests/test_vidtok_vae.py, saved with save_pretrained): no pipeline of diffusers uses VidTok, so its latents
files hold the raw latent (its config names no scaling_factor); decode and encode equal the stock VAE's
(fp32, <= 1e-4) for the causal KL VAE, the FSQ one (its file also holds the codebook indices) and the
non-causal one (its decode keeps a multiple of 4 latent frames, as its own; fewer refused from the file,
with BadInputFile's exit code, nothing written)."""

import faults_support
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from safetensors.torch import load_file, save_file  # noqa: E402
from typer.testing import CliRunner  # noqa: E402
from video_vae_support import vidtok  # noqa: E402

from tilewise.cli import app  # noqa: E402
from tilewise.errors import BadInputFile  # noqa: E402

runner = CliRunner()
TOL = 1e-4


def _run(*args):
    result = runner.invoke(app, [str(a) for a in args], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.output


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("vidtok")
    vaes = {"kl": vidtok(), "fsq": vidtok(regularizer="fsq"), "non_causal": vidtok(is_causal=False)}
    for name, vae in vaes.items():
        vae.save_pretrained(root / name)
    return {name: (root / name, vae) for name, vae in vaes.items()}


def _encoded(folder, tmp_path, frames: int, seed: int):
    """The CLI's encode of a (frames, 12, 20) float video (a .npy: the VAE's own values), and that video
    as the VAE takes it."""
    v = np.random.default_rng(seed).uniform(-1, 1, (frames, 12, 20, 3)).astype(np.float32)
    np.save(tmp_path / "v.npy", v)
    _run("encode", tmp_path / "v.npy", "--model", folder, "--out", tmp_path / "e.safetensors", "--tile", 2,
         "--quiet")
    return load_file(str(tmp_path / "e.safetensors")), torch.from_numpy(v).permute(3, 0, 1, 2)[None]


def _decoded(folder, tmp_path, z=None):
    """The CLI's decode of latents z (saved as a file), or of its encode's file (z None)."""
    path = tmp_path / ("e.safetensors" if z is None else "z.safetensors")
    if z is not None:
        save_file({"latents": z.contiguous()}, str(path))
    text = _run("decode", path, "--model", folder, "--out", tmp_path / "x.npy",
                "--bits", 32, "--tile", 2, "--quiet")
    assert "tiles: 2x3" in text
    return torch.from_numpy(np.load(tmp_path / "x.npy")).permute(3, 0, 1, 2)[None]


def test_a_vidtok_folder_encodes_and_decodes_its_raw_latents(folders, tmp_path):
    """8 frames -> the posterior's mode (1, 4, 2, 3, 5) in 2x3 tiles; 2 latent frames decoded as its own
    decode (the first 3 of its 8 frames dropped: 5 frames)."""
    folder, vae = folders["kl"]
    got, x = _encoded(folder, tmp_path, 8, seed=1)
    with torch.no_grad():
        want = vae.encode(x).latent_dist.mode()
    assert list(got) == ["latents"]
    assert got["latents"].shape == want.shape == (1, 4, 2, 3, 5)
    assert (got["latents"] - want).abs().max() <= TOL
    z = torch.randn(1, 4, 2, 3, 5, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = vae.decode(z)
    out = _decoded(folder, tmp_path, z)
    assert out.shape == want.shape == (1, 3, 5, 12, 20) and (out - want).abs().max() <= TOL


def test_an_fsq_vidtok_folder_writes_its_quantised_latent_and_indices(folders, tmp_path):
    folder, vae = folders["fsq"]
    got, x = _encoded(folder, tmp_path, 8, seed=3)
    with torch.no_grad():
        want, idx = vae.encode(x)
        dec = vae.decode(want)
    assert got["latents"].shape == want.shape == (1, 4, 2, 3, 5)
    assert (got["latents"] - want).abs().max() <= TOL
    assert got["indices"].dtype == torch.int32 and torch.equal(got["indices"], idx)
    out = _decoded(folder, tmp_path)  # (its encode's file, the indices beside the latents)
    assert out.shape == dec.shape and (out - dec).abs().max() <= TOL


def test_a_non_causal_vidtok_folder_decodes_what_its_own_decode_keeps(folders, tmp_path, capsys):
    """5 latent frames: its own decode keeps 4 (16 frames); 2 are refused from the file, nothing written."""
    folder, vae = folders["non_causal"]
    z = torch.randn(1, 4, 5, 3, 5, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = vae.decode(z)
    out = _decoded(folder, tmp_path, z)
    assert out.shape == want.shape == (1, 3, 16, 12, 20) and (out - want).abs().max() <= TOL
    save_file({"latents": z[:, :, :2].contiguous()}, str(tmp_path / "z2.safetensors"))
    args = ["decode", tmp_path / "z2.safetensors", "--model", folder, "--out", tmp_path / "y.npy",
            "--bits", 32]
    code, errors, err = faults_support.run([str(a) for a in args], capsys)
    assert code == BadInputFile.exit_code and len(errors) == 1, err
    assert "z2.safetensors' has 2 frames: " in errors[0]
    assert "decodes a multiple of 4 latent frames" in errors[0]
    assert not (tmp_path / "y.npy").exists()
