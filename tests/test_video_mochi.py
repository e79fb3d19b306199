"""Mochi's VAE through TiledVAE: its GroupNorms of each frame (the frames folded into the batch, in chunks)
as sync ops whose statistics are merged over every tile per (sample, frame, group); its encoder's Fourier
features and attention over each position's frames; its 3x temporal unpatchify measured across frame
counts. Decode, encode and gradients equal the stock VAE's one pass (fp32, max abs <= 1e-4)."""

import pytest

torch = pytest.importorskip("torch")

from video_vae_support import latent, mochi, same_gradients, video, video_vae  # noqa: E402

import tilewise as tw  # noqa: E402
from tilewise.locality import LoweringError  # noqa: E402
from tilewise.locality.ops3d_sync import ColumnAttention, FrameGroupNorm  # noqa: E402
from tilewise.locality.program3d import VideoProgram  # noqa: E402
from tilewise.vae.video.executor import VideoExecutor  # noqa: E402

TOL = 1e-4


# odd latent sizes, tiles of 2 latent px (a 3 x 2 grid); one latent frame (the first 5 of 6 decoded frames
# dropped: 1 frame out), two, three; a batch of two
@pytest.mark.parametrize("frames,batch", [(1, 1), (2, 1), (3, 2)])
def test_mochi_decode_is_exact(frames, batch):
    vae = video_vae("mochi")
    tv = tw.TiledVAE(vae, tile_size=2, progress=False)
    z = latent(frames, 5, 3, seed=frames, batch=batch)
    with torch.no_grad():
        ref = vae.decode(z).sample
        out = tv.decode(z).sample
    assert out.shape == ref.shape == (batch, 3, 1 + 6 * (frames - 1), 40, 24)
    assert (out - ref).abs().max() <= TOL
    p = tv.program("decode")
    norms = [op for op in p.ops if isinstance(op, FrameGroupNorm)]
    assert len(norms) == 2 * 5 and all(op.sync for op in norms)  # (two a resnet, five resnets)
    plan = tv.plan(tuple(z.shape))
    assert plan.grid == (3, 2) and plan.sync_ops == len(norms)
    # (float64 mean and var per (sample, frame, group) of every norm's input frames)
    frames_in = p.frames(p.chunks(frames))
    assert plan.stats_bytes == sum(2 * batch * 32 * 8 * sum(frames_in[op.src[0]]) for op in norms)


def test_a_latent_within_one_tile_decodes_exactly_untiled():
    # (the untiled program run: its GroupNorms of each frame take each frame's statistics there too; they
    # took them over every frame, 0.30 off the stock decode)
    vae = video_vae("mochi")
    z = latent(3, 4, 5)
    with torch.no_grad():
        ref = vae.decode(z).sample
        out = tw.TiledVAE(vae, tile_size=64, progress=False).decode(z).sample
    assert (out - ref).abs().max() <= TOL


# frame counts the causal strided convolutions pad or drop (7 = 1 + 6; 2 and 6 give one latent frame)
@pytest.mark.parametrize("frames", [1, 2, 7, 8])
def test_mochi_encode_is_exact(frames):
    vae = video_vae("mochi")
    tv = tw.TiledVAE(vae, tile_size=1, progress=False)
    x = video(frames, 16, 24, seed=frames)
    with torch.no_grad():
        ref = vae.encode(x).latent_dist
        out = tv.encode(x).latent_dist
    assert out.mean.shape == ref.mean.shape == (1, 4, 1 + (frames - 1) // 6, 2, 3)
    assert (out.mean - ref.mean).abs().max() <= TOL and (out.logvar - ref.logvar).abs().max() <= TOL
    p = tv.program("encode")
    assert p.in_channels == 3  # (its in_channels, 15, count the Fourier features of the 3 it takes)
    assert sum(isinstance(op, ColumnAttention) for op in p.ops) == 4


def test_both_orders_are_exact():
    vae = video_vae("mochi")
    p = tw.TiledVAE(vae, progress=False).program("decode")
    z = latent(2, 3, 4, seed=3)
    with torch.no_grad():
        ref = vae.decode(z).sample
        for order, staging in (("frames", "host"), ("tiles", "device")):
            ex = VideoExecutor(p, 2, p.input, staging=staging, order=order, progress=False)
            assert (ex.run(z).output - ref).abs().max() <= TOL


def test_gradients_through_the_decode_equal_the_stock_vae():
    vae = video_vae("mochi")
    tv = tw.TiledVAE(vae, tile_size=2, progress=False)
    d = vae.decoder
    w = torch.randn(1, 3, 7, 16, 24, generator=torch.Generator().manual_seed(5))
    same_gradients(vae, tv, latent(2, 2, 3, seed=4), [d.up_blocks[0].resnets[0].norm1.norm_layer.weight,
                                                         d.conv_in.weight],
                    lambda m, t: (m.decode(t).sample * w).sum())


def test_gradients_through_the_encode_equal_the_stock_vae():
    vae = video_vae("mochi")
    tv = tw.TiledVAE(vae, tile_size=1, progress=False)
    e = vae.encoder
    same_gradients(vae, tv, video(7, 16, 16, seed=6), [e.down_blocks[1].attentions[0].to_q.weight,
                                                          e.norm_out.norm_layer.bias, e.proj_in.weight],
                    lambda m, t: m.encode(t).latent_dist.mean.square().sum())


def test_its_own_framewise_and_tiled_paths_are_noted_and_the_tiled_result_is_the_one_pass(caplog):
    """Mochi's framewise decoding pads each chunk of latent frames on its own, its use_tiling blends tiles
    (both approximate): TiledVAE equals the one pass and says so."""
    vae = video_vae("mochi")
    tv = tw.TiledVAE(vae, tile_size=1, progress=False)
    z = latent(3, 2, 3, seed=8)
    try:
        with torch.no_grad():
            ref = vae.decode(z).sample
            vae.use_framewise_decoding = True
            own = vae.decode(z).sample
            with caplog.at_level("INFO", logger="tilewise"):
                out = tv.decode(z).sample
            said = "would decode these 3 latent frames framewise (use_framewise_decoding: chunks of 2"
            assert said in caplog.text
            vae.use_framewise_decoding = False
            vae.enable_tiling(16, 16, 8, 8)
            caplog.clear()
            with caplog.at_level("INFO", logger="tilewise"):
                tiled = tv.decode(z).sample
            assert "with its own spatial tiling (use_tiling: tiles of 16 x 16 px blended" in caplog.text
    finally:
        vae.use_framewise_decoding = vae.use_tiling = False
    assert (own - ref).abs().max() > 0.01  # (the chunks' own padding shows)
    assert (out - ref).abs().max() <= TOL and (tiled - ref).abs().max() <= TOL


def test_the_framewise_modes_constant_padding_is_refused_by_name():
    vae = mochi()
    vae._enable_framewise_decoding()
    with pytest.raises(LoweringError, match=r"AutoencoderKLMochi: its causal convolutions pad with pad_mode "
                                            r"\['constant'\]"):
        tw.TiledVAE(vae, progress=False)


def test_keeping_the_first_frames_is_followed():
    vae = video_vae("mochi")
    tv = tw.TiledVAE(vae, tile_size=2, progress=False)
    z = latent(2, 3, 2, seed=9)
    vae.drop_last_temporal_frames = False
    try:
        with torch.no_grad():
            ref = vae.decode(z).sample
            out = tv.decode(z).sample
    finally:
        vae.drop_last_temporal_frames = True
    assert out.shape == ref.shape == (1, 3, 12, 24, 16) and (out - ref).abs().max() <= TOL


def test_a_norm_of_each_frame_runs_in_a_program_of_several_steps():
    """Per-frame statistics need no frame but their own: a causal program of 1 + 2 k frames a step with
    a GroupNorm of each frame between causal convolutions equals the one-pass module."""
    from diffusers.models.autoencoders.autoencoder_kl_mochi import MochiChunkedGroupNorm3D

    from tilewise.locality.trace import lower_traced

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv3d(4, 32, 3, padding=(0, 1, 1))
            self.norm = MochiChunkedGroupNorm3D(32, num_groups=8, chunk_size=3)

        def forward(self, x):
            return self.norm(self.conv(torch.nn.functional.pad(x, (0, 0, 0, 0, 2, 0), mode="replicate")))

    torch.manual_seed(0)
    m = Block().eval()
    one = lower_traced(m, m, torch.empty(1, 4, 9, 13, 11, device="meta"))
    p = VideoProgram(ops=one.ops, input=one.input, output=one.output, in_channels=4, name="steps", first=1,
                     every=2)
    x = latent(7, 5, 6, seed=10, batch=2)
    with torch.no_grad():
        ref = m(x)
        res = VideoExecutor(p, 2, p.input, progress=False).run(x)
    assert len(p.chunks(7)) == 4 and (res.output - ref).abs().max() <= TOL


def _decode_on_ranks(rank: int, world: int):
    torch.set_num_threads(1)
    tv = tw.TiledVAE(video_vae("mochi"), tile_size=2, progress=False, process_group="default")
    with torch.no_grad():
        return tv.decode(latent(2, 5, 3, seed=11)).sample


@pytest.mark.skipif(not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
                    reason="torch.distributed with gloo is needed")
def test_a_process_group_merges_each_frames_statistics_over_the_ranks():
    from tilewise import distributed as td

    vae = video_vae("mochi")
    with torch.no_grad():
        ref = vae.decode(latent(2, 5, 3, seed=11)).sample
    res = td.spawn(_decode_on_ranks, 2, start_method="fork", limit=120.0, timeout=60)
    for out in res:
        assert out.shape == ref.shape and (out - ref).abs().max() <= TOL


def test_an_attention_over_each_positions_frames_is_refused_in_a_program_of_several_steps():
    p = tw.TiledVAE(video_vae("mochi"), progress=False).program("encode")
    several = VideoProgram(ops=p.ops, input=p.input, output=p.output, in_channels=p.in_channels,
                           name="several", first=1, every=6)
    with pytest.raises(ValueError, match=r"attentions\.0 \(attention over each position's frames\) reduces "
                                         "over the frames of a causal step"):
        VideoExecutor(several, 2, p.output, progress=False)
