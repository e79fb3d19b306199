"""An image VAE in a video's layout: Qwen-Image 2.1's AutoencoderKLQwenImage21 takes and returns
(B, C, 1, H, W), its convolutions 2-D ones on the one frame. Traced on a (B, C, H, W) example into 2-D
programs (`locality/trace/frames.py`), it decodes and encodes tiled exactly as the stock VAE (fp32, max
abs error <= 1e-4), with its call signature and return types, and as QwenImage21Pipeline calls it."""

from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from video_vae_support import qwen21  # noqa: E402

import tilewise as tw  # noqa: E402
from tilewise.locality.ops import OpKind  # noqa: E402

TOL = 1e-4
F = 4  # the tiny VAE's spatial factor


def _posterior_err(got, want) -> float:
    return float((got.latent_dist.parameters - want.latent_dist.parameters).abs().max())


def test_decode_and_encode_equal_the_stock_vae_with_its_return_types():
    vae = qwen21()
    tv = tw.TiledVAE(vae, tile_size=3, progress=False)
    g = torch.Generator().manual_seed(0)
    z = torch.randn(2, 4, 1, 5, 7, generator=g)  # (odd latent sides, a batch of two)
    x = torch.rand(2, 4, 1, 5 * F, 7 * F, generator=g) * 2 - 1
    with torch.no_grad():
        got, want = tv.decode(z), vae.decode(z)
        assert type(got) is type(want) and got.sample.shape == want.sample.shape == (2, 4, 1, 5 * F, 7 * F)
        assert (got.sample - want.sample).abs().max() <= TOL
        assert (tv.decode(z, return_dict=False)[0] - want.sample).abs().max() <= TOL
        enc, ref = tv.encode(x), vae.encode(x)
        assert type(enc) is type(ref) and enc.latent_dist.mean.shape == (2, 4, 1, 5, 7)
        assert _posterior_err(enc, ref) <= TOL
        assert (tv(x).sample - vae(x).sample).abs().max() <= TOL  # (forward: encode, decode the mode)
    assert tv.plan((2, 4, 1, 5, 7)).grid == (2, 3)
    assert tv.plan((2, 4, 1, 5 * F, 7 * F), kind="encode", tile_size=3).grid == (2, 3)


def test_its_frame_convolutions_are_convolutions_of_the_program_and_its_attention_the_one_sync():
    vae = qwen21()
    tv = tw.TiledVAE(vae, progress=False)
    ran = []  # the stock decode's 2-D convolutions outside the attention block (its AttentionCore's)
    hooks = [m.register_forward_hook(lambda *_: ran.append(1)) for n, m in vae.named_modules()
             if isinstance(m, torch.nn.Conv2d) and ".attentions." not in n]
    with torch.no_grad():
        vae.decode(torch.randn(1, 4, 1, 5, 7))
    for h in hooks:
        h.remove()
    program = tv.program("decode")
    assert sum(op.kind is OpKind.CONV for op in program.ops) == len(ran)
    for kind, scale in (("decode", 4.0), ("encode", 0.25)):
        r = tw.analyze(tv.program(kind))
        # (its attention as an AutoencoderKL's: keys and values of every token, queries tiled)
        assert [s.kind.value for s in r.segments] == ["local", "attention", "local"]
        assert [k for _, k in r.sync_ops] == [OpKind.ATTENTION] and r.scale == scale
        assert r.sync_ops[0][0].endswith("mid_block.attentions.0")


def test_other_layouts_and_frame_counts_are_refused_naming_the_shape():
    tv = tw.TiledVAE(qwen21(), progress=False)
    with pytest.raises(ValueError, match=r"has T=3 frames \(shape \(1, 4, 3, 5, 7\)\).*T must be 1"):
        tv.decode(torch.randn(1, 4, 3, 5, 7))
    with pytest.raises(ValueError, match=r"has T=2 frames .*T must be 1"):
        tv.encode(torch.randn(1, 4, 2, 20, 28))
    with pytest.raises(ValueError, match=r"must be a \(B, C, 1, H, W\) tensor .*got \(1, 4, 5, 7\)"):
        tv.decode(torch.randn(1, 4, 5, 7))
    with pytest.raises(ValueError, match=r"plans \(B, C, 1, H, W\) shapes .*got \(1, 4, 2, 5, 7\)"):
        tv.plan((1, 4, 2, 5, 7))


def test_the_vae_calls_of_qwenimage21pipeline_equal_the_stock_vae():
    # (the pipeline's text encoder and processor are Qwen3-VL's, not built small here: its VAE calls are
    # made as it makes them: `_encode_vae_image` itself on an RGBA condition image, its latents packed and
    # unpacked by its own methods (sides a multiple of 2 x the VAE's factor), then its decode step)
    from diffusers.image_processor import VaeImageProcessor
    from diffusers.pipelines.qwenimage21.pipeline_qwenimage21 import QwenImage21Pipeline
    from PIL import Image

    vae = qwen21()
    tv = tw.TiledVAE(vae, tile_size=3, progress=False)
    rgba = torch.rand(6 * F, 10 * F, 4, generator=torch.Generator().manual_seed(3))
    img = Image.fromarray((rgba.numpy() * 255).astype("uint8"), "RGBA")
    image = VaeImageProcessor(vae_scale_factor=F).preprocess(img, width=10 * F, height=6 * F).unsqueeze(2)

    def pipeline_calls(v):
        pipe = SimpleNamespace(vae=v, latent_channels=v.config.z_dim)
        latents = QwenImage21Pipeline._encode_vae_image(pipe, image, generator=None)
        packed = QwenImage21Pipeline._pack_latents(latents[:, :, 0], 1, 4, 6, 10)
        latents = QwenImage21Pipeline._unpack_latents(packed, 6 * F, 10 * F, F).to(v.dtype)
        mean = torch.tensor(v.config.latents_mean).view(1, v.config.z_dim, 1, 1, 1)
        std = torch.tensor(v.config.latents_std).view(1, v.config.z_dim, 1, 1, 1)
        return latents, v.decode(latents * std + mean, return_dict=False)[0][:, :, 0]

    with torch.no_grad():
        (lat, out), (lat_ref, ref) = pipeline_calls(tv), pipeline_calls(vae)
    assert out.shape == (1, 4, 6 * F, 10 * F)
    assert (lat - lat_ref).abs().max() <= TOL and (out - ref).abs().max() <= TOL


def test_a_decode_that_asks_for_gradients_gives_the_stock_gradients():
    vae = qwen21()
    tv = tw.TiledVAE(vae, tile_size=3, progress=False)
    z = torch.randn(1, 4, 1, 5, 7, generator=torch.Generator().manual_seed(4), requires_grad=True)
    grads = []
    for v in (tv, vae):
        y = v.decode(z).sample
        (y * torch.linspace(0, 1, y.numel()).view_as(y)).sum().backward()
        grads.append(z.grad)
        z.grad = None
    assert (grads[0] - grads[1]).abs().max() <= TOL


def test_decode_to_streams_its_one_frame_into_an_image_sink():
    vae = qwen21()
    tv = tw.TiledVAE(vae, tile_size=3, progress=False)
    z = torch.randn(1, 4, 1, 5, 7, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = vae.decode(z).sample[0, :, 0]
    with tw.TensorSink(None, 5 * F, 7 * F, channels=4) as sink:
        tv.decode_to(z, sink)
    assert (sink.result() - want).abs().max() <= TOL
