"""KVAE video's VAE (`AutoencoderKLKVAEVideo`) through TiledVAE as its chunked loop runs it: decode's calls
of 5 then 4 latent frames and encode's of 17 then 16 video frames (the last call the remainder) are the
program's causal steps, its GroupNorms sync ops over each call's frames, its cached causal convolutions
(two conv3d written into one buffer, traced as one) the steps' caches. Compared with the stock VAE's own
decode / encode (fp32, <= 1e-4), on 2x3 tiles of an odd latent."""

import pytest

torch = pytest.importorskip("torch")

from video_vae_support import kvae_video  # noqa: E402

import tilewise as tw  # noqa: E402


@pytest.fixture(scope="module")
def vae():
    return kvae_video()


@pytest.fixture(scope="module")
def tv(vae):
    return tw.TiledVAE(vae, tile_size=2, progress=False)


def _z(frames):
    return torch.randn(1, 4, frames, 3, 5, generator=torch.Generator().manual_seed(frames))  # (2x3 tiles)


def _x(frames):
    return torch.randn(1, 3, frames, 24, 40, generator=torch.Generator().manual_seed(frames))  # (3x5 latent)


def test_the_steps_are_the_stock_loops_calls_the_last_with_the_remainder(tv):
    # (KVAE's _decode splits 1 + 4 (T - 1) video frames into 17, 16, ... and takes ceil(/ 4) latent frames)
    assert tv.program("decode", 13).chunks(13) == [(0, 5), (5, 9), (9, 13)]
    assert tv.program("decode", 8).chunks(8) == [(0, 5), (5, 8)]
    assert tv.program("decode", 3).chunks(3) == [(0, 3)]
    assert tv.program("encode", 37).chunks(37) == [(0, 17), (17, 33), (33, 37)]
    kinds = {type(op).__name__ for op in tv.program("encode", 17).ops}
    assert not kinds & {"Local", "Whole"}  # (every call traced: nothing measured as a whole module)


@pytest.mark.parametrize("frames", [1, 9])  # one call of one frame; 5 + 4 (the cache carried over)
def test_decode_equals_the_stock_chunked_decode(vae, tv, frames):
    z = _z(frames)
    with torch.no_grad():
        want, got = vae.decode(z).sample, tv.decode(z).sample
    assert got.shape == want.shape == (1, 3, 4 * frames - 3, 24, 40)
    assert (got - want).abs().max().item() <= 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("frames", [3, 8, 13])  # one call of fewer frames; 5 + 3; 5 + 4 + 4
def test_decode_equals_the_stock_chunked_decode_at_more_frame_counts(vae, tv, frames):
    z = _z(frames)
    with torch.no_grad():
        want, got = vae.decode(z).sample, tv.decode(z).sample
    assert got.shape == want.shape
    assert (got - want).abs().max().item() <= 1e-4


@pytest.mark.parametrize("frames", [5, 21])  # one call; 17 + 4 (its stride-2 convolutions' cache of 1 frame)
def test_encode_equals_the_stock_chunked_encode(vae, tv, frames):
    x = _x(frames)
    with torch.no_grad():
        want, got = vae.encode(x).latent_dist, tv.encode(x).latent_dist
    assert got.mean.shape == want.mean.shape == (1, 4, (frames - 1) // 4 + 1, 3, 5)
    assert (got.parameters - want.parameters).abs().max().item() <= 1e-4
    assert (got.logvar == 0).all()  # (as stock: the posterior of its latent, log-variance 0)


@pytest.mark.slow
@pytest.mark.parametrize("frames", [1, 17, 37])  # one frame; one whole call; 17 + 16 + 4
def test_encode_equals_the_stock_chunked_encode_at_more_frame_counts(vae, tv, frames):
    x = _x(frames)
    with torch.no_grad():
        want, got = vae.encode(x).latent_dist.parameters, tv.encode(x).latent_dist.parameters
    assert got.shape == want.shape
    assert (got - want).abs().max().item() <= 1e-4


def test_frame_counts_the_stock_loop_cannot_take_or_makes_otherwise_are_refused_at_the_call(vae, tv):
    with pytest.raises(RuntimeError):  # (the stock encode fails on 4 frames: its downsamplers' pairs)
        vae.encode(_x(4))
    with pytest.raises(ValueError, match=r"encodes 1 \+ 4 k frames \(its own encode fails on 4 frames"):
        tv.encode(_x(4))
    with torch.no_grad():  # (6 latent frames: calls of 5 and 1, the last not doubled in time by stock)
        assert vae.decode(_z(6)).sample.shape[2] == 18
    with pytest.raises(ValueError, match=r"the last of one latent frame, which its temporal upsamplers do "
                                         r"not double .* its own decode gives 18 frames"):
        tv.decode(_z(6))


def test_plan_and_analyze(tv):
    plan = tv.plan((1, 4, 9, 3, 5))
    assert plan.output_shape == (1, 3, 33, 24, 40)
    text = str(plan)
    assert "causal steps: 2, input frames 0..4, 5..8; output frames per step [17, 16]" in text
    assert "GroupNorm statistics" in text
    assert tv.plan((1, 3, 21, 24, 40), kind="encode").output_shape == (1, 4, 6, 3, 5)
    report = tw.analyze(tv.program("decode", 9))  # (its GroupNorms: the sync points between segments)
    assert report.sync_ops and {str(kind) for _, kind in report.sync_ops} == {"group_norm"}
    assert len(report.segments) == len(report.sync_ops) + 1


@pytest.mark.slow
def test_decode_gradients_equal_the_stock_decodes(vae, tv):
    # (the reverse program over the causal steps, `vae.video.gradient`: two calls, 5 + 4 latent frames;
    # relative to the gradient's scale)
    g = torch.Generator().manual_seed(3)
    z, w = torch.randn(1, 4, 9, 3, 5, generator=g), torch.randn(1, 3, 33, 24, 40, generator=g)
    z1, z2 = z.clone().requires_grad_(True), z.clone().requires_grad_(True)
    (vae.decode(z1).sample * w).sum().backward()
    (tv.decode(z2).sample * w).sum().backward()
    assert ((z1.grad - z2.grad).abs().max() / z1.grad.abs().max()).item() <= 1e-4


def test_decode_to_streams_the_program_of_its_own_first_call(vae, tv, tmp_path):
    # (9 latent frames: calls of 5 + 4, the program of a first call of 5; a 6-frame latent refused as decode)
    import numpy as np

    z = _z(9)
    with torch.no_grad():
        want = vae.decode(z).sample
    with tw.open_video_sink(tmp_path / "v.npy", 33, 24, 40, 3, bits=32) as sink:
        tv.decode_to(z, sink)
    got = torch.from_numpy(np.load(tmp_path / "v.npy")).permute(3, 0, 1, 2)
    assert (got - want[0]).abs().max().item() <= 1e-4
    with pytest.raises(ValueError, match="the last of one latent frame"):
        tv.decode_to(_z(6), None)


class _Writes(torch.nn.Module):
    """A convolution over a padded video value computed as KVAE's is, its first windows and the others
    written into a torch.empty buffer by two conv3d; or (part) only the first of them written."""

    def __init__(self, part: bool):
        super().__init__()
        self.conv, self.part = torch.nn.Conv3d(2, 3, (2, 3, 3)), part

    def forward(self, x):
        p = torch.nn.functional.pad(x, (1, 1, 1, 1))
        buf = x.new_empty((x.shape[0], 3, x.shape[2] - 1, *x.shape[3:]))
        buf[:, :, :2] = self.conv(p[:, :, :3])
        if not self.part:
            buf[:, :, 2:] = self.conv(p[:, :, 2:])
        return buf * 2


def test_frames_written_into_a_buffer_are_its_values_in_frame_order_or_refused_read_in_part():
    from tilewise.locality import LoweringError
    from tilewise.locality.trace import lower_traced

    torch.manual_seed(0)
    m, x = _Writes(part=False).eval(), torch.randn(1, 2, 6, 5, 7)
    program = lower_traced(m, m, torch.empty(1, 2, 6, 5, 7, device="meta"))
    with torch.no_grad():
        assert (program.run_steps(x) - m(x)).abs().max().item() <= 1e-6
    half = _Writes(part=True).eval()
    with pytest.raises(LoweringError, match="a read of a buffer of video frames written in part"):
        lower_traced(half, half, torch.empty(1, 2, 6, 5, 7, device="meta"))
