"""Catalogue of bad input and faults through the Python API (issue 20): each is refused at the call with
the exception of its kind naming the value, before any work, and leaves no file behind."""

import errno
import logging
import signal

import numpy as np
import pytest
import torch
from PIL import Image
from tiny_sd import unet_config, vae_config

import tilewise as tw
from tilewise import limits
from tilewise.errors import EXIT_CODES, BadInputFile, BadRequest, Interrupted, ModelProblem, WontFit


@pytest.fixture(scope="module")
def vae():
    from diffusers import AutoencoderKL

    torch.manual_seed(0)
    return AutoencoderKL(**vae_config()).eval()


@pytest.fixture(scope="module")
def unet():
    from diffusers import UNet2DConditionModel

    torch.manual_seed(0)
    return UNet2DConditionModel(**unet_config(32)).eval()


def _z(*shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(0))


def _nan(t, index):
    t = t.clone()
    t[index] = float("nan")
    return t


# -- TiledVAE: the input at the call ------------------------------------------------------------------

@pytest.mark.parametrize("z,needles", [
    (_z(1, 4, 12, 12).half(), ["torch.float16", "torch.float32", "z.to(torch.float32)"]),
    (_z(1, 4, 12, 12).double(), ["torch.float64", "z.to(torch.float32)"]),
    (_z(1, 4, 12, 12).to(torch.int32), ["torch.int32", "floating-point"]),
    (_nan(_z(1, 4, 12, 12), (0, 1, 2, 3)), ["1 NaN", "(0, 1, 2, 3)", "before any VAE op"]),
    (_z(1, 3, 12, 12), ["3 channels", "expects 4"]),
    (_z(1, 4, 0, 12), ["empty"]),
    (_z(4, 12, 12), ["(B, C, H, W)", "(4, 12, 12)"]),
], ids=["float16", "float64", "int32", "nan", "3-channels", "empty", "3d"])
def test_tiled_vae_refuses_bad_latents_at_the_call(vae, z, needles):
    tv = tw.TiledVAE(vae, tile_size=4, progress=False)
    with pytest.raises(ValueError) as err:
        tv.decode(z)
    for n in needles:
        assert n in str(err.value)


@pytest.mark.parametrize("vae_on_meta,z_on_meta", [(True, False), (False, True), (True, True)],
                         ids=["meta-vae", "meta-latent", "both-meta"])
def test_meta_device_is_refused_at_the_call(vae, vae_on_meta, z_on_meta):
    """A meta VAE given a real latent used to run on no data and blame NaN on its first convolution."""
    from diffusers import AutoencoderKL

    if vae_on_meta:
        with torch.device("meta"):
            vae = AutoencoderKL(**vae_config())
    z = _z(1, 4, 16, 16).to("meta" if z_on_meta else "cpu")
    with pytest.raises(ValueError, match="on the meta device .no data.: TiledVAE can plan there") as err:
        tw.TiledVAE(vae, tile_size=8).decode(z)
    assert ("latent z is" if z_on_meta else "the VAE's weights are") in str(err.value)


def test_nan_latent_is_not_blamed_on_fp16_overflow(vae):
    """The issue: a NaN in float32 latents was reported as 'fp16 VAE overflow'."""
    tv = tw.TiledVAE(vae, tile_size=4, progress=False)
    with pytest.raises(ValueError) as err:
        tv.decode(_nan(_z(1, 4, 12, 12), (0, 0, 5, 5)))
    assert "overflow" not in str(err.value) and "NaN" in str(err.value)


def test_nan_weights_in_float32_are_not_called_an_fp16_overflow(vae):
    import copy

    from tilewise.vae.run.finite import NonFiniteError

    broken = copy.deepcopy(vae)
    with torch.no_grad():
        broken.decoder.conv_in.weight[0, 0, 0, 0] = float("nan")
    with pytest.raises(NonFiniteError) as err:
        tw.TiledVAE(broken, tile_size=4, progress=False).decode(_z(1, 4, 12, 12))
    assert "not an fp16 overflow" in str(err.value) and "SD-VAE overflow" not in str(err.value)


def test_inf_in_an_image_to_encode(vae):
    x = _z(1, 3, 32, 32).clamp(-1, 1)
    x[0, 0, 1, 1] = float("inf")
    with pytest.raises(ValueError, match=r"image x .* 0 NaN and 1 inf"):
        tw.TiledVAE(vae, tile_size=2, progress=False).encode(x)


@pytest.mark.parametrize("kwargs,needle", [
    ({"tile_size": 0}, "tile_size"), ({"mode": "bogus"}, "'bogus'"), ({"staging": "ram"}, "'ram'"),
    ({"memory_budget": "lots"}, "'lots'"), ({"fast_sample": 2.0}, "2.0"),
])
def test_tiled_vae_settings(vae, kwargs, needle):
    with pytest.raises(ValueError) as err:
        tw.TiledVAE(vae, **kwargs)
    assert needle in str(err.value)


def test_decode_to_a_sink_of_the_wrong_size_leaves_no_file(vae, tmp_path):
    tv = tw.TiledVAE(vae, tile_size=4, progress=False)
    with pytest.raises(ValueError, match="sink is 64x64 but the decoded image is 96x96"):
        with tw.open_sink(tmp_path / "o.png", 64, 64, 3) as sink:
            tv.decode_to(_z(1, 4, 12, 12), sink)
    assert not list(tmp_path.iterdir())


# -- won't fit: refused with the figure, before anything is allocated --------------------------------

def test_decode_whose_staging_cannot_fit_in_memory_is_refused(vae, monkeypatch):
    monkeypatch.setattr(limits, "host_memory_available", lambda: 64 << 10)
    monkeypatch.setattr("tilewise.vae.checks.host_memory_available", lambda: 64 << 10)
    tv = tw.TiledVAE(vae, tile_size=4, staging="host", progress=False)
    with pytest.raises(WontFit) as err:
        tv.decode(_z(1, 4, 12, 12))
    assert "staging 'host'" in str(err.value) and "KiB" in str(err.value) and "disk" in str(err.value)


def test_disk_staging_that_cannot_fit_the_disk_is_refused(vae, monkeypatch, tmp_path):
    monkeypatch.setattr("tilewise.vae.checks.host_memory_available", lambda: 64 << 10)
    monkeypatch.setattr(limits, "disk_free", lambda folder: 1024)
    tv = tw.TiledVAE(vae, tile_size=4, staging="disk", stage_dir=str(tmp_path), progress=False)
    with pytest.raises(WontFit) as err:
        tv.decode(_z(1, 4, 12, 12))
    assert str(tmp_path) in str(err.value) and "1.00 KiB is free" in str(err.value)
    assert not list(tmp_path.iterdir())


def test_tilegrid_of_a_million_squared_is_refused_with_a_tile_that_fits(monkeypatch):
    monkeypatch.setattr(limits, "host_memory_available", lambda: 8 << 30)
    with pytest.raises(WontFit) as err:
        tw.TileGrid(10**6, 10**6, 64)
    text = str(err.value)
    assert "244140625 tiles" in text and "8.00 GiB" in text and "tile_size of at least" in text
    side = int(text.split("at least ")[1].split()[0])
    n = -(-(10**6 - 64) // side + 1)
    assert (n * n) * 600 <= 8 << 30  # the suggested tile does fit


def test_generate_of_ten_million_squared_is_refused_before_denoising(monkeypatch):
    from tilewise.pipelines import generate, load_pipeline

    called = []
    loaded = load_pipeline(None)
    monkeypatch.setattr(loaded, "encode", lambda *a: called.append(a))
    with pytest.raises(WontFit) as err:
        generate(loaded, "grass", 10**7, 10**7)
    assert "10000000x10000000" in str(err.value) and "would fit" in str(err.value) and not called


@pytest.mark.parametrize("kwargs,needle", [
    ({"inversion_steps": 10**9}, "inversion_steps must be an int in [0, 1000]"),
    ({"inversion_steps": -1}, "inversion_steps must be an int in [0, 1000]"),
    ({"inversion_steps": 2.5}, "got 2.5"),
    ({"num_inference_steps": 10**6}, "num_inference_steps must be an int in [1, 1000]"),
], ids=["inversion-billion", "inversion-negative", "inversion-float", "steps-million"])
def test_upscale_counts_are_bounded_from_python_before_any_work(kwargs, needle):
    """The CLI's ranges hold from Python too: a billion inversion steps would grow memory for hours."""
    from tilewise.diffusion import UpscaleOptions

    with pytest.raises(ValueError) as err:
        UpscaleOptions(**kwargs)
    assert needle in str(err.value)


def test_generate_steps_are_bounded_from_python():
    from tilewise.pipelines.options import GenerateOptions

    with pytest.raises(ValueError, match=r"steps must be an int in \[1, 1000\].*got 0"):
        GenerateOptions("grass", 64, 64, steps=0)


@pytest.mark.parametrize("room,refused", [(10 << 30, False), (1 << 20, True)])
def test_check_memory(monkeypatch, room, refused):
    monkeypatch.setattr(limits, "host_memory_available", lambda: room)
    if refused:
        with pytest.raises(WontFit, match=r"the thing needs at least 2.00 MiB of host memory but 1.00 MiB"):
            limits.check_memory(2 << 20, "the thing")
    else:
        limits.check_memory(2 << 20, "the thing")


# -- TiledDenoiser and the probe ---------------------------------------------------------------------

@pytest.mark.parametrize("sample,needles", [
    (_z(1, 3, 16, 16), ["3 channels", "takes 4"]),
    (_z(1, 4, 0, 16), ["empty", "(1, 4, 0, 16)"]),
    (_z(0, 4, 16, 16), ["empty", "(0, 4, 16, 16)"]),
    (_z(1, 4, 16, 16).long(), ["torch.int64", "floating point"]),
    (_z(4, 16, 16), ["(4, 16, 16)"]),
], ids=["3-channels", "empty-height", "empty-batch", "int", "3d"])
def test_tiled_denoiser_refuses_bad_samples(unet, sample, needles):
    td = tw.TiledDenoiser(unet, tile_size=8, overlap=4)
    with pytest.raises(ValueError) as err:
        td(sample, 10, encoder_hidden_states=_z(1, 5, 32))
    for n in needles:
        assert n in str(err.value)


def test_probe_refuses_a_nan_example(vae):
    with pytest.raises(ValueError, match=r"holds 1 NaN or inf values: NaN != NaN"):
        tw.probe_receptive_field(vae.decoder, _nan(_z(1, 4, 12, 12), (0, 0, 3, 3)))


def test_probe_refuses_a_module_whose_output_is_nan():
    class Broken(torch.nn.Module):
        def forward(self, x):
            return x * float("nan")

    with pytest.raises(ValueError, match="gives NaN or inf outputs"):
        tw.probe_receptive_field(Broken(), _z(1, 1, 8, 8))


def test_bucket_request_of_zero():
    with pytest.raises(ValueError, match="width must be a positive integer, got 0"):
        tw.BucketPlanner(area=256 * 256, step=32).assign(0, 600)


# -- inputs read at their depth, or refused naming the file ------------------------------------------

def _png16(path, arr, filt):
    """A 16-bit PNG whose rows all use PNG filter `filt` (3 average, 4 Paeth), written by hand."""
    import zlib

    from tilewise.sinks import png_chunk

    h, w, c = arr.shape
    raw = arr.astype(">u2").view(np.uint8).reshape(h, -1).astype(int)
    bpp, prior, lines = 2 * c, np.zeros(raw.shape[1], int), []
    for y in range(h):
        cur, out = raw[y], []
        for i in range(len(cur)):
            a, b = (cur[i - bpp] if i >= bpp else 0), prior[i]
            cc = prior[i - bpp] if i >= bpp else 0
            if filt == 3:
                pred = (a + b) // 2
            else:
                p = a + b - cc
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - cc)
                pred = a if pa <= pb and pa <= pc else b if pb <= pc else cc
            out.append((cur[i] - pred) & 255)
        lines.append(bytes([filt]) + bytes(out))
        prior = cur
    ihdr = w.to_bytes(4, "big") + h.to_bytes(4, "big") + bytes([16, {1: 0, 2: 4, 3: 2, 4: 6}[c], 0, 0, 0])
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", ihdr) + png_chunk(b"IDAT", zlib.compress(
        b"".join(lines))) + png_chunk(b"IEND", b""))


@pytest.mark.parametrize("filt", ["none", "sub", "up", 3, 4])
def test_16_bit_colour_png_is_read_at_its_depth(tmp_path, filt):
    """Pillow reads a 16-bit RGB PNG as 8-bit RGB (the low byte dropped); tilewise keeps all 16 bits."""
    from tilewise.sources import read_image

    rgb = np.random.default_rng(1).integers(0, 65536, (12, 10, 3)).astype(np.uint16)
    path = tmp_path / "c16.png"
    if isinstance(filt, int):
        _png16(path, rgb, filt)
    else:
        with tw.PNGSink(path, 12, 10, 3, "uint16", png_filter=filt) as s:
            s.write(0, 0, rgb)
    pic = read_image(path)
    assert pic.bits == 16 and pic.pixels.dtype == np.uint16 and np.array_equal(pic.pixels, rgb)
    with Image.open(path) as im:  # the reason: Pillow's own reading loses the low byte
        assert np.asarray(im).dtype == np.uint8


def test_16_bit_grey_png_keeps_its_levels_and_16_bit_tiff_too(tmp_path):
    import tifffile

    from tilewise.sources import read_image

    grey = (np.arange(32 * 32).reshape(32, 32) * 64).astype(np.uint16)
    Image.fromarray(grey).save(tmp_path / "g.png")
    tifffile.imwrite(tmp_path / "g.tif", grey)
    for name in ("g.png", "g.tif"):
        pic = read_image(tmp_path / name)
        assert pic.bits == 16 and all(np.array_equal(pic.pixels[..., k], grey) for k in range(3))
        x = pic.tensor()
        assert x.min() == -1 and abs(float(x.max()) - (65472 / 32767.5 - 1)) < 1e-6  # not clipped to white


def test_alpha_is_kept_apart_with_a_warning_when_not_opaque(tmp_path, caplog):
    from tilewise.sources import read_image

    rgba = np.random.default_rng(2).integers(0, 256, (8, 8, 4), dtype=np.uint8)
    rgba[..., 3] = 255
    rgba[0, 0, 3] = 0
    Image.fromarray(rgba).save(tmp_path / "a.png")
    with caplog.at_level(logging.WARNING):
        pic = read_image(tmp_path / "a.png")
    assert np.array_equal(pic.pixels, rgba[..., :3]) and np.array_equal(pic.alpha, rgba[..., 3])
    assert "alpha is not used" in caplog.text


@pytest.mark.parametrize("make,needle", [
    (lambda p: p.write_bytes(b""), "is empty"),
    (lambda p: p.mkdir(), "is a folder"),
    (lambda p: p.write_bytes(b"\x89PNG\r\n\x1a\n" + b"\0" * 40), "not"),
    (lambda p: __import__("tifffile").imwrite(p, np.zeros((4, 4, 3), np.int32)), "int32"),
    (lambda p: __import__("tifffile").imwrite(p, np.zeros((2, 3, 4, 4), np.uint8)), "shape (2, 3, 4, 4)"),
], ids=["empty", "folder", "broken-png", "int32-tiff", "4d-tiff"])
def test_bad_images_are_refused_naming_the_file(tmp_path, make, needle):
    from tilewise.sources import read_image

    path = tmp_path / "bad.tif"
    make(path)
    with pytest.raises(BadInputFile) as err:
        read_image(path)
    assert "bad.tif" in str(err.value) and needle in str(err.value)


def test_truncated_16_bit_png_is_refused(tmp_path):
    from tilewise.sources import read_image

    with tw.PNGSink(tmp_path / "c.png", 16, 16, 3, "uint16") as s:
        s.write(0, 0, np.ones((16, 16, 3), np.uint16))
    data = (tmp_path / "c.png").read_bytes()
    (tmp_path / "c.png").write_bytes(data[:60])
    with pytest.raises(BadInputFile, match=r"'.*c.png' is truncated"):
        read_image(tmp_path / "c.png")


def test_encode_file_refuses_an_image_suffix_before_encoding(tmp_path, monkeypatch):
    from tilewise.pipelines import encode_file, load_pipeline

    loaded = load_pipeline(None)
    Image.new("RGB", (16, 16)).save(tmp_path / "in.png")
    monkeypatch.setattr("tilewise.pipelines.recipes.load_image", lambda *a: pytest.fail("read the image"))
    with pytest.raises(BadRequest, match=r"lat.png.*\.safetensors"):
        encode_file(loaded, str(tmp_path / "in.png"), str(tmp_path / "lat.png"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.png"]


def test_malformed_model_index_is_a_model_problem(tmp_path):
    from tilewise.pipelines import load_pipeline

    (tmp_path / "model_index.json").write_text("{not json")
    with pytest.raises(ModelProblem, match=r"model_index.json' is not valid JSON"):
        load_pipeline(tmp_path)


# -- outputs: checked first, replaced only when complete, never clobbered with replace=False ----------

def test_check_target_refusals(tmp_path):
    from tilewise.atomic import check_target

    (tmp_path / "f.txt").write_text("x")
    (tmp_path / "old.png").write_bytes(b"old")
    for path, needle in ((tmp_path / "no" / "o.png", "does not exist"), (tmp_path, "is a folder"),
                         (tmp_path / "f.txt" / "o.png", "is a file, not a folder"),
                         ("", "empty path")):
        with pytest.raises(BadRequest, match=needle):
            check_target(path)
    with pytest.raises(BadRequest, match="replacing it was refused"):
        check_target(tmp_path / "old.png", replace=False)
    check_target(tmp_path / "new.png")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.txt", "old.png"]


def test_no_clobber_holds_even_when_the_file_appears_while_writing(tmp_path):
    target = tmp_path / "o.png"
    with pytest.raises(BadRequest, match="appeared while it was being written"):
        with tw.open_sink(target, 4, 4, 3, replace=False) as sink:
            sink.write(0, 0, np.zeros((4, 4, 3), np.uint8))
            target.write_bytes(b"someone else's")
    assert target.read_bytes() == b"someone else's"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o.png"]


def test_open_sink_refuses_unknown_suffix_and_bits(tmp_path):
    with pytest.raises(BadRequest, match=r"'.jpg' is not one of"):
        tw.open_sink(tmp_path / "o.jpg", 4, 4)
    with pytest.raises(BadRequest, match="bits=32 is not valid for .png"):
        tw.open_sink(tmp_path / "o.png", 4, 4, bits=32)
    assert not list(tmp_path.iterdir())


def test_an_error_while_writing_names_the_users_path_not_the_temporary(tmp_path, monkeypatch):
    sink = tw.open_sink(tmp_path / "o.npy", 4, 4, 3)

    def full(*a):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(sink, "_put", full)
    with pytest.raises(OSError) as err:
        with sink:
            sink.write(0, 0, np.zeros((4, 4, 3), np.uint8))
    assert err.value.filename == str(tmp_path / "o.npy") and not list(tmp_path.iterdir())


# -- the taxonomy and how the CLI reports each kind ---------------------------------------------------

def test_exit_codes_of_the_taxonomy():
    assert EXIT_CODES == {"success": 0, "internal": 1, "bad request": 2, "bad input file": 3, "won't fit": 4,
                          "model problem": 5, "some failed": 6, "interrupted (SIGINT)": 130,
                          "terminated (SIGTERM)": 143}
    assert Interrupted(signal.SIGTERM).exit_code == 143 and str(Interrupted(signal.SIGINT)) == \
        "interrupted by SIGINT"
    assert all(issubclass(k, ValueError) for k in (BadRequest, BadInputFile, WontFit, ModelProblem))


@pytest.mark.parametrize("exc,code,needle", [
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), 4, "out of memory: CUDA"),
    (MemoryError(), 4, "out of memory"),
    (OSError(errno.ENOSPC, "No space left on device", "o.npy"), 4, "no space left on the device while "
                                                                    "writing 'o.npy'"),
    (RuntimeError("Error while serializing: I/O error: No space left on device (os error 28)"), 4,
     "os error"),
    (KeyboardInterrupt(), 130, "interrupted (SIGINT)"),
    (Interrupted(signal.SIGTERM), 143, "interrupted (SIGTERM)"),
    (ValueError("bad value 7\nsecond line"), 2, "bad value 7; second line"),
    (BadInputFile("broken"), 3, "error: broken"),
    (ModelProblem("no weights"), 5, "error: no weights"),
    (ZeroDivisionError("division by zero"), 1, "internal error, ZeroDivisionError"),
], ids=["cuda-oom", "memory-error", "enospc", "enospc-text", "ctrl-c", "sigterm", "value", "input", "model",
        "internal"])
def test_cli_reports_each_kind_in_one_line(exc, code, needle):
    from tilewise.cli.failures import exit_code, message

    line = message(exc, [])
    assert exit_code(exc) == code and needle in line and "\n" not in line

