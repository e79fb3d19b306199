"""Catalogue of faults around the 3-D VAEs (issue 33): frame patterns and stacks as outputs, videos as
inputs, 3-D VAE folders, run in process on a tiny Wan 2.1 VAE folder.

Every case asserts the exit code of its kind, one `error:` line naming the value, no traceback, and that
the working folder and the inputs hold exactly what they held (the user's frames untouched, no output,
no temporary). A few controls run to success where a file is replaced or a value is taken with a warning.
"""

import json
import logging

import numpy as np
import pytest
import torch
from faults_support import BAD_INPUT, BAD_REQUEST, MODEL, listing, refused, run
from faults_support import quiet_diffusers as _quiet  # noqa: F401 (a fixture, used by name below)
from PIL import Image
from safetensors.torch import save_file
from video_vae_support import video_vae

import tilewise as tw

pytestmark = pytest.mark.usefixtures("_quiet")


def _png(path, h=16, w=24, seed=0):
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)).save(path)


@pytest.fixture(scope="module")
def D(tmp_path_factory):
    """The inputs (latents, frame folders, stacks) and the model folders, made once."""
    import tifffile
    from diffusers import AutoencoderKL
    from tiny_sd import vae_config

    d = tmp_path_factory.mktemp("video-inputs")
    video_vae("wan2.1").save_pretrained(d / "wan")
    torch.manual_seed(0)
    AutoencoderKL(**vae_config()).save_pretrained(d / "kl")
    g = torch.Generator().manual_seed(0)
    save_file({"latents": torch.randn(1, 4, 2, 3, 4, generator=g)}, str(d / "zv.safetensors"))
    save_file({"latents": torch.randn(1, 4, 1, 3, 4, generator=g)}, str(d / "z1.safetensors"))
    save_file({"latents": torch.randn(1, 3, 2, 3, 4, generator=g)}, str(d / "c3.safetensors"))
    zn = torch.randn(1, 4, 2, 3, 4, generator=g)
    zn[0, 1, 1, 2, 3] = float("nan")
    save_file({"latents": zn}, str(d / "nan.safetensors"))
    save_file({"latents": torch.randn(1, 1, 4, 2, 3, 4, generator=g)}, str(d / "6d.safetensors"))
    save_file({"latents": torch.randn(2, 4, 2, 3, 4, generator=g)}, str(d / "b2.safetensors"))
    save_file({"latents": torch.zeros(1, 4, 2, 3, 4, dtype=torch.int32)}, str(d / "int.safetensors"))
    for name, frames in {"ok": 5, "gap": (0, 1, 3), "mixed": 2, "depth": 2, "trunc": 2, "notimg": 2}.items():
        (d / name).mkdir()
        for i in (range(frames) if isinstance(frames, int) else frames):
            _png(d / name / f"f{i:02d}.png", seed=i)
    _png(d / "mixed" / "f01.png", h=24)
    with tw.PNGSink(d / "depth" / "f01.png", 16, 24, 3, "uint16") as s:
        s.write(0, 0, np.full((16, 24, 3), 1000, np.uint16))
    data = (d / "trunc" / "f01.png").read_bytes()
    (d / "trunc" / "f01.png").write_bytes(data[: len(data) // 2])
    (d / "notimg" / "f01.png").write_text("not a frame\n")
    rng = np.random.default_rng(1)
    np.save(d / "big.npy", rng.uniform(0, 255, (5, 16, 24, 3)).astype(np.float32))
    nan = rng.uniform(-1, 1, (5, 16, 24, 3)).astype(np.float32)
    nan[2, 3, 4, 1] = np.nan
    np.save(d / "nan.npy", nan)
    np.save(d / "over.npy", rng.uniform(-1.1, 1.1, (5, 16, 24, 3)).astype(np.float32))
    (d / "junk.npy").write_bytes(b"\x93NUMPY garbage, not an array header" * 3)
    (d / "empty.npy").write_bytes(b"")
    np.save(d / "int32.npy", rng.integers(0, 255, (5, 16, 24, 3)).astype(np.int32))
    np.save(d / "c4.npy", rng.integers(0, 255, (5, 16, 24, 4)).astype(np.uint8))
    np.save(d / "odd.npy", rng.integers(0, 255, (5, 12, 20, 3)).astype(np.uint8))
    (d / "corrupt.tif").write_bytes(b"II*\x00" + b"\xff" * 60)
    with tifffile.TiffWriter(d / "mixed.tif") as tif:
        tif.write(np.zeros((16, 24, 3), np.uint8), photometric="rgb")
        tif.write(np.zeros((24, 24, 3), np.uint8), photometric="rgb")
    return d


def _user_files(cwd, names):
    for name in names:
        (cwd / name).parent.mkdir(parents=True, exist_ok=True)
        (cwd / name).write_bytes(f"the user's own {name}".encode())
    (cwd / "file.txt").write_text("a file\n")


DEC = ["decode", "{D}/zv.safetensors", "--model", "{D}/wan", "--tile", "2", "--quiet"]
ENC = ["--model", "{D}/wan", "--tile", "2", "--quiet"]
# name: (the user's files in the working folder, argv ({D}: the inputs), exit code, texts of the one line)
CASES = {
    # outputs of a video decode
    "pattern-no-clobber-first": (["f00.png"], DEC + ["--out", "f{:02d}.png", "--no-clobber"], BAD_REQUEST,
                                 ["frame 'f00.png' exists", "--no-clobber"]),
    "pattern-no-clobber-later": (["f03.png"], DEC + ["--out", "f{:02d}.png", "--no-clobber"], BAD_REQUEST,
                                 ["1 of the 5 frames", "'f03.png'", "--no-clobber"]),
    "pattern-no-clobber-two": (["fr/f01.png", "fr/f04.png"], DEC + ["--out", "fr/f{:02d}.png",
                                                                      "--no-clobber"], BAD_REQUEST,
                               ["fr/f01.png", "--no-clobber"]),
    "npy-stack-no-clobber": (["v.npy"], DEC + ["--out", "v.npy", "--no-clobber"], BAD_REQUEST,
                             ["v.npy", "--no-clobber"]),
    "tif-stack-no-clobber": (["v.tif"], DEC + ["--out", "v.tif", "--no-clobber"], BAD_REQUEST,
                             ["v.tif", "--no-clobber"]),
    "one-frame-no-clobber": (["one.png"], ["decode", "{D}/z1.safetensors", "--model", "{D}/wan", "--out",
                                           "one.png", "--no-clobber"], BAD_REQUEST,
                             ["one.png", "--no-clobber"]),
    "pattern-two-fields": ([], DEC + ["--out", "f{}{}.png"], BAD_REQUEST, ["f{}{}.png", "frame pattern"]),
    "pattern-named-field": ([], DEC + ["--out", "f{n}.png"], BAD_REQUEST, ["f{n}.png", "'n'"]),
    "pattern-bad-spec": ([], DEC + ["--out", "f{:q}.png"], BAD_REQUEST, ["f{:q}.png"]),
    "pattern-folder-missing": ([], DEC + ["--out", "nodir/f{:02d}.png"], BAD_REQUEST,
                               ["'nodir' does not exist"]),
    "pattern-folder-is-file": ([], DEC + ["--out", "file.txt/f{:02d}.png"], BAD_REQUEST,
                               ["file.txt", "not a folder"]),
    "pattern-jpg": ([], DEC + ["--out", "f{:02d}.jpg"], BAD_REQUEST, ["'.jpg'"]),
    "pattern-bits-32": ([], DEC + ["--out", "f{:02d}.png", "--bits", "32"], BAD_REQUEST,
                        ["--bits 32", "f{:02d}.png"]),
    "stack-bits-7": ([], DEC + ["--out", "v.npy", "--bits", "7"], BAD_REQUEST, ["--bits 7"]),
    "video-to-one-png": ([], DEC + ["--out", "v.png"], BAD_REQUEST, ["makes 5 frames", "'v.png'"]),
    "video-no-suffix": ([], DEC + ["--out", "frames"], BAD_REQUEST, ["'frames'", "no suffix"]),
    "video-budget": ([], DEC + ["--out", "v.npy", "--budget", "lots"], BAD_REQUEST, ["--budget 'lots'"]),
    "video-out-is-folder": (["dir/x"], DEC + ["--out", "dir"], BAD_REQUEST, ["'dir'"]),
    # latents of a video decode
    "latents-3-channels": ([], ["decode", "{D}/c3.safetensors", "--model", "{D}/wan", "--out", "v.npy"],
                           BAD_INPUT, ["c3.safetensors", "3 channels"]),
    "latents-nan": ([], ["decode", "{D}/nan.safetensors", "--model", "{D}/wan", "--out", "v.npy"], BAD_INPUT,
                    ["nan.safetensors", "1 NaN", "(0, 1, 1, 2, 3)"]),
    "latents-6d": ([], ["decode", "{D}/6d.safetensors", "--model", "{D}/wan", "--out", "v.npy"], BAD_INPUT,
                   ["6d.safetensors", "[1, 1, 4, 2, 3, 4]"]),
    "latents-batch-2": ([], ["decode", "{D}/b2.safetensors", "--model", "{D}/wan", "--out", "v.npy"],
                        BAD_INPUT, ["b2.safetensors", "[2, 4, 2, 3, 4]"]),
    "latents-int": ([], ["decode", "{D}/int.safetensors", "--model", "{D}/wan", "--out", "v.npy"], BAD_INPUT,
                    ["int.safetensors", "I32"]),
    "latents-missing": ([], ["decode", "gone.safetensors", "--model", "{D}/wan", "--out", "v.npy"],
                        BAD_REQUEST, ["gone.safetensors", "does not exist"]),
    "2d-folder-to-pattern": ([], ["decode", "{D}/z1.safetensors", "--model", "{D}/kl", "--out",
                                  "f{:02d}.png"], BAD_REQUEST, ["f{:02d}.png", "frame pattern"]),
    "2d-folder-video-latents": ([], ["decode", "{D}/zv.safetensors", "--model", "{D}/kl", "--out", "o.npy"],
                                BAD_INPUT, ["zv.safetensors", "[1, 4, 2, 3, 4]"]),
    # videos to encode
    "encode-gap": ([], ["encode", "{D}/gap/f{:02d}.png", "--out", "z.safetensors"] + ENC, BAD_INPUT,
                   ["has a gap", "f02.png", "f03.png"]),
    "encode-mixed-sizes": ([], ["encode", "{D}/mixed/f{:02d}.png", "--out", "z.safetensors"] + ENC, BAD_INPUT,
                           ["mixed/f01.png", "24x24", "24x16", "one size"]),
    "encode-mixed-depths": ([], ["encode", "{D}/depth/f{:02d}.png", "--out", "z.safetensors"] + ENC,
                            BAD_INPUT, ["depth/f01.png", "[8, 16] bits"]),
    "encode-truncated-frame": ([], ["encode", "{D}/trunc/f{:02d}.png", "--out", "z.safetensors"] + ENC,
                               BAD_INPUT, ["trunc/f01.png", "truncated"]),
    "encode-frame-not-image": ([], ["encode", "{D}/notimg/f{:02d}.png", "--out", "z.safetensors"] + ENC,
                               BAD_INPUT, ["notimg/f01.png", "not an image"]),
    "encode-float-0-255": ([], ["encode", "{D}/big.npy", "--out", "z.safetensors"] + ENC, BAD_INPUT,
                           ["big.npy", "must lie in [-1, 1]"]),
    "encode-float-nan": ([], ["encode", "{D}/nan.npy", "--out", "z.safetensors"] + ENC, BAD_INPUT,
                         ["nan.npy", "1 NaN or inf"]),
    "encode-npy-junk": ([], ["encode", "{D}/junk.npy", "--out", "z.safetensors"] + ENC, BAD_INPUT,
                        ["junk.npy", "not a readable .npy"]),
    "encode-npy-empty": ([], ["encode", "{D}/empty.npy", "--out", "z.safetensors"] + ENC, BAD_INPUT,
                         ["empty.npy", "empty"]),
    "encode-npy-int32": ([], ["encode", "{D}/int32.npy", "--out", "z.safetensors"] + ENC, BAD_INPUT,
                         ["int32.npy", "int32"]),
    "encode-npy-4-channels": ([], ["encode", "{D}/c4.npy", "--out", "z.safetensors"] + ENC, BAD_INPUT,
                              ["c4.npy", "(16, 24, 4)"]),
    "encode-npy-odd-size": ([], ["encode", "{D}/odd.npy", "--out", "z.safetensors"] + ENC, BAD_INPUT,
                            ["odd.npy", "20x12", "multiples of 8"]),
    "encode-tif-corrupt": ([], ["encode", "{D}/corrupt.tif", "--out", "z.safetensors"] + ENC, BAD_INPUT,
                           ["corrupt.tif", "TIFF"]),
    "encode-tif-mixed-pages": ([], ["encode", "{D}/mixed.tif", "--out", "z.safetensors"] + ENC, BAD_INPUT,
                               ["mixed.tif page 1", "one size"]),
    "encode-npy-missing": ([], ["encode", "gone.npy", "--out", "z.safetensors"] + ENC, BAD_REQUEST,
                           ["gone.npy", "does not exist"]),
    "encode-first-frame-missing": ([], ["encode", "g{:02d}.png", "--out", "z.safetensors"] + ENC,
                                   BAD_REQUEST, ["g{:02d}.png", "'g00.png' does not exist"]),
    "encode-pattern-named": ([], ["encode", "f{n}.png", "--out", "z.safetensors"] + ENC, BAD_REQUEST,
                             ["f{n}.png", "frame pattern"]),
    "encode-no-clobber": (["z.safetensors"], ["encode", "{D}/ok/f{:02d}.png", "--out", "z.safetensors",
                                              "--no-clobber"] + ENC, BAD_REQUEST,
                          ["z.safetensors", "--no-clobber"]),
    "encode-out-png": ([], ["encode", "{D}/ok/f{:02d}.png", "--out", "z.png"] + ENC, BAD_REQUEST,
                       ["z.png", ".safetensors"]),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_video_fault(name, D, tmp_path, monkeypatch, capsys):
    files, argv, code, needles = CASES[name]
    monkeypatch.chdir(tmp_path)
    _user_files(tmp_path, files)
    refused([a.replace("{D}", str(D)) for a in argv], code, needles, capsys, tmp_path, D)


# -- 3-D VAE folders that are broken, for decode and encode -----------------------------------------

def _broken_wan(D, root, fault):
    """A copy of the Wan VAE folder with one fault."""
    import shutil

    folder = root / f"wan-{fault}"
    shutil.copytree(D / "wan", folder)
    cfg, weights = folder / "config.json", folder / "diffusion_pytorch_model.safetensors"
    if fault == "json":
        cfg.write_text('{"_class_name": "AutoencoderKLWan",')
    elif fault == "list":
        cfg.write_text("[1, 2]")
    elif fault == "no-weights":
        weights.unlink()
    elif fault == "truncated":
        weights.write_bytes(weights.read_bytes()[:3000])
    elif fault == "not-a-vae":
        cfg.write_text(json.dumps({"_class_name": "UNet2DModel"}))
    elif fault == "mismatch":
        data = json.loads(cfg.read_text())
        data["base_dim"] = 16  # the weights hold base_dim 8
        cfg.write_text(json.dumps(data))
    return folder


FOLDER_FAULTS = {"json": ["config.json", "not valid JSON"], "list": ["config.json", "not a JSON object"],
                 "no-weights": ["no weights file"], "truncated": ["truncated or corrupt"],
                 "not-a-vae": ["holds a UNet2DModel", "not a VAE"], "mismatch": ["cannot be loaded"]}


@pytest.mark.parametrize("command", ["decode", "encode"])
@pytest.mark.parametrize("fault", sorted(FOLDER_FAULTS))
def test_broken_3d_vae_folder(command, fault, D, tmp_path, monkeypatch, capsys):
    (tmp_path / "models").mkdir()
    folder = _broken_wan(D, tmp_path / "models", fault)
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    source = str(D / "zv.safetensors") if command == "decode" else str(D / "ok" / "f{:02d}.png")
    out = "f{:02d}.png" if command == "decode" else "z.safetensors"
    refused([command, source, "--model", folder, "--out", out, "--tile", "2", "--quiet"], MODEL,
            [str(folder)] + FOLDER_FAULTS[fault], capsys, work, tmp_path / "models", D)


# -- controls: what is replaced says so; what is taken with a warning is taken ------------------------

def test_frames_that_exist_are_noted_and_replaced_once_all_are_complete(D, tmp_path, monkeypatch, capsys,
                                                                         caplog):
    caplog.set_level(logging.WARNING)
    monkeypatch.chdir(tmp_path)
    _user_files(tmp_path, ["f02.png"])
    code, errors, err = run([a.replace("{D}", str(D)) for a in DEC + ["--out", "f{:02d}.png"]], capsys)
    assert code == 0 and not errors, err
    note = "1 of the 5 frames of 'f{:02d}.png' exist (f02.png): they are replaced once every new frame"
    assert note in caplog.text
    frames = [f"f{i:02d}.png" for i in range(5)]
    assert sorted(p.name for p in tmp_path.iterdir()) == [*frames, "file.txt"]
    assert (tmp_path / "f02.png").read_bytes()[:4] == b"\x89PNG"


def test_a_decodes_float_overshoot_is_taken_with_a_warning(D, tmp_path, monkeypatch, capsys, caplog):
    caplog.set_level(logging.WARNING)
    monkeypatch.chdir(tmp_path)
    argv = ["encode", str(D / "over.npy"), "--out", "z.safetensors", "--model", str(D / "wan"), "--tile", "2"]
    code, errors, err = run(argv, capsys)
    assert code == 0 and not errors, err
    assert "past [-1, 1] by at most 0.25" in caplog.text
    assert [name for name, _, _ in listing(tmp_path)] == ["z.safetensors"]
