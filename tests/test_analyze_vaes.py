"""`tw.analyze` of a whole VAE: its decode / encode program as the TiledVAE runs it (a diffusers VAE's forward
returns a DecoderOutput, and Mochi's and CogVideoX's decoders return their caches beside their frames, so
neither lowers as a module); a refused family raises its reason by name."""

import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from vae_support import kl_vae  # noqa: E402
from video_vae_support import allegro, cogvideox_vae, latent, mochi, refused_family, vidtok  # noqa: E402

import tilewise as tw  # noqa: E402
from tilewise.locality import LoweringError  # noqa: E402
from tilewise.locality.analysis import analyze_program  # noqa: E402


def _same(a, b) -> None:
    assert a.name == b.name and a.segments == b.segments and a.sync_ops == b.sync_ops
    assert (a.local_halo, a.align, a.scale, a.verdict()) == (b.local_halo, b.align, b.scale, b.verdict())


@pytest.mark.parametrize("kind", ["decode", "encode"])
def test_a_whole_image_vae_is_analysed_as_its_tiled_program(kind):
    vae = kl_vae("sd")
    report = tw.analyze(vae, kind=kind)
    _same(report, analyze_program(tw.TiledVAE(vae, progress=False).program(kind), (64 * report.align,) * 2))
    assert report.name == f"AutoencoderKL.{kind}" and report.sync_ops and not report.exact_tileable
    assert ("exact_tileable: no, global ops: GroupNorm" in str(report)) and report.segments[0].halo > 0
    _same(tw.analyze(tw.TiledVAE(vae, progress=False), kind=kind), report)  # (a TiledVAE: its VAE's)
    assert tw.analyze(vae.decoder).name == "Decoder"  # (a part of it: lowered from its forward, as before)
    with pytest.raises(ValueError, match="kind must be 'decode' or 'encode', got 'decoder'"):
        tw.analyze(vae, kind="decoder")


def test_a_video_vae_whose_decoder_returns_its_caches_is_analysed_whole():
    vae = mochi()
    with pytest.raises(LoweringError, match=r"returned tuple.*tw\.analyze\(vae\)"):
        tw.analyze(vae.decoder)  # (the decoder alone: its frames and its caches)
    report = tw.analyze(vae)
    assert report.name == "AutoencoderKLMochi.decode" and report.sync_ops and report.segments
    assert all(kind == "group_norm" for _, kind in report.sync_ops)


def test_a_chunked_video_vae_is_analysed_for_the_frames_of_its_example():
    vae = cogvideox_vae()
    tv = tw.TiledVAE(vae, progress=False)
    z = latent(5, 12, 10, channels=vae.config.latent_channels)
    report = tw.analyze(vae, z)
    _same(report, analyze_program(tv.program("decode", 5), (64 * report.align,) * 2))
    assert len(report.segments) == len(tw.analyze(tv.program("decode", 5)).segments)


def test_vidtok_is_analysed_as_its_tiled_program():
    """VidTok's decode (its 1-D resnet halves on each position's frames one op each): its one sync op the
    mid-block's attention over each frame's tokens."""
    vae = vidtok()
    report = tw.analyze(vae)
    program = tw.TiledVAE(vae, progress=False).program("decode")
    _same(report, analyze_program(program, (64 * report.align,) * 2))
    assert report.name == "AutoencoderVidTok.decode" and len(report.sync_ops) == 1
    assert tw.analyze(vae, kind="encode").name == "AutoencoderVidTok.encode"


# Allegro's (blocks=4 builder): segments, sync ops, halo (sync ops made local), align, scale, first block
ALLEGRO = {"decode": (72, 71, 17, 1, 8, "mid_block"), "encode": (48, 47, 90, 8, 1 / 8, "down_blocks.0")}


@pytest.mark.parametrize("kind", ["decode", "encode"])
def test_allegro_is_analysed_as_its_tiled_program(kind):
    """Allegro's decode / encode as the TiledVAE runs it (the one pass its own cubes approximate): a sync
    op at every GroupNorm (its resnets', its temporal convolutions', the last) and one at the mid-block's
    attention over each frame's tokens, local segments of halo <= 2 between them."""
    vae = allegro(blocks=4)
    report = tw.analyze(vae, kind=kind)
    _same(report, analyze_program(tw.TiledVAE(vae, progress=False).program(kind), (64 * report.align,) * 2))
    segments, syncs, halo, align, scale, first = ALLEGRO[kind]
    part = "decoder" if kind == "decode" else "encoder"
    assert report.name == f"AutoencoderKLAllegro.{kind}" and not report.exact_tileable
    assert (len(report.segments), len(report.sync_ops)) == (segments, syncs)
    assert (report.local_halo, report.align, report.scale) == (halo, align, scale)
    assert [s.kind for s in report.segments].count("attention") == 1
    assert all(s.halo <= 2 for s in report.segments if s.kind == "local")
    assert [op for op, k in report.sync_ops if k == "attention"] == [f"{part}.mid_block.attentions.0"]
    assert report.sync_ops[-1] == (f"{part}.conv_norm_out", "group_norm")
    assert report.verdict() == (
        "exact_tileable: no, global ops: GroupNorm (needs global statistics): "
        f"{part}.{first}.resnets.0.norm1, {part}.{first}.resnets.0.norm2, "
        f"{part}.{first}.temp_convs.0.conv1.0, {part}.{first}.temp_convs.0.conv2.0, "
        f"... ({syncs - 1} in all); attention (needs all tokens): {part}.mid_block.attentions.0")


def test_a_refused_family_is_refused_by_name_with_its_reason():
    with pytest.raises(LoweringError, match="TiledVAE cannot tile AutoencoderKLCogVideoX.*odd call"):
        tw.analyze(refused_family("cogvideox-odd-calls"))
