"""Allegro's VAE (`AutoencoderKLAllegro`) through TiledVAE, traced from what it computes: its decode and
encode equal the one pass its own tiling approximates (post_quant_conv of each frame, then the decoder on
the whole latent; the encoder on the whole video, then quant_conv), fp32 max abs <= 1e-4; where its own
tiling takes one cube (no blending) that is the stock decode / encode itself."""

import pytest

torch = pytest.importorskip("torch")

from video_vae_support import allegro, latent, video  # noqa: E402

import tilewise as tw  # noqa: E402
from tilewise.vae.video_allegro import allegro_decode, allegro_encode  # noqa: E402

TOL = 1e-4


@pytest.fixture(scope="module")
def vae():
    return allegro(blocks=4)


def test_decode_is_the_one_pass_and_returns_frames_first(vae, caplog):
    tv = tw.TiledVAE(vae, tile_size=3, progress=False)
    z = latent(3, 5, 7, seed=1)
    with torch.no_grad(), caplog.at_level("INFO", logger="tilewise"):
        ref = allegro_decode(vae, z).permute(0, 2, 1, 3, 4)
        out = tv.decode(z)
    assert out.sample.shape == ref.shape == (1, 12, 3, 40, 56)  # ((B, T, C, H, W), as its decode)
    assert (out.sample - ref).abs().max() <= TOL
    assert tv.plan(tuple(z.shape)).grid == (2, 3)
    assert caplog.text.count("decodes only through its own tiling") == 1


def test_one_cube_of_its_own_tiling_is_the_tiled_decode_and_encode(vae):
    """A latent of exactly one of its cubes ((24, 32, 32) px: (6, 4, 4) latent): its tiled_decode /
    tiled_encode blend nothing, so the stock call is the one pass."""
    tv = tw.TiledVAE(vae, tile_size=2, progress=False)
    vae.enable_tiling()
    try:
        z, x = latent(6, 4, 4, seed=2), video(24, 32, 32, seed=3)
        with torch.no_grad():
            ref, out = vae.decode(z).sample, tv.decode(z, return_dict=False)[0]
            assert out.shape == ref.shape == (1, 24, 3, 32, 32)
            assert (out - ref).abs().max() <= TOL
            ref, got = vae.encode(x).latent_dist, tv.encode(x).latent_dist
            assert got.mean.shape == ref.mean.shape == (1, 4, 6, 4, 4)
            assert (got.parameters - ref.parameters).abs().max() <= TOL
    finally:
        vae.disable_tiling()


def test_encode_is_the_one_pass(vae):
    tv = tw.TiledVAE(vae, tile_size=2, progress=False)
    x = video(8, 40, 56, seed=4)
    with torch.no_grad():
        ref = allegro_encode(vae, x)
        out = tv.encode(x).latent_dist
    assert out.mean.shape == (1, 4, 2, 5, 7) and (out.parameters - ref).abs().max() <= TOL


def test_a_frame_count_its_encoder_does_not_take_is_refused_at_the_call(vae):
    tv = tw.TiledVAE(vae, progress=False)
    with pytest.raises(ValueError, match=r"encodes a multiple of 4 frames.*fails on 6"):
        tv.encode(video(6, 16, 16))


def test_drops_into_a_stock_allegro_pipeline(vae):
    """pipe.vae = TiledVAE(pipe.vae) in AllegroPipeline (a tiny T5 over letters, a one-layer transformer):
    the video it decodes (12 frames from 3 latent frames, a 2 x 3 grid of tiles) equals the one pass on the
    latents the same call denoises (its stock VAE decodes only through its own cubes)."""
    from diffusers import AllegroPipeline, AllegroTransformer3DModel, EulerAncestralDiscreteScheduler
    from tiny_folders import _t5_vocab
    from transformers import T5Config, T5EncoderModel, T5TokenizerFast

    torch.manual_seed(0)
    vocab = _t5_vocab()
    text = T5EncoderModel(T5Config(vocab_size=len(vocab), d_model=16, d_kv=8, d_ff=32, num_layers=1,
                                   num_heads=2)).eval()
    transformer = AllegroTransformer3DModel(patch_size=2, num_attention_heads=2, attention_head_dim=12,
                                            in_channels=4, out_channels=4, num_layers=1,
                                            cross_attention_dim=24, caption_channels=16, sample_height=4,
                                            sample_width=8, sample_frames=3).eval()
    pipe = AllegroPipeline(tokenizer=T5TokenizerFast(vocab=vocab, extra_ids=0), text_encoder=text, vae=vae,
                           transformer=transformer, scheduler=EulerAncestralDiscreteScheduler())
    pipe.set_progress_bar_config(disable=True)
    call = dict(prompt="a cat", num_frames=12, height=32, width=64, num_inference_steps=2, guidance_scale=1.0,
                max_sequence_length=16, clean_caption=False)
    z = pipe(generator=torch.Generator().manual_seed(1), output_type="latent", **call).frames
    pipe.vae = tw.TiledVAE(vae, tile_size=3, progress=False)
    out = pipe(generator=torch.Generator().manual_seed(1), output_type="pt", **call).frames
    with torch.no_grad():
        ref = allegro_decode(vae, z / vae.config.scaling_factor)
    ref = pipe.video_processor.postprocess_video(ref, output_type="pt")
    assert pipe.vae.plan(tuple(z.shape)).grid == (2, 3)
    assert out.shape == ref.shape == (1, 12, 3, 32, 64) and (out - ref).abs().max() <= TOL
    assert ((ref > 0) & (ref < 1)).float().mean() > 0.5  # (most pixels not clamped: the test sees them)


@pytest.mark.slow  # (~40 s on 2 shared cores: 16 cube decodes / encodes, three whole passes)
def test_its_own_blended_cubes_measured_against_the_one_pass(vae, capsys):
    """What the stock VAE gives up: cubes of (8, 32, 32) video frames x px every (4, 16, 16) (latent (2, 4,
    4) every (1, 2, 2): 2 x 2 x 2 cubes of a (3, 6, 6) latent, 12 x 48 x 48 px), decoded / encoded alone and
    blended, against the one pass; tilewise's tiles against the same."""
    kernel, stride = vae.kernel, vae.stride
    vae.kernel, vae.stride = (8, 32, 32), (4, 16, 16)
    vae.enable_tiling()
    tv = tw.TiledVAE(vae, tile_size=2, progress=False)
    try:
        z, x = latent(3, 6, 6, seed=5), video(12, 48, 48, seed=6)
        with torch.no_grad():
            ref = allegro_decode(vae, z).permute(0, 2, 1, 3, 4)
            stock, ours = vae.decode(z).sample, tv.decode(z).sample
            ref_e = allegro_encode(vae, x)
            stock_e, ours_e = vae.encode(x).latent_dist.parameters, tv.encode(x).latent_dist.parameters
    finally:
        vae.kernel, vae.stride = kernel, stride
        vae.disable_tiling()
    for what, s, o, r in (("decode", stock, ours, ref), ("encode", stock_e, ours_e, ref_e)):
        assert s.shape == o.shape == r.shape
        err_s, err_o = (s - r).abs(), (o - r).abs()
        print(f"allegro {what}: its blended cubes max abs {err_s.max():.3g} mean abs {err_s.mean():.3g}; "
              f"tilewise max abs {err_o.max():.3g} mean abs {err_o.mean():.3g} (against the one pass)")
        assert err_o.max() <= TOL and err_s.max() > 100 * err_o.max()
    assert tv.plan(tuple(z.shape)).grid == (3, 3)
