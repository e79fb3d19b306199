"""benchmarks/gpu.py, the one-command GPU benchmark, dry run on the CPU at a tiny size: the same code
the GPU run takes (float16, CUDA-shaped plans, every variant, the table written size by size), so
that it runs the first time it meets a GPU."""

import copy
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import gpu  # noqa: E402
from counting import build_vae  # noqa: E402

DRY = ["--device", "cpu", "--device-kind", "cuda", "--narrow", "--budget", "512KiB", "--diffusers-tile", "32",
       "--repeats", "1", "--dtype", "float16", "--small-budget", "384KiB"]


@pytest.fixture
def one_thread():
    """One intra-op thread: on shared cores two threads spin-wait for each other on these tiny
    convolutions (50x slower); the dry run checks what runs, not how fast."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def test_gpu_benchmark_dry_run_times_every_variant_and_writes_the_table(tmp_path, one_thread):
    out = tmp_path / "results_gpu.md"
    rows = gpu.main([*DRY, "--sizes", "64", "--out", str(out)])
    by = {r["variant"]: r for r in rows}
    assert list(by) == ["untiled", "diffusers tiling", "tilewise exact", "tilewise fast",
                        "tilewise exact, 384KiB"]
    assert all(r["seconds"] > 0 and r["ratio"] > 0 for r in rows) and by["untiled"]["ratio"] == 1.0
    exact, fast = by["tilewise exact"], by["tilewise fast"]
    # CUDA-shaped plans that tile at this budget (not the untiled run), with their device and estimate
    assert exact["plan"].device == fast["plan"].device == "cuda" and not exact["plan"].untiled
    assert exact["plan"].grid != (1, 1) and exact["plan"].seconds > 0 and exact["plan_s"] > 0
    # exact in float16 is within float16's own error of the untiled decode (its untiled-vs-float32 error:
    # the benchmark's VAE and latent, the VAE in float32)
    vae16 = build_vae("sd", torch.float16, "cpu", blocks=(16, 32, 32, 32), groups=8)
    vae32 = copy.deepcopy(vae16).float()
    z = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(0)).half()
    with torch.no_grad():
        own = (vae16.decode(z).sample.float() - vae32.decode(z.float()).sample).abs().max().item()
    assert 0 < own < 0.5 and exact["max_abs"] <= own
    assert by["diffusers tiling"]["max_abs"] > 10 * own  # (its tiles are blended: a different image)
    text = out.read_text()
    assert "Command: python benchmarks/gpu.py" in text and text.count("| 64 | ") == 5
    small = by["tilewise exact, 384KiB"]
    assert small["plan"].staging == "host" and small["max_abs"] <= own  # (host staging's copies: exact)
    assert "| 64 | tilewise exact |" in text and "tile 4" in text


def test_gpu_benchmark_skips_sizes_past_its_deadline_and_says_so(tmp_path, one_thread):
    out = tmp_path / "results_gpu.md"
    assert gpu.main([*DRY, "--sizes", "64", "--deadline", "-1", "--out", str(out)]) == []
    assert "| 64 | (skipped: the run passed its -1 s deadline)" in out.read_text()
