"""CogVideoX's VAE (`AutoencoderKLCogVideoX`) through TiledVAE as its chunked loop runs it: decode's calls of
2 latent frames and encode's of 8 video frames (the first call with the remainder) are the program's
causal steps, its GroupNorms (the spatial norms' too) sync ops over each call's frames, its conv_cache the
steps' caches; the first call traced apart (an odd call resamples its first frame apart). Compared with
the stock VAE's own decode / encode (fp32, <= 1e-4), on 2x3 tiles and odd latent sides."""

import pytest

torch = pytest.importorskip("torch")

from video_vae_support import cogvideox_vae  # noqa: E402

import tilewise as tw  # noqa: E402
from tilewise.vae.family_programs import first_call  # noqa: E402


@pytest.fixture(scope="module")
def vae():
    return cogvideox_vae()


@pytest.fixture(scope="module")
def tv(vae):
    return tw.TiledVAE(vae, tile_size=2, progress=False)


def test_the_steps_are_the_stock_loops_calls_the_first_with_the_remainder(tv):
    # (CogVideoX's _decode: max(T // 2, 1) calls, the first taking T % 2 more; _encode the same with 8)
    assert [first_call(2, t) for t in (1, 2, 3, 4, 5)] == [1, 2, 3, 2, 3]
    assert [first_call(8, t) for t in (1, 7, 8, 9, 16, 19)] == [1, 7, 8, 9, 8, 11]
    assert tv.program("decode", 5).chunks(5) == [(0, 3), (3, 5)]
    assert tv.program("decode", 4).chunks(4) == [(0, 2), (2, 4)]
    assert tv.program("encode", 19).chunks(19) == [(0, 11), (11, 19)]
    assert tv.program("encode", 13).chunks(13) == [(0, 13)]


@pytest.mark.parametrize("frames", [1, 5])  # one call of one frame; a remainder first call (3) + a steady one
def test_decode_equals_the_stock_chunked_decode(vae, tv, frames):
    z = torch.randn(1, 4, frames, 3, 5, generator=torch.Generator().manual_seed(frames))  # (2x3 tiles)
    with torch.no_grad():
        want = vae.decode(z).sample
        got = tv.decode(z).sample
    assert got.shape == want.shape == (1, 3, 4 * frames - 3, 24, 40)
    assert (got - want).abs().max().item() <= 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("frames", [2, 4, 7])  # one even call; two even calls; 3 + 2 + 2
def test_decode_equals_the_stock_chunked_decode_at_more_frame_counts(vae, tv, frames):
    z = torch.randn(1, 4, frames, 3, 5, generator=torch.Generator().manual_seed(frames))
    with torch.no_grad():
        want = vae.decode(z).sample
        got = tv.decode(z).sample
    assert got.shape == want.shape
    assert (got - want).abs().max().item() <= 1e-4


@pytest.mark.parametrize("frames", [9, 17])  # one odd call; 9 + 8 (the stock loop's 1 + 8 k frames)
def test_encode_equals_the_stock_chunked_encode(vae, tv, frames):
    x = torch.randn(1, 3, frames, 24, 40, generator=torch.Generator().manual_seed(frames))  # (3 x 5 latent)
    with torch.no_grad():
        want = vae.encode(x).latent_dist
        got = tv.encode(x).latent_dist
    assert got.mean.shape == want.mean.shape == (1, 4, (frames - 1) // 4 + 1, 3, 5)
    assert (got.parameters - want.parameters).abs().max().item() <= 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("frames", [6, 12, 19])  # frame counts the model's odd / even branches take apart
def test_encode_equals_the_stock_chunked_encode_at_more_frame_counts(vae, tv, frames):
    x = torch.randn(1, 3, frames, 24, 40, generator=torch.Generator().manual_seed(frames))
    with torch.no_grad():
        want = vae.encode(x).latent_dist.parameters
        got = tv.encode(x).latent_dist.parameters
    assert got.shape == want.shape
    assert (got - want).abs().max().item() <= 1e-4


def test_plan_and_analyze(tv, vae):
    plan = tv.plan((1, 4, 5, 3, 5))
    assert plan.output_shape == (1, 3, 17, 24, 40)
    text = str(plan)
    assert "causal steps: 2, input frames 0..2, 3..4; output frames per step [9, 8]" in text
    assert "GroupNorm statistics" in text
    enc = tv.plan((1, 3, 17, 24, 40), kind="encode")
    assert enc.output_shape == (1, 8, 5, 3, 5)
    report = tw.analyze(tv.program("decode", 5))  # (its GroupNorms: the sync points between segments)
    assert len(report.sync_ops) == 21 and {str(kind) for _, kind in report.sync_ops} == {"group_norm"}
    assert len(report.segments) == 22


@pytest.mark.slow
def test_decode_gradients_equal_the_stock_decodes(vae, tv):
    # (the reverse program over the causal steps, `vae.video.gradient`: two calls, 3 + 2 latent frames;
    # relative to the gradient's scale)
    g = torch.Generator().manual_seed(3)
    z, w = torch.randn(1, 4, 5, 3, 5, generator=g), torch.randn(1, 3, 17, 24, 40, generator=g)
    z1, z2 = z.clone().requires_grad_(True), z.clone().requires_grad_(True)
    (vae.decode(z1).sample * w).sum().backward()
    (tv.decode(z2).sample * w).sum().backward()
    assert ((z1.grad - z2.grad).abs().max() / z1.grad.abs().max()).item() <= 1e-4


@pytest.mark.slow
def test_drops_into_a_stock_cogvideox_pipeline():
    """pipe.vae = TiledVAE(pipe.vae) in CogVideoXPipeline (prompt embeddings given: no text encoder): the
    decoded video (9 frames from 3 latent frames, one call of the stock loop, a 2 x 4 grid of tiles)
    equals the stock VAE's."""
    from tiny_denoisers import cogvideox

    pipe, call = cogvideox()
    pipe.set_progress_bar_config(disable=True)
    call = dict(call, num_inference_steps=2, output_type="pt")
    ref = pipe(generator=torch.Generator().manual_seed(1), **call).frames
    pipe.vae = tw.TiledVAE(pipe.vae, tile_size=3, progress=False)
    out = pipe(generator=torch.Generator().manual_seed(1), **call).frames
    assert pipe.vae.plan((1, 4, 3, 6, 10)).grid == (2, 4)
    assert out.shape == ref.shape == (1, 9, 3, 48, 80) and (out - ref).abs().max() <= 1e-4
    assert ((ref > 0) & (ref < 1)).float().mean() > 0.5  # (most pixels not clamped: the test sees them)
