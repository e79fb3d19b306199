"""Catalogue of library misuse (issue 33): refused at construction with a ValueError naming the argument
and what would be valid, never a raw torch / diffusers / Python error later, and no file left behind;
multi-file outputs that never remove or damage a file that was there before."""

import errno
import os
import signal

import numpy as np
import pytest
import torch

import tilewise as tw
from tilewise.errors import BadRequest, Interrupted

# -- TiledVAE of what is not a VAE, or not loaded ------------------------------------------------------


def _unet2d():
    from diffusers import UNet2DModel

    return UNet2DModel(sample_size=8, in_channels=4, out_channels=4, block_out_channels=(8, 8),
                       norm_num_groups=4, down_block_types=("DownBlock2D",) * 2,
                       up_block_types=("UpBlock2D",) * 2, layers_per_block=1)


@pytest.mark.parametrize("make,needle", [
    (lambda: torch.nn.Linear(3, 3), "got a Linear"),
    (lambda: torch.nn.Conv2d(4, 3, 3), "got a Conv2d"),
    (lambda: torch.nn.Sequential(torch.nn.Conv2d(4, 4, 1)), "got a Sequential"),
    (_unet2d, "got a UNet2DModel (a denoiser: tile it with tw.TiledDenoiser)"),
], ids=["linear", "conv2d", "sequential", "unet"])
def test_tiled_vae_of_a_module_that_is_not_a_vae(make, needle):
    with pytest.raises(ValueError) as err:
        tw.TiledVAE(make())
    text = str(err.value)
    assert needle in text and "AutoencoderKL" in text and "encoder and a decoder" in text


@pytest.fixture(scope="module")
def vae():
    from diffusers import AutoencoderKL
    from tiny_sd import vae_config

    torch.manual_seed(0)
    return AutoencoderKL(**vae_config()).eval()


@pytest.mark.parametrize("kwargs,needle", [
    ({"retry_on_oom": "yes"}, "retry_on_oom must be True or False, got 'yes'"),
    ({"progress": 1}, "progress must be True or False, got 1"),
    ({"color_fix": None}, "color_fix must be True or False, got None"),
    ({"stage_dir": "/no/such/folder"}, "stage_dir must be None (the system's temporary folder) or an"),
    ({"stage_dir": 5}, "got 5"),
    ({"fast_crop": 0}, "fast_crop must be None (the tile) or a positive int"),
    ({"fast_sample": "0.5"}, "fast_sample must be None"),
    ({"query_chunk": "x"}, "query_chunk must be an int >= 1"),
    ({"tile_size": 2.5}, "tile_size must be a positive int"),
    ({"fast_low": -1}, "fast_low must be an int >= 0"),
], ids=["retry-str", "progress-int", "color-fix-none", "stage-dir-missing", "stage-dir-int", "fast-crop-0",
        "fast-sample-str", "query-chunk-str", "tile-float", "fast-low-negative"])
def test_tiled_vae_settings_are_checked_at_construction(vae, kwargs, needle):
    with pytest.raises(ValueError) as err:
        tw.TiledVAE(vae, **kwargs)
    assert needle in str(err.value)


# -- sinks: refused at construction, nothing left ----------------------------------------------------

def _imagecodecs() -> bool:
    import importlib.util

    return importlib.util.find_spec("imagecodecs") is not None


SINKS = {
    "png-idat-0": (lambda d: tw.PNGSink(d / "o.png", 4, 4, 3, idat_bytes=0), "idat_bytes"),
    "png-path-folder": (lambda d: tw.PNGSink(d, 4, 4, 3), "is a folder"),
    "png-folder-missing": (lambda d: tw.PNGSink(d / "no" / "o.png", 4, 4, 3), "does not exist"),
    "png-5-channels": (lambda d: tw.PNGSink(d / "o.png", 4, 4, 5), "got 5"),
    "png-float": (lambda d: tw.PNGSink(d / "o.png", 4, 4, 3, "float32"), "'uint8', 'uint16'"),
    "png-filter": (lambda d: tw.PNGSink(d / "o.png", 4, 4, 3, png_filter="paeth"), "png_filter"),
    "png-range-empty": (lambda d: tw.PNGSink(d / "o.png", 4, 4, 3, value_range=(1, 1)), "high > low"),
    "tiff-compression": (lambda d: tw.TIFFSink(d / "o.tif", 4, 4, 3, compression="bogus"), "compression"),
    "tiff-queue-0": (lambda d: tw.TIFFSink(d / "o.tif", 4, 4, 3, queue_bands=0), "queue_bands"),
    "tiff-tile-8": (lambda d: tw.TIFFSink(d / "o.tif", 4, 4, 3, tile=8), "multiples of 16"),
    "npy-height-0": (lambda d: tw.MemmapSink(d / "o.npy", 0, 4, 3), "height must be a positive int"),
    "npy-no-path": (lambda d: tw.MemmapSink(None, 4, 4, 3), "give a path"),
    "tensor-device": (lambda d: tw.TensorSink(None, 4, 4, 3, device="bogus"), "device must be a torch"),
    "tensor-path": (lambda d: tw.TensorSink(d / "o", 4, 4, 3), "path must be None"),
    "open-replace-str": (lambda d: tw.open_sink(d / "o.png", 4, 4, 3, replace="no"), "replace must be True"),
    "open-suffix": (lambda d: tw.open_sink(d / "o.gif", 4, 4, 3), "'.gif'"),
    "open-bits-32-png": (lambda d: tw.open_sink(d / "o.png", 4, 4, 3, bits=32), "bits=32"),
    "video-tif-5-channels": (lambda d: tw.open_video_sink(d / "v.tif", 2, 4, 4, 5), "channels=5"),
    "video-png-frames-7": (lambda d: tw.open_video_sink(d / "f{}.png", 2, 4, 4, 7), "channels=7"),
    "video-range-reversed": (lambda d: tw.open_video_sink(d / "v.npy", 2, 4, 4, value_range=(1, -1)),
                             "high > low"),
    "video-replace-str": (lambda d: tw.open_video_sink(d / "v.npy", 2, 4, 4, replace="x"), "replace must be"),
    "video-frames-0": (lambda d: tw.open_video_sink(d / "f{}.png", 0, 4, 4), "frames must be a positive int"),
    "video-bits-12": (lambda d: tw.open_video_sink(d / "v.npy", 2, 4, 4, bits=12), "bits must be 8, 16"),
    "video-pattern-repeats": (lambda d: tw.open_video_sink(d / "f{!s:.1}.png", 12, 4, 4),
                              "names two of its 12"),
    "video-pattern-two-fields": (lambda d: tw.open_video_sink(d / "f{}{}.png", 2, 4, 4), "one {} field"),
    "video-pattern-folder-missing": (lambda d: tw.open_video_sink(d / "no" / "f{}.png", 2, 4, 4),
                                     "does not exist"),
    "video-mp4": (lambda d: tw.open_video_sink(d / "v.mp4", 2, 4, 4), "v.mp4': use a frame pattern"),
}
if not _imagecodecs():
    SINKS["tiff-lzw-without-codecs"] = (lambda d: tw.TIFFSink(d / "o.tif", 4, 4, 3, compression="lzw"),
                                        "need the imagecodecs package")


@pytest.mark.parametrize("name", sorted(SINKS))
def test_sinks_refuse_at_construction_and_leave_nothing(name, tmp_path):
    make, needle = SINKS[name]
    with pytest.raises(ValueError) as err:
        make(tmp_path)
    assert needle in str(err.value), str(err.value)
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("make", [
    lambda d: tw.open_sink(d / "old.png", 4, 4, 3, replace=False),
    lambda d: tw.open_video_sink(d / "g{}.png", 1, 4, 4, replace=False),
    lambda d: tw.open_video_sink(d / "f{}.png", 3, 4, 4, replace=False),
    lambda d: tw.open_video_sink(d / "old.npy", 3, 4, 4, replace=False),
    lambda d: tw.open_video_sink(d / "old.tif", 3, 4, 4, replace=False),
], ids=["image", "pattern-one-frame", "pattern-later-frame", "npy-stack", "tif-stack"])
def test_replace_false_refuses_at_construction_when_any_target_exists(make, tmp_path):
    for name in ("old.png", "g0.png", "f2.png", "old.npy", "old.tif"):
        (tmp_path / name).write_bytes(b"the user's")
    before = sorted(tmp_path.iterdir())
    with pytest.raises(ValueError) as err:
        make(tmp_path)
    assert "replacing" in str(err.value) and "refused" in str(err.value)
    assert sorted(tmp_path.iterdir()) == before
    assert all(p.read_bytes() == b"the user's" for p in before)


# -- frame sequences: all frames published together, never a user's file lost ------------------------

def _frames(sink, n, value=0):
    sink.write(0, 0, 0, np.full((n, 4, 4, 3), value, np.uint8))


@pytest.mark.parametrize("raised", [RuntimeError("the decoder failed"), Interrupted(signal.SIGTERM)],
                         ids=["error", "sigterm"])
def test_an_aborted_frame_sequence_keeps_the_users_frames(tmp_path, raised):
    """The issue's loss: frame 0 replaced the user's file as soon as it was complete, and the clean-up
    then removed it. Now complete frames wait under temporary names; an abort removes only those."""
    (tmp_path / "f0.png").write_bytes(b"the user's frame 0")
    with pytest.raises(type(raised)):
        with tw.open_video_sink(tmp_path / "f{}.png", 3, 4, 4) as sink:
            _frames(sink, 2)  # frames 0 and 1 complete
            assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".part")) == ["f0.png"]
            raise raised
    assert [p.name for p in tmp_path.iterdir()] == ["f0.png"]
    assert (tmp_path / "f0.png").read_bytes() == b"the user's frame 0"


def test_a_frame_sequence_replaces_the_users_frames_only_when_all_are_complete(tmp_path):
    (tmp_path / "f1.png").write_bytes(b"old")
    with tw.open_video_sink(tmp_path / "f{}.png", 3, 4, 4) as sink:
        assert sink.existing == [str(tmp_path / "f1.png")]
        _frames(sink, 3, 7)
        assert (tmp_path / "f1.png").read_bytes() == b"old"  # complete, not yet published
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f0.png", "f1.png", "f2.png"]
    assert all(p.read_bytes()[:4] == b"\x89PNG" for p in tmp_path.iterdir())


def test_no_clobber_frames_that_appear_while_writing_publish_none(tmp_path):
    with pytest.raises(BadRequest, match="appeared while it was being written"):
        with tw.open_video_sink(tmp_path / "f{}.png", 3, 4, 4, replace=False) as sink:
            _frames(sink, 3)
            (tmp_path / "f2.png").write_bytes(b"someone else's")
    assert [p.name for p in tmp_path.iterdir()] == ["f2.png"]  # f0, f1 were linked, then removed again
    assert (tmp_path / "f2.png").read_bytes() == b"someone else's"


def test_a_signal_while_frames_are_renamed_waits_until_all_are(tmp_path, monkeypatch):
    """The CLI's handler holds a signal while publish_all renames: a signal after the first rename ends
    the command only once every frame is in place (no mixture of old and new frames)."""
    from tilewise import atomic
    from tilewise.cli.failures import signals_raise

    real = os.replace
    calls = []

    def replace_then_signal(a, b):
        real(a, b)
        calls.append(b)
        if len(calls) == 1:
            os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(atomic.os, "replace", replace_then_signal)
    with pytest.raises(Interrupted) as err:
        with signals_raise():
            with tw.open_video_sink(tmp_path / "f{}.png", 3, 4, 4) as sink:
                _frames(sink, 3)
    assert err.value.signum == signal.SIGTERM and len(calls) == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f0.png", "f1.png", "f2.png"]


def test_deferred_signals_are_raised_when_the_block_ends():
    from tilewise.atomic import defer_signal, deferred_signals

    assert defer_signal(signal.SIGINT) is False  # outside: the handler acts now
    with pytest.raises(Interrupted) as err:
        with deferred_signals():
            with deferred_signals():
                assert defer_signal(signal.SIGHUP) is True
            # the inner block ended: still held until the outermost one does
    assert err.value.signum == signal.SIGHUP and err.value.exit_code == 129


def test_an_npy_stack_on_a_full_disk_is_an_error_at_once(tmp_path, monkeypatch):
    import tilewise.sinks.arrays as arrays

    def full(fd, offset, size):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(arrays.os, "posix_fallocate", full)
    with pytest.raises(OSError) as err:
        tw.open_video_sink(tmp_path / "v.npy", 3, 4, 4)
    assert err.value.errno == errno.ENOSPC and err.value.filename == str(tmp_path / "v.npy")
    assert not list(tmp_path.iterdir())


# -- planners -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs,needle", [
    ({"tile_size": "4"}, "tile_size must be an int or an (h, w) pair, got '4'"),
    ({"tile_size": True}, "got True"),
    ({"tile_size": 4.5}, "got 4.5"),
    ({"tile_size": (4, 4, 4)}, "got (4, 4, 4)"),
    ({"tile_size": 0}, "tile_size must be positive"),
    ({"tile_size": 4, "overlap": 4}, "overlap 4 must be smaller than the tile 4 along height; valid: 0..3"),
    ({"tile_size": 4, "halo": -1}, "halo must be >= 0"),
    ({"tile_size": 4, "edge": "wrap"}, "edge must be one of"),
    ({"tile_size": 4, "order": "random"}, "order must be one of"),
    ({"tile_size": 4, "pad_mode": "zeros"}, "pad_mode must be one of"),
    ({"tile_size": 6, "align": 4}, "tile_size 6 along height is not a multiple of align 4"),
], ids=["tile-str", "tile-bool", "tile-float", "tile-3", "tile-0", "overlap", "halo", "edge", "order",
        "pad-mode", "align"])
def test_tile_grid_refuses_at_construction(kwargs, needle):
    with pytest.raises(ValueError) as err:
        tw.TileGrid(16, 16, **kwargs)
    assert needle in str(err.value)


@pytest.mark.parametrize("kwargs,needle", [
    ({"area": 65536, "max_aspect": "4"}, "max_aspect (width/height or height/width) must be a number in"),
    ({"area": 65536, "max_aspect": float("nan")}, "got nan"),
    ({"area": 65536, "max_aspect": 0.5}, "[1, inf], got 0.5"),
    ({"area": 65536, "max_aspect_error": -1}, "max_aspect_error must be a number in [0, inf], got -1"),
    ({"area": 65536, "max_pad_fraction": 1}, "max_pad_fraction (padded / bucket pixels) must be a number in"),
    ({"area": 65536, "max_pad_fraction": "x"}, "[0, 1), got 'x'"),
    ({"area": 65536, "resample": "nearest"}, "resample must be one of ('bilinear', 'bicubic')"),
    ({"area": 65536, "fill": "white"}, "fill must be a number or a tuple of numbers"),
    ({"area": 65536, "costs": {(256, 256): -1.0}}, "costs="),
    ({"area": 10 ** 18, "step": 8}, "bucket widths to try, more than 100000: use a step of at least"),
    ({"area": 65536, "latent_factor": 0}, "latent_factor must be a positive integer, got 0"),
    ({"area": 65536, "step": 60}, "step=60 must be a multiple of latent_factor=8"),
    ({"area": 0}, "area must be a positive integer, got 0"),
    ({"buckets": []}, "buckets= is empty"),
], ids=["aspect-str", "aspect-nan", "aspect-below-1", "aspect-error", "pad-1", "pad-str", "resample", "fill",
        "costs", "area-1e18", "latent-factor", "step", "area-0", "buckets-empty"])
def test_bucket_planner_refuses_at_construction(kwargs, needle):
    with pytest.raises(ValueError) as err:
        tw.BucketPlanner(**kwargs)
    assert needle in str(err.value), str(err.value)


def test_bucket_planner_costs_must_be_numbers():
    buckets = [(256, 256), (320, 192)]
    with pytest.raises(ValueError, match=r"costs\[\(256, 256\)\] must be a number in \[0, inf\], got -1.0"):
        tw.BucketPlanner(buckets=buckets, costs={(256, 256): -1.0, (320, 192): 1.0})
    planner = tw.BucketPlanner(buckets=buckets, costs={(256, 256): np.float32(2), (320, 192): np.int64(1)})
    assert planner.costs == {(256, 256): 2.0, (320, 192): 1.0}


# -- checks the CLI and the recipes share -------------------------------------------------------------

@pytest.mark.parametrize("box,needle", [
    ((40, 0, 8, 64), "is inverted: it needs x0 < x1"),
    ((0, 9, 64, 9), "is empty: it needs y0 < y1"),
    ((0, 0, 72, 64), "lies outside the 64x64 image: it needs 0 <= x0 < x1 <= 64"),
    ((-1, 0, 8, 8), "lies outside"),
], ids=["inverted", "empty", "wider", "negative"])
def test_region_boxes(box, needle):
    from tilewise.pipelines.recipes import check_region

    with pytest.raises(BadRequest) as err:
        check_region(box, 64, 64)
    assert needle in str(err.value) and str(box) in str(err.value)


@pytest.mark.parametrize("text,code", [
    ("[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate memory: you tried to allocate "
     "160000000000 bytes", 4),
    ("something else went wrong", 1),
], ids=["cpu-allocator", "other-runtime-error"])
def test_a_cpu_allocation_failure_is_out_of_memory(text, code):
    from tilewise.cli.failures import exit_code, message

    e = RuntimeError(text)
    assert exit_code(e) == code
    assert message(e, []).startswith("error: out of memory" if code == 4 else "error: internal error")


# -- diffusers' notices while a model loads ----------------------------------------------------------

@pytest.mark.parametrize("fails", [True, False], ids=["load-fails", "load-works"])
def test_library_notices_are_held_while_loading(fails):
    """The issue: diffusers' multi-line notices came before the one error line. They are held while a
    model loads: dropped (logged at debug level) when the load fails, shown when it works."""
    import logging

    from tilewise.errors import ModelProblem
    from tilewise.pipelines.folders import model_errors

    seen = []

    class Seen(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    def load():
        with model_errors("--model 'x'"):
            logging.getLogger("diffusers.models").warning("An error occurred while fetching x:\nno weights")
            if fails:
                raise OSError("no weights")

    lib = logging.getLogger("diffusers")
    handlers, level = lib.handlers[:], lib.level
    lib.handlers, lib.level = [Seen()], logging.WARNING
    try:
        if fails:
            with pytest.raises(ModelProblem, match="--model 'x' cannot be loaded: OSError: no weights"):
                load()
        else:
            load()
    finally:
        lib.handlers, lib.level = handlers, level
    assert seen == ([] if fails else ["An error occurred while fetching x:\nno weights"])
