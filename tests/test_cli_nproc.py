"""`tilewise ... --nproc N`: the command relaunches itself under torchrun; ranks agree with one process."""

import json
import os
import re
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

_GLOO = torch.distributed.is_available() and torch.distributed.is_gloo_available()
pytestmark = pytest.mark.skipif(not _GLOO, reason="torch.distributed with gloo is needed")
LIMIT = 240


def _tilewise(*args, cwd) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "tilewise.cli", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=LIMIT)


GENERATE = ["generate", "--prompt", "grass", "--width", "256", "--height", "128", "--steps", "2",
            "--tile", "8", "--overlap", "2", "--vae-tile", "4", "-q"]


def test_generate_on_two_ranks_equals_one_process(tmp_path):
    one = _tilewise(*GENERATE, "--out", "one.npy", cwd=tmp_path)
    assert one.returncode == 0, one.stderr[-2000:]
    t0 = time.monotonic()
    two = _tilewise(*GENERATE, "--out", "two.npy", "--nproc", "2", cwd=tmp_path)
    assert two.returncode == 0, two.stderr[-3000:]
    assert "launching 2 ranks" in two.stderr and "tilewise.distributed.torchrun" in two.stderr
    assert two.stdout.count("wrote two.npy") == 1  # rank 0 alone reports and writes
    a = np.load(tmp_path / "one.npy").astype(np.int16)
    b = np.load(tmp_path / "two.npy").astype(np.int16)
    assert a.shape == b.shape == (128, 256, 3)
    assert a.std() > 5  # a real image
    # latents and decode agree to ~1e-5; 8-bit rounding may flip a value sitting on a level boundary
    diff = np.abs(a - b)
    assert diff.max() <= 1 and (diff > 0).mean() < 1e-3, (diff.max(), (diff > 0).mean())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["one.npy", "two.npy"]  # no temporary left
    assert time.monotonic() - t0 < LIMIT


def test_failing_ranks_stop_the_launch_with_their_error(tmp_path):
    """A VAE folder whose config does not fit its weights fails in the ranks, as they load it (what the
    checks before the launch cannot see): the launch ends with the ranks' status and their one line."""
    from diffusers import AutoencoderKL
    from tiny_sd import vae_config

    torch.manual_seed(0)
    AutoencoderKL(**vae_config()).save_pretrained(tmp_path / "vae")
    cfg = json.loads((tmp_path / "vae" / "config.json").read_text())
    cfg["latent_channels"] = 8  # the weights hold 4-channel convolutions
    (tmp_path / "vae" / "config.json").write_text(json.dumps(cfg))
    save_file({"latents": torch.zeros(1, 8, 4, 4)}, str(tmp_path / "z.safetensors"))
    before = sorted(p.name for p in tmp_path.iterdir())
    bad = _tilewise("decode", "z.safetensors", "--model", "vae", "--out", "o.npy", "--nproc", "2",
                    cwd=tmp_path)
    assert bad.returncode == 5, bad.stderr[-3000:]
    assert "error: VAE folder 'vae' cannot be loaded" in bad.stderr
    assert "error: 2 ranks under torchrun: exit status 5" in bad.stderr
    assert "Traceback" not in bad.stderr and "ChildFailedError" not in bad.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def _photo(path, h: int, w: int) -> None:
    from PIL import Image

    rng = np.random.default_rng(0)
    y, x = np.mgrid[0:h, 0:w]
    img = 120 + 80 * np.sin(x / 9.0) * np.cos(y / 7.0) + rng.normal(0, 10, (h, w))
    Image.fromarray(np.stack([img, img[::-1], img[:, ::-1]], -1).clip(0, 255).astype(np.uint8)).save(path)


@pytest.mark.slow  # (~80 s: two two-rank launches; decode / generate on two ranks stay by default)
def test_encode_and_upscale_on_two_ranks_equal_one_process(tmp_path):
    from safetensors.torch import load_file

    _photo(tmp_path / "in.png", 64, 96)
    enc = ["encode", "in.png", "--tile", "2", "-q"]
    up = ["upscale", "in.png", "--scale", "2", "--strength", "0.3", "--prompt", "grass", "--steps", "4",
          "--tile", "8", "--overlap", "2", "--vae-tile", "4", "-q"]
    for args, name in ((enc, "lat"), (up, "up")):
        ext = "safetensors" if name == "lat" else "npy"
        one = _tilewise(*args, "--out", f"{name}1.{ext}", cwd=tmp_path)
        assert one.returncode == 0, one.stderr[-2000:]
        two = _tilewise(*args, "--out", f"{name}2.{ext}", "--nproc", "2", cwd=tmp_path)
        assert two.returncode == 0, two.stderr[-3000:]
        assert "launching 2 ranks" in two.stderr
    a, b = (load_file(tmp_path / f"lat{n}.safetensors")["latents"] for n in (1, 2))
    assert a.shape == b.shape == (1, 4, 8, 12) and a.abs().max() > 0.1
    assert (a - b).abs().max() <= 1e-5
    a, b = np.load(tmp_path / "up1.npy").astype(np.int16), np.load(tmp_path / "up2.npy").astype(np.int16)
    assert a.shape == b.shape == (128, 192, 3) and a.std() > 5
    diff = np.abs(a - b)
    assert diff.max() <= 1 and (diff > 0).mean() < 1e-3, (diff.max(), (diff > 0).mean())


def test_plan_per_rank_rows_and_staged_bytes(tmp_path):
    from typer.testing import CliRunner

    from tilewise.cli import app

    res = CliRunner().invoke(app, ["plan", "--width", "256", "--height", "384", "--tile", "8", "--ranks", "3",
                                   "--image", str(tmp_path / "ranks.png")])
    assert res.exit_code == 0, res.output
    rows = re.findall(r"rank (\d): latent rows \[(\d+), (\d+)\), (\d+) tiles, staged at most ([\d.]+) (\w+)",
                      res.output)
    assert [r[:4] for r in rows] == [("0", "0", "16", "8"), ("1", "16", "32", "8"), ("2", "32", "48", "8")]
    single = float(re.search(r"at most ([\d.]+) MiB alive at once", res.output).group(1))
    staged = [float(r[4]) * (1 / 1024 if r[5] == "KiB" else 1) for r in rows]
    assert all(single / 3 <= s < single / 3 * 1.3 for s in staged), (single, staged)  # a third plus halos
    assert (tmp_path / "ranks.png").stat().st_size > 10_000


@pytest.mark.slow  # (60 s on 2 cores: four processes import torch; the ranks' video decode is tested in
# process by tests/test_distributed_video.py, --nproc's launch by the generate test above)
def test_video_vae_decode_on_two_ranks_equals_one_process(tmp_path):
    """A 3-D VAE (Wan 2.1 layout) under --nproc 2: each rank its band of tile rows with its causal caches,
    rank 0 writes the .npy stack (encode on ranks: tests/test_distributed_video.py)."""
    from video_vae_support import video_vae

    video_vae("wan2.1").save_pretrained(tmp_path / "wan")
    z = torch.randn(1, 4, 3, 8, 7, generator=torch.Generator().manual_seed(0))
    save_file({"latents": z}, str(tmp_path / "z.safetensors"))
    dec = ["decode", "z.safetensors", "--model", "wan", "--tile", "3", "-q"]
    for n, extra in ((1, []), (2, ["--nproc", "2"])):
        run = _tilewise(*dec, "--out", f"v{n}.npy", *extra, cwd=tmp_path)
        assert run.returncode == 0, run.stderr[-3000:]
    a, b = (np.load(tmp_path / f"v{n}.npy").astype(np.int16) for n in (1, 2))
    assert a.shape == b.shape == (9, 64, 56, 3) and a.std() > 1
    assert np.abs(a - b).max() <= 1  # (8-bit rounding of values equal to ~1e-6)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v1.npy", "v2.npy", "wan", "z.safetensors"]
