"""Cosmos' VAE through TiledVAE: its haar wavelet patcher and unpatcher, causal convolutions, GroupNorms of
each frame, attention over each frame's tokens (a sync op: keys and values of the whole frame) and causal
attention over each position's frames (its tril mask read from the calls that make it), traced from what
they compute (`locality.trace.video_sdpa`). Decode, encode and gradients equal the stock VAE's (fp32, max
abs <= 1e-4)."""

import pytest

torch = pytest.importorskip("torch")

from diffusers.models.autoencoders.vae import IdentityDistribution  # noqa: E402
from video_vae_support import cosmos, latent, same_gradients, video, video_vae  # noqa: E402

import tilewise as tw  # noqa: E402
from tilewise.locality import LoweringError  # noqa: E402
from tilewise.locality.ops3d_sync import ColumnSDPA, FrameGroupNorm, FrameSDPA  # noqa: E402
from tilewise.vae.video.executor import VideoExecutor  # noqa: E402

TOL = 1e-4


# odd latent sizes, tiles of 2 latent px (a 3 x 2 grid); 1, 2, 3 latent frames (1, 9, 17 out); a batch of two
@pytest.mark.parametrize("frames,batch", [(1, 1), (2, 1), (3, 2)])
def test_cosmos_decode_is_exact(frames, batch):
    vae = video_vae("cosmos")
    tv = tw.TiledVAE(vae, tile_size=2, progress=False)
    z = latent(frames, 5, 3, seed=frames, batch=batch)
    with torch.no_grad():
        ref = vae.decode(z).sample
        out = tv.decode(z).sample
        plain = tv.decode(z, return_dict=False)
    assert out.shape == ref.shape == (batch, 3, 1 + 8 * (frames - 1), 40, 24)
    assert (out - ref).abs().max() <= TOL
    assert isinstance(plain, tuple) and (plain[0] - ref).abs().max() <= TOL
    p = tv.program("decode")
    # (the mid block's and up block 1's two layers: attention over each frame's tokens, then over each
    # position's frames, causal)
    spatial = [op for op in p.ops if isinstance(op, FrameSDPA)]
    temporal = [op for op in p.ops if isinstance(op, ColumnSDPA)]
    assert len(spatial) == len(temporal) == 3 and all(op.causal for op in temporal)
    plan = tv.plan(tuple(z.shape))
    norms = [op for op in p.ops if isinstance(op, FrameGroupNorm)]
    assert plan.grid == (3, 2) and plan.sync_ops == len(norms) + len(spatial)


# frame counts its patcher pads (a reflected frame where the strided wavelet steps round up: 2, 10) or takes
# as they are (1, 9); odd image sizes in latent pixels (3 x 2 tiles of 1 latent px)
@pytest.mark.parametrize("frames", [1, 2, 9, 10])
def test_cosmos_encode_is_exact(frames):
    vae = video_vae("cosmos")
    tv = tw.TiledVAE(vae, tile_size=1, progress=False)
    x = video(frames, 24, 16, seed=frames)
    with torch.no_grad():
        ref = vae.encode(x).latent_dist
        out = tv.encode(x).latent_dist
        plain = tv.encode(x, return_dict=False)[0]
    assert isinstance(out, IdentityDistribution) and isinstance(plain, IdentityDistribution)
    assert out.mode().shape == ref.mode().shape == (1, 4, 1 + (frames + 3) // 8, 3, 2)
    assert (out.mode() - ref.mode()).abs().max() <= TOL and (plain.sample() - ref.mode()).abs().max() <= TOL
    assert tv.plan(tuple(x.shape), kind="encode").grid == (3, 2)
    p = tv.program("encode")
    counts = [sum(isinstance(op, kind) for op in p.ops) for kind in (FrameSDPA, ColumnSDPA)]
    assert counts == [2, 2]


def test_forward_encodes_and_decodes_on_the_tiled_paths():
    vae = video_vae("cosmos")
    tv = tw.TiledVAE(vae, tile_size=1, progress=False)
    x = video(9, 16, 16, seed=11)
    with torch.no_grad():
        assert (tv(x).sample - vae(x).sample).abs().max() <= TOL


def test_gradients_through_the_decode_equal_the_stock_vae():
    vae = video_vae("cosmos")
    tv = tw.TiledVAE(vae, tile_size=2, progress=False)
    mid = vae.decoder.mid_block
    w = torch.randn(1, 3, 9, 24, 32, generator=torch.Generator().manual_seed(5))
    same_gradients(vae, tv, latent(2, 3, 4, seed=4),
                    [mid.attentions[0].to_k.weight, mid.temp_attentions[0].to_q.weight,
                     mid.attentions[0].norm.norm.weight, vae.decoder.conv_in.conv_s.weight],
                    lambda m, t: (m.decode(t).sample * w).sum())


def test_a_mask_other_than_the_causal_one_is_refused_at_construction():
    """A temporal attention given a mask the lowering cannot read as tril(ones(T, T)) (here: every frame
    attends to every frame but the first) is refused by name, never run with the causal one."""
    from diffusers.models.autoencoders import autoencoder_kl_cosmos as ck

    class Block(ck.CosmosMidBlock3d):
        def forward(self, hidden_states):
            hidden_states = self.resnets[0](hidden_states)
            t = hidden_states.size(2)
            mask = torch.ones(t, t, dtype=torch.bool, device=hidden_states.device)
            mask[:, 0] = False
            mask[0, 0] = True
            hidden_states = self.temp_attentions[0](self.attentions[0](hidden_states), mask)
            return self.resnets[1](hidden_states)

    vae = cosmos()
    old = vae.decoder.mid_block
    vae.decoder.mid_block = Block(16, 1, 0.0)
    vae.decoder.mid_block.load_state_dict(old.state_dict())
    said = (r"AutoencoderKLCosmos \(decode\).*'scaled_dot_product_attention' at "
            r"'decoder\.mid_block\.temp_attentions\.0'.*not the causal one")
    with pytest.raises(LoweringError, match=said):
        tw.TiledVAE(vae, progress=False)


def test_both_orders_and_stagings_are_exact():
    vae = video_vae("cosmos")
    p = tw.TiledVAE(vae, progress=False).program("decode")
    z = latent(2, 3, 4, seed=3)
    with torch.no_grad():
        ref = vae.decode(z).sample
        for order, staging in (("frames", "host"), ("tiles", "device")):
            ex = VideoExecutor(p, 2, p.input, staging=staging, order=order, progress=False)
            assert (ex.run(z).output - ref).abs().max() <= TOL


def test_gradients_through_the_encode_equal_the_stock_vae():
    vae = video_vae("cosmos")
    tv = tw.TiledVAE(vae, tile_size=1, progress=False)
    e, block = vae.encoder, vae.encoder.down_blocks[1]
    same_gradients(vae, tv, video(9, 16, 16, seed=6),
                    [block.attentions[0].to_v.weight, block.temp_attentions[0].to_k.weight,
                     e.norm_out.norm.bias, e.conv_in.conv_t.weight],
                    lambda m, t: m.encode(t).latent_dist.mode().square().sum())
