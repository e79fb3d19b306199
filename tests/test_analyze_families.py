"""`tw.analyze` of every VAE family TiledVAE tiles (`vae.families.FAMILIES`, refused ones aside), decode
and encode, on the tiny seeded configs of the families' own tests: the report is that of the program the
TiledVAE runs (its segments, halos, sync points), named for the class and the call, and its sync points
are the operators the family computes that read more than a tile (GroupNorm's statistics, attention over
all tokens, a module run whole); a family without them is exact_tileable with its halo. A family added to
the table without a case here fails `test_every_tiled_family_has_a_case`."""

import pytest

torch = pytest.importorskip("torch")

import video_vae_support as v  # noqa: E402
from vae_support import family_vae, kl_vae, tiny_vae  # noqa: E402

import tilewise as tw  # noqa: E402
from tilewise.locality.analysis import analyze_program  # noqa: E402
from tilewise.vae.families import FAMILIES  # noqa: E402


def _svd():
    """SVD's temporal decoder, two layers a block (its mid-block's attention runs between two resnets)."""
    import diffusers as d

    torch.manual_seed(0)
    return d.AutoencoderKLTemporalDecoder(block_out_channels=(32, 32), latent_channels=4, layers_per_block=2,
                                          down_block_types=("DownEncoderBlock2D",) * 2).eval()


A, G, W = "attention", "group_norm", "whole"
# class -> (its tiny builder, the kinds of its sync ops, decode and encode alike)
CASES = {
    "AutoencoderKL": (lambda: kl_vae("sd"), {A, G}), "AutoencoderTiny": (tiny_vae, set()),
    "VQModel": (lambda: family_vae("vq"), {A, G}),
    "AsymmetricAutoencoderKL": (lambda: family_vae("asym"), {A, G}),
    "AutoencoderDC": (lambda: family_vae("dc"), {W}),  # (its linear attention's sums over every position)
    "AutoencoderKLFlux2": (lambda: family_vae("flux2"), {A, G}),
    "AutoencoderKLKVAE": (lambda: family_vae("kvae"), {G}),
    "AutoencoderKLHunyuanImage": (lambda: family_vae("hunyuan"), {G, W}),
    "AutoencoderKLWan": (lambda: v.wan("2.1"), {A}), "AutoencoderKLQwenImage": (v.qwen, {A}),
    "AutoencoderKLQwenImage21": (v.qwen21, {A}), "AutoencoderKLHunyuanImageRefiner": (v.refiner, {W}),
    "AutoencoderKLLTXVideo": (v.ltx, set()), "AutoencoderKLLTX2Video": (v.ltx2, set()),
    "AutoencoderKLHunyuanVideo": (v.hunyuan, {A, G}), "AutoencoderKLHunyuanVideo15": (v.hunyuan15, {W}),
    "AutoencoderKLMochi": (v.mochi, {G}), "AutoencoderKLCosmos": (v.cosmos, {A, G}),
    "AutoencoderKLCogVideoX": (v.cogvideox_vae, {G}), "AutoencoderKLMagvit": (v.magvit, {G}),
    "AutoencoderKLKVAEVideo": (v.kvae_video, {G}), "Kandinsky6SRVAE": (v.kandinsky6_sr, set()),
    "AutoencoderVidTok": (v.vidtok, {A}), "AutoencoderKLAllegro": (v.allegro, {A, G}),
    "AutoencoderKLTemporalDecoder": (_svd, {A, G}),
}
SLOW = {"AutoencoderKLCosmos", "Kandinsky6SRVAE", "AutoencoderKLHunyuanVideo15", "AutoencoderKLLTX2Video",
        "AutoencoderKLHunyuanImageRefiner"}  # (each lowers in ~10 s on 2 shared cores)


def test_every_tiled_family_has_a_case():
    assert set(CASES) == {name for name, family in FAMILIES.items() if not family.refused}


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in CASES])
def test_a_family_is_analysed_as_its_tiled_program(name):
    build, kinds = CASES[name]
    vae = build()
    tv = tw.TiledVAE(vae, progress=False)
    for kind in ("decode", "encode"):
        report = tw.analyze(vae, kind=kind)
        want = analyze_program(tv.program(kind), (64 * report.align,) * 2)
        assert report.name == want.name == f"{name}.{kind}"
        assert report.segments == want.segments and report.sync_ops == want.sync_ops and report.segments
        assert (report.local_halo, report.align, report.scale) == (want.local_halo, want.align, want.scale)
        assert {k.value for _, k in report.sync_ops} == kinds
        assert report.exact_tileable == (not kinds) and report.verdict() in str(report)
        if not kinds:
            assert report.verdict().startswith(f"exact_tileable: yes, halo {report.local_halo} input px")


def test_the_cli_analyses_a_vae_folder_as_its_tiled_programs(tmp_path):
    """`tilewise analyze --model FOLDER` of a VAE folder (a video family here): each call's report, as
    tw.analyze gives it."""
    from typer.testing import CliRunner

    from tilewise.cli import app

    vae = v.mochi()
    vae.save_pretrained(tmp_path / "mochi")
    result = CliRunner().invoke(app, ["analyze", "--model", str(tmp_path / "mochi")], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    for kind in ("decode", "encode"):
        assert f"== AutoencoderKLMochi {kind} ==\n{tw.analyze(vae, kind=kind)}\n" in result.output
