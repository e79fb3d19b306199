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
from faults_support import quiet_diffusers  # noqa: F401 (a fixture, used by name below)
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


# (SIGTERM's 143 is tested by default on the frame-pattern decode below, SIGINT's 130 there with -m slow:
# each code once by default, each ~10 s of a subprocess on 2 cores)
@pytest.mark.parametrize("signum,code", [(signal.SIGINT, 130),
                                         pytest.param(signal.SIGTERM, 143, marks=pytest.mark.slow)],
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


def test_full_disk_for_an_npy_is_refused_before_the_work(tmp_path, tmpfs):
    """The issue: a .npy on a full disk died of SIGBUS (a memmapped page with no room) with a partial file;
    now its size is checked against the free disk before the model loads (a subprocess: were the check and
    the reservation both gone, the bus error would end the process, not the test run)."""
    disk = tmpfs("full", "size=64k")
    _latents(tmp_path / "z.safetensors", 16)  # 128 x 128 x 3 float32 = 192 KiB > 64 KiB
    done = subprocess.run([sys.executable, "-m", "tilewise.cli", "decode", str(tmp_path / "z.safetensors"),
                           "--out", str(disk / "o.npy"), "--bits", "32", "--tile", "8", "--quiet"],
                          env=_env(tmp_path), capture_output=True, text=True, timeout=LIMIT)
    assert done.returncode == 4, done.stderr
    assert "o.npy" in done.stderr and "needs at least 192.00 KiB of disk" in done.stderr
    assert "64.00 KiB is free" in done.stderr and "Traceback" not in done.stderr
    assert not list(disk.iterdir())


def test_an_npy_sink_reserves_its_blocks_so_a_full_disk_is_an_error_at_once(tmp_path, tmpfs):
    import errno

    import tilewise as tw

    disk = tmpfs("full", "size=64k")
    with pytest.raises(OSError) as err:
        tw.MemmapSink(disk / "o.npy", 128, 128, 3, "float32")
    assert err.value.errno == errno.ENOSPC and err.value.filename == str(disk / "o.npy")
    assert not list(disk.iterdir())


def test_full_disk_while_streaming_a_tiff_leaves_nothing(tmp_path, tmpfs, monkeypatch, capsys):
    """The pixels (96 KiB) fit the free disk, so the checks let it start; the tiled TIFF's 256 x 256 tiles
    (384 KiB) do not: the disk fills while it is written."""
    disk = tmpfs("full", "size=128k")
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


# -- frame patterns: an interrupt or a full disk never removes or damages a frame the user had -------

@pytest.fixture(scope="module")
def wan_folder(tmp_path_factory):
    from video_vae_support import video_vae

    folder = tmp_path_factory.mktemp("wan") / "wan"
    video_vae("wan2.1").save_pretrained(folder)
    return folder


def _video_latents(path, t, h, w):
    z = torch.randn(1, 4, t, h, w, generator=torch.Generator().manual_seed(0))
    save_file({"latents": z}, str(path))


@pytest.mark.parametrize("signum,code", [(signal.SIGTERM, 143),
                                         pytest.param(signal.SIGINT, 130, marks=pytest.mark.slow)],
                         ids=["SIGTERM", "SIGINT"])
def test_signal_during_a_frame_pattern_decode_keeps_the_users_frame(tmp_path, wan_folder, signum, code):
    """The issue: SIGTERM during a frame-pattern decode where fr/f0000.png existed removed the user's file
    (overwritten when frame 0 was done, then removed by the clean-up) while the message said no partial
    output was left. Now frames stay under temporary names until all are complete."""
    work, stage = tmp_path / "work", tmp_path / "stage"
    (work / "fr").mkdir(parents=True)
    stage.mkdir()
    _video_latents(work / "z.safetensors", 6, 12, 16)  # 21 frames of 96 x 128 in 48 tiles per step
    mine = b"the user's own frame 0, not a PNG"
    (work / "fr" / "f0000.png").write_bytes(mine)
    argv = ["decode", "z.safetensors", "--model", str(wan_folder), "--out", "fr/f{:04d}.png", "--tile", "2",
            "--quiet"]
    proc = subprocess.Popen([sys.executable, "-m", "tilewise.cli", *argv], cwd=work, env=_env(stage),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait(proc, lambda: any(p.name.endswith(".part") for p in (work / "fr").iterdir()), "a frame's .part")
        proc.send_signal(signum)
        out, err = proc.communicate(timeout=LIMIT)
    finally:
        proc.kill()
    assert proc.returncode == code, err
    assert f"interrupted ({signal.Signals(signum).name})" in err and "Traceback" not in err
    assert [p.name for p in (work / "fr").iterdir()] == ["f0000.png"], "a frame or a temporary was left"
    assert (work / "fr" / "f0000.png").read_bytes() == mine


@pytest.mark.usefixtures("quiet_diffusers")
def test_full_disk_while_writing_frames_keeps_the_users_frame(tmp_path, tmpfs, wan_folder, monkeypatch,
                                                              capsys):
    disk = tmpfs("full", "size=64k")
    _video_latents(tmp_path / "z.safetensors", 2, 8, 8)  # 5 frames of 64 x 64 x 3 float32, 48 KiB each
    (disk / "f00.npy").write_bytes(b"the user's frame")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        main(["decode", "z.safetensors", "--model", str(wan_folder), "--out", str(disk / "f{:02d}.npy"),
              "--bits", "32", "--tile", "4", "--quiet"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 4, err
    assert "no space left on the device while writing" in err and str(disk / "f0") in err
    assert "Traceback" not in err
    assert [p.name for p in disk.iterdir()] == ["f00.npy"]
    assert (disk / "f00.npy").read_bytes() == b"the user's frame"


@pytest.mark.usefixtures("quiet_diffusers")
def test_read_only_folder_of_a_frame_pattern_is_refused_before_the_model_loads(tmp_path, tmpfs, wan_folder,
                                                                               monkeypatch, capsys):
    ro = tmpfs("ro", "ro,size=64k")
    _video_latents(tmp_path / "z.safetensors", 2, 3, 4)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("tilewise.pipelines.load_vae", lambda *a, **k: pytest.fail("the model was loaded"))
    with pytest.raises(SystemExit) as exit_info:
        main(["decode", "z.safetensors", "--model", str(wan_folder), "--out", str(ro / "f{:02d}.png")])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2, err
    assert "read-only file system" in err and str(ro / "f00.png") in err and "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ro", "z.safetensors"]


def test_an_output_larger_than_the_free_disk_is_refused_before_the_model_loads(tmp_path, tmpfs, monkeypatch,
                                                                               capsys):
    disk = tmpfs("small", "size=64k")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("tilewise.pipelines.load_pipeline",
                        lambda *a, **k: pytest.fail("the model was loaded"))
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--prompt", "grass", "--width", "256", "--height", "256", "--out",
              str(disk / "o.npy")])
    err = capsys.readouterr().err
    assert exit_info.value.code == 4, err
    assert "o.npy" in err and "needs at least 192.00 KiB of disk" in err and "64.00 KiB is free" in err
    assert not list(disk.iterdir())


# -- --nproc: a signal stops every rank, one line, nothing left --------------------------------------

_GLOO = torch.distributed.is_available() and torch.distributed.is_gloo_available()


@pytest.mark.skipif(not _GLOO, reason="torch.distributed with gloo is needed for --nproc")
def test_sigterm_to_a_two_rank_launch_ends_in_one_line_and_leaves_no_torchelastic_folder(tmp_path):
    """The issue: a SIGTERM to `--nproc 2` printed torchrun's SignalException traceback and a line per rank,
    and left torchelastic_* folders in the temporary folder."""
    work, stage = tmp_path / "work", tmp_path / "stage"
    work.mkdir()
    stage.mkdir()
    argv = ["generate", "--prompt", "grass", "--width", "512", "--height", "256", "--steps", "50", "--out",
            "o.png", "--nproc", "2"]
    env = dict(_env(stage), OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "tilewise.cli", *argv], cwd=work, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        log = []

        def denoising():  # every rank logs this line right before its first UNet call
            log.append(proc.stderr.readline())
            return "tiles of" in log[-1] and "latent px per call" in log[-1]

        _wait(proc, denoising, "the ranks' denoising log line")
        time.sleep(1)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=LIMIT)
    finally:
        proc.kill()
    err = "".join(log) + err
    assert proc.returncode == 143, err
    assert err.count("interrupted (SIGTERM)") == 1 and "Traceback" not in err and "SignalException" not in err
    assert not [p.name for p in stage.iterdir() if p.name.startswith(("torchelastic_", "tilewise-"))]
    assert not list(work.iterdir())
