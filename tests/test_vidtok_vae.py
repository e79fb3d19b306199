"""VidTok's VAE (`AutoencoderVidTok`) through TiledVAE, traced from what it computes: its untiled decode and
encode are one pass of the decoder / encoder over every frame (each causal layer's first chunk, no cache),
its causal decode dropping its first r - 1 frames. Its resnets' 2-D halves run on the frames in the batch
(their LayerNorms over the channels through a permute, measured position by position), their 1-D halves on
each position's frames as rows (one op, `trace.video_rows`), its temporal upsamplers interpolate
trilinearly in time and its downsamplers take avg_pool3d over frames, its mid-block attends over each
frame's tokens. Compared with the stock VAE (use_tiling off; fp32, max abs <= 1e-4) on 2 x 3 tiles of odd
latent sides, with its own call signatures and return types: decode returns the frames tensor, encode a
posterior (regularizer "kl") or its FSQ latent and codebook indices ("fsq")."""

import pytest

torch = pytest.importorskip("torch")

from video_vae_support import latent, same_gradients, video, vidtok  # noqa: E402

import tilewise as tw  # noqa: E402
from tilewise.locality import LoweringError  # noqa: E402
from tilewise.locality.ops import Pointwise  # noqa: E402
from tilewise.locality.ops3d_sync import FrameSDPA  # noqa: E402
from tilewise.locality.ops_traced import Local, Whole  # noqa: E402

TOL = 1e-4


@pytest.fixture(scope="module")
def vae():
    return vidtok()


@pytest.fixture(scope="module")
def tv(vae):
    return tw.TiledVAE(vae, tile_size=2, progress=False)


def _caches(vae) -> list:
    """Every causal cache its layers keep (None after its own untiled calls, and after a trace)."""
    return [m.causal_cache for m in vae.modules() if hasattr(m, "causal_cache")]


# 1, 2, 3 latent frames (1, 5, 9 out: 4 T frames, the first 3 dropped); 3 x 5 latent px, tiles of 2
@pytest.mark.parametrize("frames", [1, 2, 3])
def test_decode_is_exact_and_returns_the_frames(vae, tv, frames):
    z = latent(frames, 3, 5, seed=frames)
    with torch.no_grad():
        want = vae.decode(z)
        got = tv.decode(z)
    assert isinstance(got, torch.Tensor) and isinstance(want, torch.Tensor)  # (its decode returns frames)
    assert got.shape == want.shape == (1, 3, 4 * frames - 3, 12, 20)
    assert (got - want).abs().max().item() <= TOL
    assert tv.plan(tuple(z.shape)).grid == (2, 3)


# 4 and 8 frames (1 and 2 latent frames); 5, 7 and 11 frames, which its downsamplers' pooling floors
# (the last frames dropped: 1, 1 and 2 latent frames)
@pytest.mark.parametrize("frames", [4, 5, 7, 11])
def test_encode_is_exact_and_returns_its_posterior(vae, tv, frames):
    x = video(frames, 12, 20, seed=frames)
    with torch.no_grad():
        want = vae.encode(x).latent_dist
        got = tv.encode(x).latent_dist
    assert got.mean.shape == want.mean.shape == (1, 4, frames // 4, 3, 5)
    assert (got.mean - want.mean).abs().max().item() <= TOL
    assert (got.logvar - want.logvar).abs().max().item() <= TOL


def test_a_batch_of_two_decodes_and_encodes_exactly(vae, tv):
    z, x = latent(2, 3, 5, seed=7, batch=2), torch.cat([video(4, 12, 20, seed=8), video(4, 12, 20, seed=9)])
    with torch.no_grad():
        assert (tv.decode(z) - vae.decode(z)).abs().max().item() <= TOL
        assert (tv.encode(x).latent_dist.mean - vae.encode(x).latent_dist.mean).abs().max().item() <= TOL


def test_fewer_frames_than_its_encode_takes_are_refused_at_the_call(vae, tv):
    x = video(3, 12, 20)
    with torch.no_grad(), pytest.raises(RuntimeError, match="smaller than kernel size"):
        vae.encode(x)  # (its downsamplers' avg_pool3d of 3 frames: the stock encode fails too)
    with pytest.raises(ValueError, match=r"encode\(\): AutoencoderVidTok encodes at least 4 frames.*on 3"):
        tv.encode(x)


def test_its_own_arguments_and_forward_are_refused_by_name(tv):
    z = latent(1, 3, 5)
    with pytest.raises(ValueError, match="decode_from_indices=True is not followed by the tiled path"):
        tv.decode(z, decode_from_indices=True)
    with pytest.raises(NotImplementedError, match="its forward pads the video in time first"):
        tv(video(4, 12, 20))


def test_its_layers_are_placed_by_what_they_compute(tv):
    """No module run whole or measured with a halo: the samplers' caches and first-chunk flags are never
    read at run time (only the LayerNorms over the channels are measured, position by position)."""
    for kind in ("decode", "encode"):
        ops = tv.program(kind).ops
        assert not [op for op in ops if isinstance(op, Local | Whole)]
        labels = [op.label for op in ops if isinstance(op, Pointwise)]
        assert any(label.startswith("rows: ") for label in labels)  # (its 1-D resnet halves)
        assert sum(isinstance(op, FrameSDPA) for op in ops) == 1  # (the mid-block's attention)
    labels = [getattr(op, "label", "") for op in tv.program("decode").ops]
    assert "trilinear x2 in time" in labels and "mean of 3 frames, stride 2" in [
        getattr(op, "label", "") for op in tv.program("encode").ops]


def test_its_own_tiled_run_before_leaves_the_tiled_path_exact(vae, tv):
    """Its use_tiling decode (temporal chunks) leaves its layers' first-chunk flags off and caches set;
    the tiled path follows its untiled decode whatever they are."""
    z = latent(3, 3, 5, seed=4)
    vae.enable_tiling()
    try:
        with torch.no_grad():
            vae.decode(z)
            assert not all(m.is_first_chunk for m in vae.modules() if hasattr(m, "is_first_chunk"))
            got = tv.decode(z)
    finally:
        vae.disable_tiling()
    with torch.no_grad():
        want = vae.decode(z)
    assert (got - want).abs().max().item() <= TOL


def test_tracing_it_leaves_no_cache_behind():
    vae = vidtok(seed=3)
    tw.TiledVAE(vae, progress=False)
    assert all(c is None for c in _caches(vae)) and all(
        m.is_first_chunk for m in vae.modules() if hasattr(m, "is_first_chunk"))


def test_gradients_through_the_decode_equal_the_stock_vae(vae):
    tv = tw.TiledVAE(vae, tile_size=2, progress=False)
    d = vae.decoder
    w = torch.randn(1, 3, 5, 12, 20, generator=torch.Generator().manual_seed(5))
    same_gradients(vae, tv, latent(2, 3, 5, seed=6),
                   [d.conv_in.conv.weight, d.up_temporal[1].upsample.mix_factor,
                    d.up_temporal[2].block[0].conv1.conv.weight, d.mid.attn_1.q.conv.weight,
                    d.up[1].block[0].norm1.norm.weight],
                   lambda m, t: (m.decode(t) * w).sum())


def test_its_fsq_encode_and_decode_are_exact():
    """regularizer="fsq": encode returns its quantised latent and codebook indices (the tiled codes are the
    stock ones, position by position); decode takes the quantised latent."""
    vae = vidtok(regularizer="fsq")
    tv = tw.TiledVAE(vae, tile_size=2, progress=False)
    x = video(8, 12, 20, seed=2)
    with torch.no_grad():
        want, want_idx = vae.encode(x)
        got, idx = tv.encode(x)
        assert got.shape == want.shape == (1, 4, 2, 3, 5) and idx.shape == want_idx.shape == (1, 2, 3, 5)
        assert (got - want).abs().max().item() <= TOL
        assert idx.dtype == want_idx.dtype == torch.int32 and torch.equal(idx, want_idx)
        assert (tv.decode(got) - vae.decode(want)).abs().max().item() <= TOL


@pytest.fixture(scope="module")
def non_causal():
    vae = vidtok(is_causal=False)
    return vae, tw.TiledVAE(vae, tile_size=2, progress=False)


def test_a_non_causal_decode_is_exact_and_keeps_what_its_own_keeps(non_causal, caplog):
    """is_causal=False: zero-padded convolutions in time, its temporal upsamplers' nearest interpolation of
    each sample of the batch apart; its decode keeps a multiple of num_latent_frames_batch_size (4) latent
    frames (5 -> 4, with a warning), 4 video frames each; a batch of two."""
    vae, tv = non_causal
    for z in (latent(4, 3, 5, seed=1), latent(5, 3, 5, seed=2), latent(4, 3, 5, seed=3, batch=2)):
        with torch.no_grad(), caplog.at_level("WARNING", logger="tilewise"):
            want, got = vae.decode(z), tv.decode(z)
        assert got.shape == want.shape == (z.shape[0], 3, 16, 12, 20)
        assert (got - want).abs().max().item() <= TOL
    assert caplog.text.count("decodes 4 of 5 input frames, as its own decode does (the last 1 dropped)") == 1
    ops = tv.program("decode").ops
    assert not [op for op in ops if isinstance(op, Local | Whole)]
    assert [getattr(op, "label", "") for op in ops].count("nearest x2,1,1") == 2  # (its temporal upsamplers)


def test_a_non_causal_encode_is_exact(non_causal):
    vae, tv = non_causal
    for frames in (8, 9):  # (9: its downsamplers pad one zero frame behind, then pool)
        x = video(frames, 12, 20, seed=frames)
        with torch.no_grad():
            want, got = vae.encode(x).latent_dist, tv.encode(x).latent_dist
        assert got.mean.shape == want.mean.shape == (1, 4, 2, 3, 5)
        assert (got.parameters - want.parameters).abs().max().item() <= TOL
    assert not [op for op in tv.program("encode").ops if isinstance(op, Local | Whole)]


def test_a_non_causal_call_of_fewer_frames_than_its_own_takes_is_refused_at_the_call(non_causal):
    vae, tv = non_causal
    z, x = latent(2, 3, 5), video(3, 12, 20)
    with torch.no_grad(), pytest.raises(AssertionError, match="Too short latent frames"):
        vae.decode(z)  # (the stock decode asserts it too)
    with pytest.raises(ValueError, match=r"is_causal=False decodes a multiple of 4 latent frames.*got 2"):
        tv.decode(z)
    with torch.no_grad(), pytest.raises(RuntimeError, match="smaller than kernel size"):
        vae.encode(x)  # (its downsamplers pad one zero frame behind, then pool 3: it fails too)
    with pytest.raises(ValueError, match=r"encodes at least 4 frames.*a zero frame behind.*fails on 3"):
        tv.encode(x)


def test_a_sample_of_a_video_batch_used_as_anything_but_a_batch_of_one_is_refused_by_name():
    """The rule that places a loop over the batch (`trace.video_samples`) takes only each sample back in a
    batch of one: a module reading a sample's channels as its first axis is refused, with its path."""
    from tilewise.locality.trace.lower import lower_traced

    class Samples(torch.nn.Module):
        def forward(self, x):
            return torch.cat([sx[:1].unsqueeze(0) for sx in x], dim=0)

    m = Samples()
    with pytest.raises(LoweringError, match="a call on one sample of a video value's batch"):
        lower_traced(m, m, torch.empty(1, 4, 3, 8, 8, device="meta"))
