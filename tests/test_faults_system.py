"""Faults only a real process or a real file system shows (issue 20): signals mid-run, a full disk, a
read-only mount. Signals go to a `python -m tilewise.cli` subprocess on the embedded model; the file
systems are small tmpfs mounts (skipped, saying why, where this machine does not allow mounting)."""

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import save_file

from tilewise.cli import main

LIMIT = 240  # seconds a subprocess may take on a loaded 2-core machine


def _env(stage):
    return dict(os.environ, TMPDIR=str(stage), TRANSFORMERS_VERBOSITY="error")


def _latents(path, side):
    z = torch.randn(1, 4, side, side, generator=torch.Generator().manual_seed(0))
    save_file({"latents": z}, str(path))


def _staging(folder):
    """The disk-staging folders (tilewise-stage-*) in folder (torch keeps its own cache there too)."""
    return [p for p in folder.iterdir() if p.name.startswith("tilewise-stage-")]


def _wait(proc, ready, what):
    """Poll until ready() (the run is where the test wants it) while the process still runs."""
    t0 = time.monotonic()
    while not ready():
        if proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(f"the run ended (rc {proc.returncode}) before {what}: {err[-2000:]}")
        if time.monotonic() - t0 > LIMIT:
            proc.kill()
            pytest.fail(f"no {what} after {LIMIT} s")
        time.sleep(0.05)


@pytest.mark.parametrize("signum,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)],
                         ids=["SIGINT", "SIGTERM"])
def test_signal_during_a_disk_staged_decode_cleans_up_and_exits_128_plus_signum(tmp_path, signum, code):
    """The issue: Ctrl-C exited 0, SIGTERM left the .part file and the disk-staging folder (39 MB)."""
    work, stage = tmp_path / "work", tmp_path / "stage"
    work.mkdir()
    stage.mkdir()
    _latents(work / "z.safetensors", 48)
    argv = ["decode", "z.safetensors", "--out", "o.png", "--staging", "disk", "--tile", "16", "--quiet"]
    proc = subprocess.Popen([sys.executable, "-m", "tilewise.cli", *argv], cwd=work, env=_env(stage),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait(proc, lambda: any(p.name.endswith(".part") for p in work.iterdir()) and _staging(stage),
              "a .part file and a staging folder")
        proc.send_signal(signum)
        out, err = proc.communicate(timeout=LIMIT)
    finally:
        proc.kill()
    assert proc.returncode == code, err
    assert f"interrupted ({signal.Signals(signum).name})" in err and "Traceback" not in err
    assert sorted(p.name for p in work.iterdir()) == ["z.safetensors"], "the .part file was left"
    assert not _staging(stage), "the disk-staging folder was left"


def test_sigint_during_denoising_exits_130(tmp_path):
    argv = ["generate", "--prompt", "grass", "--width", "1024", "--height", "512", "--out", "o.png"]
    proc = subprocess.Popen([sys.executable, "-m", "tilewise.cli", *argv], cwd=tmp_path, env=_env(tmp_path),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        log = []

        def denoising():  # the recipe logs this line right before the first UNet call
            line = proc.stderr.readline()
            log.append(line)
            return "tiles of" in line and "latent px per call" in line

        _wait(proc, denoising, "the denoising log line")
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=LIMIT)
    finally:
        proc.kill()
    err = "".join(log) + err
    assert proc.returncode == 130, err
    assert "interrupted (SIGINT)" in err and "Traceback" not in err
    assert not [p for p in tmp_path.iterdir() if not p.name.startswith("torchinductor")]  # torch's cache


@pytest.fixture
def tmpfs(tmp_path):
    """A mounter of small tmpfs file systems under tmp_path, unmounted afterwards."""
    mounted = []

    def mount(name, options):
        where = tmp_path / name
        where.mkdir()
        if shutil.which("mount") is None:
            pytest.skip("no mount command on this machine: the full-disk and read-only cases need a tmpfs")
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)],
                              capture_output=True, text=True)
        if done.returncode:
            why = done.stderr.strip() or done.returncode
            pytest.skip(f"cannot mount a tmpfs here ({why}); the full-disk and read-only cases need one "
                        "(root in a sandbox that allows mounts)")
        mounted.append(where)
        return where

    yield mount
    for where in mounted:
        subprocess.run(["umount", str(where)], capture_output=True)


def test_full_disk_while_writing_npy_is_an_error_not_a_bus_error(tmp_path, tmpfs):
    """The issue: a .npy on a full disk died of SIGBUS (a memmapped page with no room) with a partial file."""
    disk = tmpfs("full", "size=64k")
    _latents(tmp_path / "z.safetensors", 16)  # 128 x 128 x 3 float32 = 192 KiB > 64 KiB
    done = subprocess.run([sys.executable, "-m", "tilewise.cli", "decode", str(tmp_path / "z.safetensors"),
                           "--out", str(disk / "o.npy"), "--bits", "32", "--tile", "8", "--quiet"],
                          env=_env(tmp_path), capture_output=True, text=True, timeout=LIMIT)
    assert done.returncode == 4, done.stderr
    assert "no space left on the device while writing" in done.stderr and "o.npy" in done.stderr
    assert "Traceback" not in done.stderr and ".part" not in done.stderr
    assert not list(disk.iterdir())


def test_full_disk_while_streaming_a_tiff_leaves_nothing(tmp_path, tmpfs, monkeypatch, capsys):
    disk = tmpfs("full", "size=64k")
    _latents(tmp_path / "z.safetensors", 16)  # 128 x 128 x 3 uint16 = 96 KiB, written tile row by tile row
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        main(["decode", "z.safetensors", "--out", str(disk / "o.tif"), "--bits", "16", "--tile", "8",
              "--quiet"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 4, err
    assert "no space left on the device while writing" in err and "o.tif" in err and "Traceback" not in err
    assert not list(disk.iterdir())


def test_read_only_output_folder_is_refused_before_any_work(tmp_path, tmpfs, monkeypatch, capsys):
    ro = tmpfs("ro", "ro,size=64k")
    monkeypatch.chdir(tmp_path)
    t0 = time.perf_counter()
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--prompt", "grass", "--out", str(ro / "o.png")])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2, err
    assert "read-only file system" in err and str(ro / "o.png") in err and ".part" not in err
    assert time.perf_counter() - t0 < 5  # refused before the model is loaded or anything denoised
