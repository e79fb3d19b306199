"""LTX-Video 0.9.5+ and LTX-2 decoders conditioned on the decode timestep (`timestep_conditioning`,
decode(z, temb)): the timestep's embedding (per-channel scales and shifts of the norms, pointwise in
space) is computed once per call from temb (`locality/trace/percall.py`), never baked into the program,
so the tiled decode equals the stock one (fp32, max abs error <= 1e-4) for any timestep, per sample, and
as LTXPipeline calls it (its gradients: tests/test_vae_gradients_video.py). Noise injection (LTX-Video
0.9.1's) stays refused at construction, by reason."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from video_vae_support import ltx, video_vae  # noqa: E402

import tilewise as tw  # noqa: E402
from tilewise.locality import LoweringError  # noqa: E402

TOL = 1e-4


def _z(b=2, frames=2, h=5, w=7, seed=0):
    return torch.randn(b, 4, frames, h, w, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", ["ltx0.9.5-t", "ltx2-t"])
def test_a_timestep_conditioned_decode_equals_the_stock_one_per_sample_and_for_any_timestep(name):
    vae = video_vae(name)
    tv = tw.TiledVAE(vae, tile_size=3, progress=False)
    z = _z(h=4, w=5)
    assert tv.plan(tuple(z.shape)).grid == (2, 2)
    program = tv.program("decode")
    with torch.no_grad():
        outs = []
        for temb in (torch.tensor([0.05, 0.6]), torch.tensor([0.3, 0.3])):  # (a (B,) timestep per sample)
            got, want = tv.decode(z, temb), vae.decode(z, temb)
            assert type(got) is type(want) and got.sample.shape == want.sample.shape
            assert (got.sample - want.sample).abs().max() <= TOL
            outs.append(got.sample)
        assert (tv.decode(z, temb=temb, return_dict=False)[0] - want.sample).abs().max() <= TOL
    assert (outs[0] - outs[1]).abs().max() > 0.01  # (the timestep conditions the decode)
    assert tv.program("decode") is program  # (one program, whatever the timestep: lowered once)
    with pytest.raises(RuntimeError, match=r"run it under program\.call\.bound\(temb\)"):
        program.run_steps(z)  # (outside a call its per-call values are not there)


def test_decode_to_a_sink_and_forward_take_the_timestep_as_decode_does(tmp_path):
    vae = video_vae("ltx0.9.5-t")
    tv = tw.TiledVAE(vae, tile_size=3, progress=False)
    z, temb = _z(b=1), torch.tensor([0.25])
    with torch.no_grad():
        want = vae.decode(z, temb).sample
    _, c, t, h, w = want.shape
    with tw.open_video_sink(tmp_path / "v.npy", t, h, w) as sink:
        tv.decode_to(z, sink, temb=temb)
    got = np.load(tmp_path / "v.npy")  # (8-bit frames of [-1, 1]: within one level of the stock decode)
    ref = ((want[0].permute(1, 2, 3, 0).clamp(-1, 1) + 1) * 127.5).numpy()
    assert got.shape == ref.shape and np.abs(got.astype(np.float64) - ref).max() <= 1.0
    x = torch.rand(1, 3, 9, 48, 64, generator=torch.Generator().manual_seed(2)) * 2 - 1
    with torch.no_grad():
        assert (tv(x, temb).sample - vae(x, temb).sample).abs().max() <= TOL


def test_the_decode_ltxpipeline_makes_with_per_sample_decode_timesteps_equals_the_stock_vae():
    from diffusers import FlowMatchEulerDiscreteScheduler, LTXPipeline, LTXVideoTransformer3DModel

    torch.manual_seed(0)
    tr = LTXVideoTransformer3DModel(in_channels=4, out_channels=4, num_attention_heads=2,
                                    attention_head_dim=8, cross_attention_dim=16, num_layers=1,
                                    caption_channels=16).eval()
    vae = video_vae("ltx0.9.5-t")
    pipe = LTXPipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=None,
                       tokenizer=None, transformer=tr)
    embeds = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(1))
    kw = dict(prompt_embeds=embeds, prompt_attention_mask=torch.ones(2, 5, dtype=torch.long),
              guidance_scale=1.0, height=64, width=96, num_frames=9, num_inference_steps=1, output_type="pt",
              decode_timestep=[0.05, 0.5], decode_noise_scale=[0.02, 0.1])

    def frames(v):
        pipe.vae = v
        with torch.no_grad():
            return pipe(**kw, generator=torch.Generator().manual_seed(3)).frames

    want = frames(vae)
    got = frames(tw.TiledVAE(vae, tile_size=3, progress=False))  # (latents of 4 x 6: a 2 x 2 grid)
    assert got.shape == want.shape and (got - want).abs().max() <= TOL


def test_a_decoder_not_conditioned_ignores_the_timestep_as_the_stock_one_does():
    vae = video_vae("ltx0.9.0")
    tv = tw.TiledVAE(vae, tile_size=3, progress=False)
    z = _z(b=1)
    assert tv.program("decode").call is None
    temb = torch.tensor([0.7])
    with torch.no_grad():
        assert (tv.decode(z, temb).sample - vae.decode(z, temb).sample).abs().max() <= TOL


def test_a_conditioned_decode_without_a_timestep_per_sample_is_refused():
    vae = video_vae("ltx0.9.5-t")
    tv = tw.TiledVAE(vae, tile_size=3, progress=False)
    z = _z()
    with pytest.raises(ValueError, match="decode\\(z, temb\\) needs temb, a \\(B,\\) tensor .*got NoneType"):
        tv.decode(z)
    with pytest.raises(ValueError, match=r"one timestep per sample: 2 for z of shape \(2, 4, 2, 5, 7\), got "
                                         r"shape \(3,\)"):
        tv.decode(z, torch.tensor([0.1, 0.2, 0.3]))


def test_noise_injection_is_refused_at_construction_with_the_reason():
    from diffusers import AutoencoderKLLTXVideo

    vae = AutoencoderKLLTXVideo(**{**ltx("0.9.5", timestep=True).config,
                                   "decoder_inject_noise": (True, False, False, False)})
    match = (r"cannot tile AutoencoderKLLTXVideo: its decoder injects noise \(decoder_inject_noise=\(True, "
             r"False, False, False\): torch\.randn")
    with pytest.raises(LoweringError, match=match):
        tw.TiledVAE(vae)
