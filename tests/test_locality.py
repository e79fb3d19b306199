"""Lowering reproduces the module's forward; static analysis agrees with the empirical probe."""

import pytest

torch = pytest.importorskip("torch")

from test_vae_support import kl_vae, structured_latent, tiny_vae  # noqa: E402

from tilewise.locality import LoweringError, analyze, lower, probe_receptive_field  # noqa: E402
from tilewise.locality.program import split_segments  # noqa: E402


@pytest.mark.parametrize("kind", ["sd", "sdxl", "sd3", "flux"])
def test_lowered_kl_decoder_and_encoder_equal_forward(kind):
    vae = kl_vae(kind)
    c = vae.config.latent_channels
    with torch.no_grad():
        z = structured_latent(2, c, 7, 11)
        assert (lower(vae.decoder).run(z) - vae.decoder(z)).abs().max() <= 1e-6
        x = torch.randn(1, 3, 8 * 3, 8 * 5, generator=torch.Generator().manual_seed(3))
        assert (lower(vae.encoder).run(x) - vae.encoder(x)).abs().max() <= 1e-6


def test_lowered_tiny_equals_forward():
    vae = tiny_vae()
    with torch.no_grad():
        z = torch.randn(1, 4, 9, 13)
        assert (lower(vae.decoder).run(z) - vae.decoder(z)).abs().max() <= 1e-6
        x = torch.rand(1, 3, 40, 24) * 2 - 1
        assert (lower(vae.encoder).run(x) - vae.encoder(x)).abs().max() <= 1e-6


def test_unknown_module_names_type_and_points_to_probe():
    m = torch.nn.Sequential(torch.nn.Conv2d(3, 3, 3, padding=1))
    with pytest.raises(LoweringError, match="Sequential.*probe_receptive_field"):
        lower(m)


def test_tiny_decoder_static_halo_equals_probe():
    vae = tiny_vae()
    report = analyze(vae.decoder, torch.zeros(1, 4, 48, 48))
    assert report.exact_tileable and not report.sync_ops
    z = torch.randn(1, 4, 48, 48, generator=torch.Generator().manual_seed(0))
    probe = probe_receptive_field(vae.decoder, z)
    assert not probe.whole_output
    assert report.halo == probe.radius
    assert "exact_tileable: yes" in str(report)


def test_tiny_encoder_probe_within_static_halo():
    vae = tiny_vae()
    report = analyze(vae.encoder)
    probe = probe_receptive_field(vae.encoder, torch.rand(1, 3, 320, 320))
    assert report.align == 8 and 0 < probe.radius <= report.halo


def test_kl_report_names_groupnorm_and_attention_and_probe_sees_global():
    vae = kl_vae("sd")
    report = analyze(vae.decoder, torch.zeros(1, 4, 16, 16))
    assert not report.exact_tileable and report.halo is None
    kinds = {k for _, k in report.sync_ops}
    assert kinds == {"group_norm", "attention"}
    text = str(report)
    assert "GroupNorm" in text and "mid_block.attentions.0" in text
    assert report.local_halo > 8
    probe = probe_receptive_field(vae.decoder, torch.randn(1, 4, 16, 16))
    assert probe.whole_output and probe.radius is None


def test_segments_cut_before_groupnorm_of_fresh_values():
    program = lower(kl_vae("sd3").decoder)
    segs = split_segments(program)
    for seg in segs:
        made = set()
        for op in seg.ops:
            if op.kind == "group_norm":
                assert op.src[0] not in made
            made.add(op.dst)
    assert [s.kind for s in segs].count("attention") == 1
    assert program.output in segs[-1].outputs


def test_probe_rejects_bad_position():
    with pytest.raises(ValueError, match="outside"):
        probe_receptive_field(torch.nn.Identity(), torch.zeros(1, 1, 4, 4), position=(9, 0))
