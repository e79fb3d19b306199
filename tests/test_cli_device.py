"""`--device`: plans made for the device they name (CUDA-shaped on any machine), CUDA by default when one
is present, and a device that is not a torch device, or not here, refused in one line naming it."""

import pytest
import torch
import typer
from typer.testing import CliRunner

import tilewise as tw
from tilewise.cli import app
from tilewise.cli.options import resolve_device

runner = CliRunner()
PLAN = ["plan", "--width", "512", "--height", "512", "--budget", "64MiB"]


def _run(*args):
    result = runner.invoke(app, [str(a) for a in args], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.output


def _plan(device_kind: str, dtype=torch.float32):
    """The plan the command should print, made in-process on the embedded VAE (the oracle)."""
    from tilewise.models import load_default_vae

    vae = load_default_vae(dtype=dtype)
    tv = tw.TiledVAE(vae, memory_budget="64MiB", device_kind=device_kind)
    return tv.plan((1, vae.config.latent_channels, 64, 64))


def test_plan_for_cuda_prints_its_counts_and_the_device_on_a_cpu_machine(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cuda = _run(*PLAN, "--device", "cuda", "--dtype", "float16")
    cpu = _run(*PLAN, "--device", "cpu")
    assert str(_plan("cuda", torch.float16)) in cuda and str(_plan("cpu")) in cpu
    assert "planned for: cuda (NVIDIA" in cuda and "device cuda: not on this machine" in cuda
    for printed in ("GFLOP", "kernel launches", "host->device", "estimated time", "estimated device peak"):
        assert printed in cuda
    assert "planned for: cpu" in cpu and "device cpu: this machine's CPU" in cpu
    # the shapes differ: a CPU plan bands big tiles by rows, a CUDA plan runs them whole
    assert "row bands" in cpu and "whole tiles" in cuda and "row bands" not in cuda


def test_device_defaults_to_cuda_when_one_is_present(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Test GPU")
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert resolve_device("auto") == "cuda"
    out = _run(*PLAN)
    assert "planned for: cuda" in out and "device cuda: Test GPU on this machine" in out
    monkeypatch.setenv("LOCAL_RANK", "3")  # under torchrun: the rank's own GPU
    assert resolve_device("auto") == "cuda:3"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == "cpu"
    assert "planned for: cpu" in _run(*PLAN)


def test_every_command_that_takes_a_device_defaults_to_auto():
    group = typer.main.get_command(app)
    defaults = {name: p.default for name, cmd in group.commands.items() for p in cmd.params
                if p.name == "device"}
    assert set(defaults) >= {"plan", "decode", "encode", "generate", "upscale"}, defaults
    assert set(defaults.values()) == {"auto"}, defaults


def test_a_device_that_is_not_one_or_not_here_is_refused_naming_it(monkeypatch, tmp_path):
    with pytest.raises(ValueError, match="'gpu0' is not a torch device"):
        resolve_device("gpu0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="'cuda:1': no CUDA device here"):
        resolve_device("cuda:1")
    assert resolve_device("cuda:1", present=False) == "cuda:1"  # (a plan may be made for it)
    result = runner.invoke(app, ["decode", str(tmp_path / "z.safetensors"), "--out", str(tmp_path / "x.png"),
                                 "--device", "cuda"])
    assert isinstance(result.exception, ValueError) and "no CUDA device" in str(result.exception)
    assert not (tmp_path / "x.png").exists()
