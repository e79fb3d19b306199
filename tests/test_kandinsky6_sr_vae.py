"""Kandinsky 6 SR's VAE (`Kandinsky6SRVAE`) through TiledVAE in one pass: its own decode / encode loop over
16-frame segments carries each causal convolution's frames over (one convolution over every frame) and
its norms are RMS norms over the channels, so the loop equals its decoder / encoder on every frame at
once. Compared with the stock VAE's own decode / encode (fp32, <= 1e-4), on 2x3 tiles of an odd latent,
at frame counts of one segment and of several (the last of one latent frame)."""

import pytest

torch = pytest.importorskip("torch")

from video_vae_support import kandinsky6_sr  # noqa: E402

import tilewise as tw  # noqa: E402


@pytest.fixture(scope="module")
def vae():
    return kandinsky6_sr()


@pytest.fixture(scope="module")
def tv(vae):
    return tw.TiledVAE(vae, tile_size=2, progress=False)


def _z(frames):
    return torch.randn(1, 4, frames, 3, 5, generator=torch.Generator().manual_seed(frames))  # (2x3 tiles)


@pytest.mark.parametrize("frames", [1, 6, 9])  # one segment of one frame; segments 5 + 1; 5 + 4
def test_decode_equals_the_stock_segmented_decode(vae, tv, frames):
    z = _z(frames)
    with torch.no_grad():
        want, got = vae.decode(z).sample, tv.decode(z).sample
    assert got.shape == want.shape == (1, 3, 4 * frames - 3, 24, 40)
    assert want.abs().max() > 0.1 and (got - want).abs().max().item() <= 1e-4


@pytest.mark.parametrize("frames", [5, 21, 37])  # one segment; 17 + 4; 17 + 16 + 4
def test_encode_equals_the_stock_segmented_encode(vae, tv, frames):
    x = torch.randn(1, 3, frames, 24, 40, generator=torch.Generator().manual_seed(frames))
    with torch.no_grad():
        want, got = vae.encode(x).latent_dist.parameters, tv.encode(x).latent_dist.parameters
    assert got.shape == want.shape == (1, 8, (frames - 1) // 4 + 1, 3, 5)
    assert (got - want).abs().max().item() <= 1e-4


def test_encode_takes_1_plus_4k_frames(vae, tv):
    x = torch.randn(1, 3, 4, 24, 40)
    with pytest.raises(RuntimeError):  # (the stock encode fails on 4 frames)
        vae.encode(x)
    with pytest.raises(ValueError, match=r"Kandinsky6SRVAE encodes 1 \+ 4 k frames"):
        tv.encode(x)


def test_plan_and_analyze(tv):
    plan = tv.plan((1, 4, 9, 3, 5))
    assert plan.output_shape == (1, 3, 33, 24, 40)
    report = tw.analyze(tv.program("decode"))  # (no GroupNorm: one segment, no sync point)
    assert not report.sync_ops and len(report.segments) == 1
    assert not {type(op).__name__ for op in tv.program("encode").ops} & {"Local", "Whole"}


def test_decode_gradients_equal_the_stock_decodes(vae, tv):
    # (the reverse program, `vae.video.gradient`; relative to the gradient's scale)
    g = torch.Generator().manual_seed(3)
    z, w = torch.randn(1, 4, 6, 3, 5, generator=g), torch.randn(1, 3, 21, 24, 40, generator=g)
    z1, z2 = z.clone().requires_grad_(True), z.clone().requires_grad_(True)
    (vae.decode(z1).sample * w).sum().backward()
    (tv.decode(z2).sample * w).sum().backward()
    assert ((z1.grad - z2.grad).abs().max() / z1.grad.abs().max()).item() <= 1e-4


def test_decode_of_the_real_latent_width_its_zq_interpolated_in_channel_chunks():
    # (64 latent channels, as Kandinsky 6 SR's config: its spatial norms interpolate zq's frames after the
    # first in chunks of 32 channels, concatenated back, then the first frame in front: parts of one split
    # of frames through a channel split and concatenation)
    torch.manual_seed(0)
    import diffusers as d

    vae = d.Kandinsky6SRVAE(latent_channels=64, encoder_block_out_channels=(8, 16, 16),
                            decoder_block_out_channels=(8, 16, 16), layers_per_block=1).eval()
    z = torch.randn(1, 64, 3, 3, 5, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = vae.decode(z).sample, tw.TiledVAE(vae, tile_size=2, progress=False).decode(z).sample
    assert got.shape == want.shape and (got - want).abs().max().item() <= 1e-4
