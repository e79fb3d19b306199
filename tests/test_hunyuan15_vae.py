"""HunyuanVideo 1.5's VAE (`AutoencoderKLHunyuanVideo15`) through TiledVAE, traced from what it computes:
causal convolutions, RMS norms over the channels, its up / down samplers (a channel <-> frame and space
rearrangement with the first frame apart, and a channel-repeat or channel-mean shortcut: measured, their
frames 2 t - 1 / (t + 1) / 2), the mid-block's attention over every token with a causal mask between
frames. Decode, encode and gradients equal the stock VAE's (fp32, max abs <= 1e-4)."""

import pytest

torch = pytest.importorskip("torch")

from video_vae_support import latent, same_gradients, video, video_vae  # noqa: E402

import tilewise as tw  # noqa: E402
from tilewise.vae.video.executor import VideoExecutor  # noqa: E402

TOL = 1e-4


# odd latent sizes, tiles of 2 latent px (a 2 x 3 grid); 1, 2, 3 latent frames (1, 5, 9 out: its temporal
# upsamplers make 2 t - 1 frames of t, the first apart); one video a call (the stock attention's mask,
# (B, N, N), does not broadcast over a batch of two: its own decode fails there)
@pytest.mark.parametrize("frames", [1, 3])
def test_hunyuan15_decode_is_exact(frames):
    vae = video_vae("hunyuan15")
    tv = tw.TiledVAE(vae, tile_size=2, progress=False)
    z = latent(frames, 3, 5, seed=frames)
    with torch.no_grad():
        ref = vae.decode(z).sample
        out = tv.decode(z).sample
    assert out.shape == ref.shape == (1, 3, 1 + 4 * (frames - 1), 24, 40)
    assert (out - ref).abs().max() <= TOL
    plan = tv.plan(tuple(z.shape))
    assert plan.grid == (2, 3)


# the frame counts its encoder takes (1 + 4 k: its temporal downsamplers take the first frame apart and
# pairs of the others); odd image sizes in latent pixels (3 x 5, tiles of 2: a 2 x 3 grid)
@pytest.mark.parametrize("frames", [1, 5, 9])
def test_hunyuan15_encode_is_exact(frames):
    vae = video_vae("hunyuan15")
    tv = tw.TiledVAE(vae, tile_size=2, progress=False)
    x = video(frames, 24, 40, seed=frames)
    with torch.no_grad():
        ref = vae.encode(x).latent_dist
        out = tv.encode(x).latent_dist
    assert out.mean.shape == ref.mean.shape == (1, 4, 1 + (frames - 1) // 4, 3, 5)
    assert (out.mean - ref.mean).abs().max() <= TOL and (out.logvar - ref.logvar).abs().max() <= TOL
    assert tv.plan((1, 3, frames, 24, 40), kind="encode").grid == (2, 3)


def test_a_frame_count_its_encoder_does_not_take_is_refused_at_the_call():
    """4 frames: the stock encoder's downsampler cannot pair them (a view fails); the tiled encode refuses
    the call, naming the counts it takes, never returns latents the stock VAE would not make."""
    vae = video_vae("hunyuan15")
    tv = tw.TiledVAE(vae, tile_size=2, progress=False)
    x = video(4, 24, 40)
    with torch.no_grad(), pytest.raises(RuntimeError, match="is invalid for input of size"):
        vae.encode(x)
    with pytest.raises(ValueError, match=r"encode\(\): AutoencoderKLHunyuanVideo15 encodes 1 \+ 4 k frames"):
        tv.encode(x)


def test_analyze_reports_its_program():
    tv = tw.TiledVAE(video_vae("hunyuan15"), progress=False)
    for kind, scale in (("decode", 8.0), ("encode", 0.125)):
        r = tw.analyze(tv.program(kind))
        # (its mid-block attention at the latent's resolution, run whole: one output reads every token)
        assert [s.kind.value for s in r.segments] == ["local", "whole", "local"] and r.scale == scale
        assert [name for name, _ in r.sync_ops] == [f"{kind}r.mid_block.attentions.0"]
        assert not r.exact_tileable


@pytest.mark.slow
def test_both_orders_and_stagings_are_exact_and_fast_mode_runs_exact():
    vae = video_vae("hunyuan15")
    p = tw.TiledVAE(vae, progress=False).program("decode")
    z = latent(2, 3, 5, seed=3)
    with torch.no_grad():
        ref = vae.decode(z).sample
        for order, staging in (("frames", "host"), ("tiles", "device")):
            ex = VideoExecutor(p, 2, p.input, staging=staging, order=order, progress=False)
            assert (ex.run(z).output - ref).abs().max() <= TOL
        fast = tw.TiledVAE(vae, tile_size=2, mode="fast", progress=False)
        assert (fast.decode(z).sample - ref).abs().max() <= TOL


def test_gradients_through_the_decode_equal_the_stock_vae():
    vae = video_vae("hunyuan15")
    tv = tw.TiledVAE(vae, tile_size=1, progress=False)
    d = vae.decoder
    w = torch.randn(1, 3, 5, 16, 16, generator=torch.Generator().manual_seed(5))
    same_gradients(vae, tv, latent(2, 2, 2, seed=4),
                    [d.mid_block.attentions[0].to_k.weight, d.up_blocks[0].upsamplers[0].conv.conv.weight,
                     d.up_blocks[1].resnets[0].norm1.gamma, d.conv_in.conv.weight],
                    lambda m, t: (m.decode(t).sample * w).sum())


def test_gradients_through_the_encode_equal_the_stock_vae():
    vae = video_vae("hunyuan15")
    tv = tw.TiledVAE(vae, tile_size=2, progress=False)
    e = vae.encoder
    same_gradients(vae, tv, video(5, 16, 24, seed=6),
                    [e.mid_block.attentions[0].to_v.weight, e.down_blocks[1].downsamplers[0].conv.conv.weight,
                     e.norm_out.gamma, e.conv_in.conv.weight],
                    lambda m, t: m.encode(t).latent_dist.mode().square().sum())


@pytest.mark.slow
def test_drops_into_a_stock_hunyuan_video15_pipeline():
    """pipe.vae = TiledVAE(pipe.vae) in HunyuanVideo15Pipeline (prompt embeddings given: its text encoders
    are not built): the decoded video (9 frames from 3 latent frames, a 2 x 4 grid of tiles of 3) equals the
    stock VAE's."""
    from tiny_denoisers import hunyuan_video15

    pipe, call = hunyuan_video15()
    pipe.vae = video_vae("hunyuan15")  # (the shared instance: lowered once a session)
    pipe.set_progress_bar_config(disable=True)
    call = dict(call, num_inference_steps=2, output_type="pt")
    ref = pipe(generator=torch.Generator().manual_seed(1), **call).frames
    pipe.vae = tw.TiledVAE(pipe.vae, tile_size=3, progress=False)
    out = pipe(generator=torch.Generator().manual_seed(1), **call).frames
    assert pipe.vae.plan((1, 4, 3, 6, 10)).grid == (2, 4)
    assert out.shape == ref.shape == (1, 9, 3, 48, 80) and (out - ref).abs().max() <= TOL
    assert ((ref > 0) & (ref < 1)).float().mean() > 0.5  # (most pixels not clamped: the test sees them)
