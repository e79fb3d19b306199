"""Stable Video Diffusion's VAE (AutoencoderKLTemporalDecoder) through TiledVAE, against the stock VAE:
decode(z, num_frames) of the frames of each video in the batch (its temporal convolutions and GroupNorms
over frames x space mix the frames of one call) tiled in space, exact; encode (the 2-D encoder) exact;
the pipeline's decode_latents (chunks of decode_chunk_size frames, each one call) and the whole tiny
pipeline with `pipe.vae = TiledVAE(pipe.vae)`; plans and the analysis; gradients through the encode and
the decode (its AlphaBlenders' per-call weights backed to mix_factor)."""

import copy

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("diffusers")

from video_vae_support import svd  # noqa: E402

import tilewise as tw  # noqa: E402
from tilewise.locality.ops3d_sync import FrameGroupNorm, StepAttention, VideoGroupNorm  # noqa: E402

TOL = 1e-4  # fp32, exact paths


VAE = svd()


def _latents(b: int, t: int, h: int = 7, w: int = 11, seed: int = 1):
    return torch.randn(b * t, 4, h, w, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("b,t", [(1, 1), (1, 2), (1, 3), (2, 2)])
def test_tiled_decode_of_the_frames_of_each_video_equals_stock(b, t):
    z = _latents(b, t)
    tv = tw.TiledVAE(VAE, tile_size=4, progress=False)
    assert tv.plan((b, 4, t, 7, 11)).grid == (2, 3)  # (odd latent sides: tiles of 4, 4 and 3 columns)
    with torch.no_grad():
        ref = VAE.decode(z, num_frames=t).sample
        out = tv.decode(z, num_frames=t) if b == 1 else tv.decode(z, t, return_dict=False)
    out = out.sample if b == 1 else out[0]
    assert out.shape == ref.shape == (b * t, 3, 14, 22)
    assert (out - ref).abs().max().item() <= TOL
    # (the frames mix: decoding them one call each differs from the call of all of them)
    if t == 3:
        with torch.no_grad():
            apart = torch.cat([VAE.decode(f, num_frames=1).sample for f in z.split(1)])
        assert (apart - ref).abs().max().item() > 1e-2


def test_one_tile_runs_the_untiled_program_exactly():
    # (a latent within one tile runs the program untiled: its GroupNorms of each frame take each frame's
    # statistics there too)
    z = _latents(1, 3, 5, 6)
    with torch.no_grad():
        ref = VAE.decode(z, num_frames=3).sample
        out = tw.TiledVAE(VAE, tile_size=64, progress=False).decode(z, num_frames=3).sample
    assert (out - ref).abs().max().item() <= TOL


def test_the_decode_program_mixes_frames_where_the_decoder_does():
    p = tw.TiledVAE(VAE, progress=False).program("decode")
    video = [op for op in p.ops if type(op) is VideoGroupNorm]  # (the temporal blocks' norms)
    frame = [op for op in p.ops if type(op) is FrameGroupNorm]  # (the spatial blocks', the attention's)
    attn = [op for op in p.ops if isinstance(op, StepAttention)]
    convs = [op for op in p.ops if "conv3d 3x1x1" in op.describe()]
    assert len(video) == 2 * 8 and len(convs) == 2 * 8 + 1  # (8 temporal blocks, time_conv_out)
    assert len(frame) == 2 * 8 + 2 and len(attn) == 1 and attn[0].own_frame  # (+ attention, conv_norm_out)
    assert all(op.pad_t == op.pad_end == 1 and op.fill == op.fill_end == "zeros" for op in convs)
    r = tw.analyze(p)
    assert r.scale == 2 and not r.exact_tileable  # (its GroupNorms and attention: sync ops)
    assert len(r.sync_ops) == len(video) + len(frame) + 1
    assert "decoder.mid_block.attentions.0" in dict(r.sync_ops)


def test_tiled_encode_equals_stock():
    x = torch.randn(3, 3, 28, 44, generator=torch.Generator().manual_seed(2))
    tv = tw.TiledVAE(VAE, tile_size=4, progress=False)
    with torch.no_grad():
        ref = VAE.encode(x).latent_dist
        out = tv.encode(x).latent_dist
        (plain,) = tv.encode(x, return_dict=False)
    assert type(out).__name__ == "DiagonalGaussianDistribution"
    assert (out.mean - ref.mean).abs().max().item() <= TOL
    assert (out.logvar - ref.logvar).abs().max().item() <= TOL
    assert torch.equal(plain.mean, out.mean)
    assert tv.plan((3, 3, 28, 44), "encode").grid == (4, 6)


def test_forward_takes_num_frames_as_the_stock_one():
    import inspect

    x = torch.randn(2, 3, 12, 16, generator=torch.Generator().manual_seed(3))
    tv = tw.TiledVAE(VAE, tile_size=4, progress=False)
    assert "num_frames" in inspect.signature(tv.forward).parameters  # (what the SVD pipeline looks for)
    with torch.no_grad():
        ref = VAE(x, num_frames=2).sample
        out = tv(x, num_frames=2).sample
    assert (out - ref).abs().max().item() <= TOL


def test_bad_calls_are_refused_with_the_values():
    tv = tw.TiledVAE(VAE, tile_size=4, progress=False)
    with pytest.raises(ValueError, match=r"5 rows, not a whole number of videos of num_frames=2"):
        tv.decode(_latents(1, 5), num_frames=2)
    with pytest.raises(ValueError, match=r"must be a \(B T, C, H, W\) tensor.*got \(1, 4, 2, 7, 11\)"):
        tv.decode(torch.zeros(1, 4, 2, 7, 11), num_frames=2)
    with pytest.raises(ValueError, match=r"num_frames must be a positive int.*got 0"):
        tv.decode(_latents(1, 2), num_frames=0)
    with pytest.raises(TypeError, match="num_frames"):
        tv.decode(_latents(1, 2))  # (required, as the stock decode's)
    with pytest.raises(ValueError, match=r"plans \(B, C, T, H, W\) shapes, got \(2, 4, 7, 11\)"):
        tv.plan((2, 4, 7, 11))


def _decode_grads(m, vae, z0, t: int):
    """(output, [z's gradient, every parameter's]) of sum(decode(z, num_frames=t) * a fixed random weight),
    with z0 in the VAE's dtype."""
    dtype = next(vae.parameters()).dtype
    z = z0.to(dtype).clone().requires_grad_(True)
    y = m.decode(z, num_frames=t).sample
    w = torch.randn(y.shape, generator=torch.Generator().manual_seed(5)).to(dtype)
    return y.detach(), torch.autograd.grad((y * w).sum(), [z, *vae.parameters()], allow_unused=True)


@pytest.mark.parametrize("t", [1, 3])
def test_decode_gradients_equal_the_stock_vae(t):
    """decode(z, num_frames) backward (issue #30): the AlphaBlenders' weights (per-call values of the
    image_only_indicator) computed once with autograd and read as leaves by the recomputed causal step, so
    z's and every parameter's gradient (mix_factor's included) are the stock VAE's, 2x3 tiles, fp32. A
    gradient that is zero in exact arithmetic (a convolution's bias right before a GroupNorm, which
    subtracts it again: the float64 stock VAE's gradient < 1e-12 of the largest) is rounding noise in
    both and has no scale of its own: it is checked to be zero within TOL of the largest gradient."""
    vae = copy.deepcopy(VAE)
    z0 = _latents(1, t, 5, 7)
    tv = tw.TiledVAE(vae, tile_size=3, progress=False)
    assert tv.plan((1, 4, t, 5, 7)).grid == (2, 3)
    names = ["z", *(n for n, _ in vae.named_parameters())]
    ref, rg = _decode_grads(vae, vae, z0, t)
    out, tg = _decode_grads(tv, vae, z0, t)
    exact = _decode_grads(vae.double(), vae, z0, t)[1]
    assert (out - ref).abs().max().item() <= TOL
    largest = max(float(g.abs().max()) for g in rg[1:] if g is not None)
    mixers = [n for n in names if n.endswith("mix_factor")]
    assert len(mixers) == 8 and all(rg[names.index(n)] is not None for n in mixers)
    for n, a, b, e in zip(names, tg, rg, exact, strict=True):
        assert (a is None) == (b is None), n
        if b is None:
            continue
        if float(e.abs().max()) <= 1e-12 * largest * (n != "z"):  # (zero in exact arithmetic)
            assert float(a.abs().max()) <= TOL * largest, n
        else:
            assert float((a - b).abs().max()) <= TOL * float(b.abs().max()), n


@pytest.mark.slow
def test_decode_gradients_in_float64_equal_the_stock_vae_to_rounding():
    """In float64 the tiled backward's gradients are the stock VAE's to rounding (1e-10 of each gradient's
    scale, floored at 1e-3 of the largest: a zero of exact arithmetic): the statistics of its GroupNorms
    are taken in the input's dtype, not float32."""
    vae = copy.deepcopy(VAE).double()
    z0 = _latents(1, 2, 5, 7)
    tv = tw.TiledVAE(vae, tile_size=3, progress=False)
    (ref, rg), (out, tg) = (_decode_grads(m, vae, z0, 2) for m in (vae, tv))
    assert out.dtype == torch.float64 and (out - ref).abs().max().item() <= 1e-12
    floor = 1e-3 * max(float(g.abs().max()) for g in rg if g is not None)
    for a, b in zip(tg, rg, strict=True):
        assert (a is None) == (b is None)
        assert b is None or float((a - b).abs().max()) <= 1e-10 * max(float(b.abs().max()), floor)


def test_the_plan_of_a_decode_backward_and_a_budgeted_one():
    """plan(backward=True) of a decode: its one causal step recomputed; within a memory budget the call
    picks a tile whose forward and backward peaks fit it, and its backward runs."""
    tv = tw.TiledVAE(VAE, tile_size=3, progress=False)
    p = tv.plan((1, 4, 3, 5, 7), backward=True)
    assert p.grid == (2, 3) and p.backward.steps == 1 and p.backward.peak > p.peak
    assert "1 causal steps recomputed" in str(p)
    budget = tw.TiledVAE(VAE, tile_size=8, memory_budget=p.backward.peak + (1 << 20), progress=False)
    bp = budget.plan((1, 4, 3, 5, 7), backward=True)
    assert bp.backward.peak <= p.backward.peak + (1 << 20)
    z = _latents(1, 3, 5, 7).requires_grad_()
    budget.decode(z, num_frames=3).sample.square().mean().backward()
    assert z.grad is not None and torch.isfinite(z.grad).all() and float(z.grad.abs().max()) > 0


def _pipeline():
    """A tiny StableVideoDiffusionPipeline: the SVD UNet of the denoiser tests (`tiny_denoisers.svd`), this
    VAE, a tiny CLIP vision encoder (32 px images, 8 px patches) and its feature extractor."""
    from diffusers import EulerDiscreteScheduler, StableVideoDiffusionPipeline
    from tiny_denoisers import UD
    from tiny_denoisers import svd as svd_unet
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModelWithProjection

    torch.manual_seed(0)
    encoder = CLIPVisionModelWithProjection(CLIPVisionConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=32,
        patch_size=8, projection_dim=UD)).eval()
    return StableVideoDiffusionPipeline(vae=VAE, image_encoder=encoder, unet=svd_unet()[0],
                                        scheduler=EulerDiscreteScheduler(),
                                        feature_extractor=CLIPImageProcessor())


def test_the_pipeline_with_the_tiled_vae_makes_the_stock_frames():
    pipe = _pipeline()
    image = torch.rand(1, 3, 32, 32, generator=torch.Generator().manual_seed(5))
    kw = dict(image=image, height=32, width=32, num_frames=5, num_inference_steps=2, decode_chunk_size=2,
              output_type="pt", motion_bucket_id=127, fps=6, noise_aug_strength=0.02)
    with torch.no_grad():
        ref = pipe(**kw, generator=torch.Generator().manual_seed(6)).frames
        pipe.vae = tw.TiledVAE(VAE, tile_size=6, progress=False)  # (16 x 16 latents: 3 x 3 tiles)
        out = pipe(**kw, generator=torch.Generator().manual_seed(6)).frames
        latents = torch.randn(1, 5, 4, 7, 11, generator=torch.Generator().manual_seed(4))
        chunks = pipe.decode_latents(latents, num_frames=5, decode_chunk_size=2)  # (calls of 2, 2, 1 frames)
        pipe.vae = VAE
        stock = pipe.decode_latents(latents, num_frames=5, decode_chunk_size=2)
    assert out.shape == ref.shape == (1, 5, 3, 32, 32)
    assert (out - ref).abs().max().item() <= TOL
    assert chunks.shape == stock.shape == (1, 3, 5, 14, 22)
    assert (chunks - stock).abs().max().item() <= TOL


def test_gradients_through_the_tiled_encode_equal_the_stock_vae():
    x = torch.randn(2, 3, 12, 16, generator=torch.Generator().manual_seed(7))
    w = VAE.encoder.conv_in.weight
    grads = []
    for encode in (VAE.encode, tw.TiledVAE(VAE, tile_size=4, progress=False).encode):
        xi = x.clone().requires_grad_()
        post = encode(xi).latent_dist
        (post.mean.square().sum() + post.logvar.sum()).backward()
        grads.append((xi.grad, w.grad.clone()))
        w.grad = None
        VAE.zero_grad(set_to_none=True)
    (gx, gw), (tx, tw_) = grads
    assert (tx - gx).abs().max().item() <= TOL * max(1.0, gx.abs().max().item())
    assert (tw_ - gw).abs().max().item() <= TOL * max(1.0, gw.abs().max().item())


def test_decode_to_streams_the_video_of_one_call(tmp_path):
    import numpy as np

    z = _latents(1, 3)
    tv = tw.TiledVAE(VAE, tile_size=4, progress=False)
    with torch.no_grad():
        ref = VAE.decode(z, num_frames=3).sample  # (3, 3, 14, 22): the frames of one call
    video = z.unflatten(0, (1, 3)).permute(0, 2, 1, 3, 4)  # (the (1, C, T, H, W) video decode_to takes)
    with tw.open_video_sink(tmp_path / "v.npy", 3, 14, 22, 3) as sink:
        tv.decode_to(video, sink)
    got = np.load(tmp_path / "v.npy").astype(int)
    want = np.stack([tw.sinks.to_hwc_uint(f) for f in ref]).astype(int)
    assert got.shape == (3, 14, 22, 3) and np.abs(got - want).max() <= 1  # (float noise can flip a rounding)
