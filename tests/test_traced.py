"""The traced lowering (`tilewise.locality.trace`): a VAE's programs come from what its decode and encode
compute. For AutoencoderKL and AutoencoderTiny it gives the hand lowering's programs op for op; the other
2-D families run tiled exactly as their stock modules do (fp32, max abs error <= 1e-4) and return what
they return; what no tile program reproduces is refused when the TiledVAE is built, by name."""

from __future__ import annotations

import pytest
import torch
from hand_lowering import hand_lower
from vae_support import family_vae, kl_vae, tiny_vae

import tilewise as tw
from tilewise.locality import LoweringError, lower
from tilewise.locality.analysis import analyze_program
from tilewise.locality.ops import OpKind
from tilewise.locality.trace import lower_traced

TOL = 1e-4


def _signature(program):
    return [(op.kind, tuple(getattr(op, "padding", ())), getattr(op, "groups", None),
             getattr(op, "scale", None), getattr(op, "kernels", None)) for op in program.ops]


def _analysis(program):
    """What the planner reads of a program: its segments' kinds, lengths, halos and scales, its sync ops'
    kinds, its halo and alignment (op names apart)."""
    r = analyze_program(program, (13, 11))
    segments = [(s.kind, s.n_ops, s.halo, s.scale) for s in r.segments]
    return segments, [k for _, k in r.sync_ops], r.local_halo, r.align, r.scale


@pytest.mark.parametrize("kind", ["sd", "sdxl", "sd3", "tiny"])
def test_traced_programs_are_the_hand_lowerings_op_for_op(kind):
    vae = tiny_vae() if kind == "tiny" else kl_vae(kind)
    c = vae.config.latent_channels
    for module, x in ((vae.decoder, torch.randn(1, c, 13, 11)), (vae.encoder, torch.randn(1, 3, 104, 88))):
        hand, traced = hand_lower(module), lower_traced(module, module, x)
        assert _signature(traced) == _signature(hand)
        # the same halos, sync points and segments: the planner sees the same program
        assert _analysis(traced) == _analysis(hand)
        with torch.no_grad():
            assert torch.equal(traced.run(x), module(x))


def _close(got, want) -> float:
    """Max abs error over an output's fields (a posterior by its moments); raises on a field mismatch."""
    assert type(got) is type(want)
    assert list(got.keys()) == list(want.keys())
    err = 0.0
    for k in want.keys():
        a, b = got[k], want[k]
        a, b = getattr(a, "parameters", a), getattr(b, "parameters", b)
        if b is None:
            assert a is None, k
            continue
        assert a.shape == b.shape, k
        err = max(err, float((a - b).abs().max()))
    return err


FAMILIES = ["vq", "movq", "asym", "flux2", "kvae", "hunyuan", "dc"]


@pytest.mark.parametrize("name", FAMILIES)
def test_every_traced_family_tiles_exactly_and_returns_what_the_stock_vae_returns(name):
    vae = family_vae(name)
    tv = tw.TiledVAE(vae, tile_size=4, progress=False)
    z = torch.randn(1, tv.program("decode").in_channels, 12, 10)
    f = tv.factor("encode")
    x = torch.randn(1, 3, 12 * f, 10 * f)
    with torch.no_grad():
        assert _close(tv.decode(z), vae.decode(z)) <= TOL
        assert _close(tv.encode(x), vae.encode(x)) <= TOL
        assert _close(tv(x), vae(x)) <= TOL  # (forward: encode, then decode the posterior's mode)
    plan = tv.plan(tuple(z.shape), kind="decode", tile_size=4)
    assert plan.grid[0] * plan.grid[1] > 1  # (tiled, not one tile)


def test_vq_decode_quantizes_unless_told_not_to_as_the_stock_decode_does():
    vae = family_vae("vq")
    tv = tw.TiledVAE(vae, tile_size=4, progress=False)
    z = torch.randn(1, 4, 12, 10)
    with torch.no_grad():
        for kw in ({}, {"force_not_quantize": True}, {"force_not_quantize": False}):
            got, want = tv.decode(z, **kw), vae.decode(z, **kw)
            assert _close(got, want) <= TOL, kw
        assert float(tv.decode(z).commit_loss) == pytest.approx(float(vae.decode(z).commit_loss))
        assert not torch.equal(tv.decode(z).sample, tv.decode(z, force_not_quantize=True).sample)


def test_modules_no_rule_places_are_measured_and_global_ones_run_whole_only_at_the_latent():
    # HunyuanImage's attention block and DC-AE's linear attention read every position: one op run whole,
    # at the latent's resolution; the other blocks of these families are placed by the rules
    for name, label in (("hunyuan", "HunyuanImageAttentionBlock"), ("dc", "SanaMultiscaleLinearAttention")):
        tv = tw.TiledVAE(family_vae(name), progress=False)
        for kind in ("decode", "encode"):
            program = tv.program(kind)
            whole = [op for op in program.ops if op.kind is OpKind.WHOLE]
            assert [op.label for op in whole] == [label], (name, kind)
            latent = program.shapes((12, 10))[program.input if kind == "decode" else program.output]
            assert program.shapes((12, 10))[whole[0].dst] == latent


def test_a_global_module_above_the_latent_is_refused_at_construction_by_call_and_path():
    import diffusers as d

    torch.manual_seed(0)
    blocks = ("ResBlock", "ResBlock", "EfficientViTBlock", "EfficientViTBlock")
    vae = d.AutoencoderDC(latent_channels=8, attention_head_dim=8, encoder_block_types=blocks,
                          decoder_block_types=blocks, encoder_block_out_channels=(8, 16, 16, 32),
                          decoder_block_out_channels=(8, 16, 16, 32), encoder_layers_per_block=(1,) * 4,
                          decoder_layers_per_block=(1,) * 4, encoder_qkv_multiscales=((), (), (5,), (5,)),
                          decoder_qkv_multiscales=((), (), (5,), (5,)))
    with pytest.raises(LoweringError, match=r"AutoencoderDC \(decode\).*SanaMultiscaleLinearAttention at "
                       r"'decoder\.up_blocks\.2\.\d\.attn'.*above the latent's resolution"):
        tw.TiledVAE(vae, progress=False)


def test_families_no_tile_program_reproduces_are_refused_by_name_with_the_reason():
    import diffusers as d

    consistency = d.ConsistencyDecoderVAE(
        encoder_block_out_channels=(16, 32), encoder_down_block_types=("DownEncoderBlock2D",) * 2,
        encoder_layers_per_block=1, latent_channels=4, encoder_norm_num_groups=8,
        decoder_block_out_channels=(16, 32), decoder_down_block_types=("ResnetDownsampleBlock2D",) * 2,
        decoder_up_block_types=("ResnetUpsampleBlock2D",) * 2, decoder_layers_per_block=1,
        decoder_norm_num_groups=8, decoder_num_train_timesteps=10)
    with pytest.raises(LoweringError, match="ConsistencyDecoderVAE: its decoder is a diffusion model"):
        tw.TiledVAE(consistency)


def test_dropout_in_training_mode_is_refused_and_the_programs_follow_mode_and_layer_changes():
    x = torch.randn(1, 3, 9, 7)
    m = torch.nn.Sequential(torch.nn.Conv2d(3, 3, 3, padding=1), torch.nn.Dropout(0.1)).train()
    with pytest.raises(LoweringError, match=r"'dropout' at '1'.*training mode draws random masks"):
        lower(m, x)
    m[1].p = 0.0  # (no draw: an alias, in training mode too)
    with torch.no_grad():
        assert torch.equal(lower(m, x).run(x), m(x))
    # a TiledVAE lowers again when its VAE's modes or layers change (its dropouts are p=0: it runs)
    vae = kl_vae("sd3")
    tv = tw.TiledVAE(vae, tile_size=4, progress=False)
    z = torch.randn(1, 16, 12, 10)
    first = tv.program("decode")
    vae.train()
    assert tv.program("decode") is not first
    torch.manual_seed(3)
    vae.decoder.conv_out = torch.nn.Conv2d(16, 3, 3, padding=1)
    with torch.no_grad():
        assert float((tv.decode(z).sample - vae.decode(z).sample).abs().max()) <= TOL


def test_decode_arguments_the_tiled_path_does_not_follow_are_refused_by_name():
    vae = family_vae("asym")
    tv = tw.TiledVAE(vae, tile_size=4, progress=False)
    z, image = torch.randn(1, 4, 12, 10), torch.randn(1, 3, 24, 20)
    with pytest.raises(ValueError, match=r"AsymmetricAutoencoderKL: image=<tensor \(1, 3, 24, 20\)> is not "
                       r"followed by the tiled path"):
        tv.decode(z, image=image)
    with pytest.raises(TypeError, match="AsymmetricAutoencoderKL.*unexpected keyword argument 'imag'"):
        tv.decode(z, imag=image)
