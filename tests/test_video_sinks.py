"""Video sinks: frames block by block, coverage checked, nothing left behind on failure."""

import numpy as np
import pytest

from tilewise.sinks.video import FrameSequenceSink, NpyStackSink, TIFFStackSink, open_video_sink


def _frames(t, h, w, c=3, seed=0):
    return np.random.default_rng(seed).integers(0, 256, (t, h, w, c), dtype=np.uint8)


@pytest.mark.parametrize("name,cls", [("v.npy", NpyStackSink), ("v.tif", TIFFStackSink),
                                      ("f{:03d}.png", FrameSequenceSink)])
def test_blocks_of_frames_assemble_the_video(tmp_path, name, cls):
    video = _frames(5, 20, 24)
    with open_video_sink(tmp_path / name, 5, 20, 24) as sink:
        assert type(sink) is cls
        for t0 in (0, 2, 4):  # frame blocks of 2, 2, 1; within each, two rows of two tiles, row-major
            t1 = min(t0 + 2, 5)
            for y0 in (0, 10):
                for x0 in (0, 12):
                    sink.write(t0, y0, x0, video[t0:t1, y0:y0 + 10, x0:x0 + 12])
    if name.endswith(".npy"):
        got = np.load(tmp_path / name)
    elif name.endswith(".tif"):
        import tifffile

        got = tifffile.imread(tmp_path / name)
    else:
        from PIL import Image

        got = np.stack([np.array(Image.open(tmp_path / name.format(i))) for i in range(5)])
    assert np.array_equal(got, video)


def test_torch_blocks_map_the_value_range_like_image_sinks(tmp_path):
    torch = pytest.importorskip("torch")
    from tilewise.sinks import to_hwc_uint

    x = torch.rand(3, 2, 8, 8) * 2 - 1
    with open_video_sink(tmp_path / "v.npy", 2, 8, 8) as sink:
        sink.write(0, 0, 0, x[None])
    got = np.load(tmp_path / "v.npy")
    assert np.array_equal(got[1], to_hwc_uint(x[:, 1]))


@pytest.mark.parametrize("name", ["v.npy", "v.tif", "f{:02d}.png"])
def test_a_missing_block_names_the_frame_and_leaves_no_file(tmp_path, name):
    video = _frames(2, 8, 8)
    sink = open_video_sink(tmp_path / name, 2, 8, 8)
    sink.write(0, 0, 0, video[:, :, :4])
    sink.write(0, 0, 4, video[:1, :, 4:])
    with pytest.raises(ValueError, match=r"frame 1, pixels \(y 0..8, x 4..8\) were never written"):
        sink.close()
    assert not list(tmp_path.iterdir())


def test_bad_writes_and_paths_are_refused(tmp_path):
    with pytest.raises(ValueError, match="does not fit inside 2 frames of 8x8"):
        with open_video_sink(tmp_path / "v.npy", 2, 8, 8) as sink:
            sink.write(1, 0, 0, _frames(2, 8, 8))
    with pytest.raises(ValueError, match="dtype uint8"):
        with open_video_sink(tmp_path / "v.npy", 1, 4, 4) as sink:
            sink.write(0, 0, 0, np.zeros((1, 4, 4, 3), dtype=np.float32))
    with pytest.raises(ValueError, match=r"pattern with a \{\} field"):
        FrameSequenceSink(tmp_path / "f.png", 2, 4, 4)
    with pytest.raises(ValueError, match="cannot choose a video sink"):
        open_video_sink(tmp_path / "v.mp4", 2, 4, 4)
    with pytest.raises(ValueError, match="frames must be a positive int"):
        open_video_sink(tmp_path / "v.npy", 0, 4, 4)
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("name,bits,needle", [
    ("f{:02d}.png", 32, "bits=32 is not valid for .png"),  # a frame's own sink refuses it
    ("f{:03d}.jpg", 8, "suffix '.jpg'"),
    ("f{}{}.png", 8, "not a frame pattern with one {} field"),
    ("v.npy", 12, "bits must be 8, 16 or 32"),
])
def test_a_sink_that_cannot_take_the_video_is_refused_when_opened(tmp_path, name, bits, needle):
    from tilewise.errors import BadRequest

    with pytest.raises(BadRequest, match=needle):
        open_video_sink(tmp_path / name, 2, 4, 4, bits=bits)
    assert list(tmp_path.iterdir()) == []
