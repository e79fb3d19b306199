"""TiledVAE in half precision: exact within the dtype's own error, statistics wide, overflow upcast."""

import logging

import pytest

torch = pytest.importorskip("torch")

from vae_support import kl_vae, structured_latent  # noqa: E402

import tilewise as tw  # noqa: E402
from tilewise.vae.run.finite import NonFiniteError  # noqa: E402
from tilewise.vae.run.stats import GroupStats  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("device_kind", ["cpu", "cuda"])
@pytest.mark.parametrize("kind", ["decode", "encode"])
def test_exact_mode_in_half_precision_is_within_the_dtypes_own_untiled_error(dtype, device_kind, kind):
    vae32 = kl_vae("sd")
    vae = kl_vae("sd").to(dtype)
    if kind == "decode":
        t = structured_latent(1, 4, 13, 11)
    else:
        t = torch.rand(1, 3, 88, 72, generator=torch.Generator().manual_seed(3)) * 2 - 1

    def run(v, x):
        return v.decode(x).sample if kind == "decode" else v.encode(x).latent_dist.mean

    with torch.no_grad():
        ref32, ref = run(vae32, t), run(vae, t.to(dtype))
    tv = tw.TiledVAE(vae, tile_size=4, progress=False, device_kind=device_kind)
    out = run(tv, t.to(dtype))
    assert out.dtype == dtype
    own = (ref.float() - ref32).abs().max()
    assert 0 < own < 0.5 and (out.float() - ref.float()).abs().max() <= own


@pytest.mark.parametrize("chunk", [0, 1 << 20])
def test_statistics_of_half_precision_tiles_are_float64_and_accurate(chunk):
    x = (torch.randn(1, 32, 24, 20, generator=torch.Generator().manual_seed(4)) * 4 + 50).half()
    acc = GroupStats(8, chunk)
    for y0, y1 in ((0, 9), (9, 24)):
        acc.add(x[..., y0:y1, :])
    mean, var = acc.result()
    var64, mean64 = torch.var_mean(x.double().view(1, 8, -1), dim=-1, correction=0)
    assert mean.dtype == var.dtype == torch.float64
    assert (mean - mean64).abs().max() <= 1e-5 and ((var - var64) / var64).abs().max() <= 1e-5


def _overflowing(dtype):
    """The SD-shaped test VAE with a convolution scaled so its float16 activations overflow (as the SDXL
    VAE's do); float32 normalises it away at the next GroupNorm."""
    vae = kl_vae("sd")
    with torch.no_grad():
        vae.decoder.up_blocks[0].resnets[0].conv2.weight.mul_(1e6)
    return vae.to(dtype)


@pytest.mark.parametrize("tile", [4, 64])  # tiled, and one tile: the untiled path
def test_float16_overflow_runs_again_in_float32_and_says_so(tile, caplog):
    z = structured_latent(1, 4, 13, 11)
    vae = _overflowing(torch.float16)
    with torch.no_grad():
        ref32 = _overflowing(torch.float32).decode(z).sample
        assert not vae.decode(z.half()).sample.isfinite().all()  # the untiled float16 decode: NaN
    tv = tw.TiledVAE(vae, tile_size=tile, progress=False)
    with caplog.at_level(logging.WARNING, logger="tilewise"):
        out = tv.decode(z.half()).sample
    assert "force_upcast" in caplog.text and "float16 overflow" in caplog.text
    assert out.dtype == torch.float16 and vae.dtype == torch.float16  # (the VAE is cast back)
    assert out.isfinite().all() and (out.float() - ref32).abs().max() <= 1e-2


def test_float16_overflow_after_rows_reached_a_sink_is_raised(tmp_path):
    vae = kl_vae("sd").half()
    sink = tw.open_sink(tmp_path / "out.npy", 104, 88, 3, 16)
    write = sink.write

    def overflow_after_the_first_rows(*args):  # later tiles' conv_out overflows float16 (not float32)
        write(*args)
        with torch.no_grad():
            vae.decoder.conv_out.weight.fill_(1000)

    sink.write = overflow_after_the_first_rows
    tv = tw.TiledVAE(vae, tile_size=4, progress=False)
    with pytest.raises(NonFiniteError, match="conv_out.*float16"):
        tv.decode_to(structured_latent(1, 4, 13, 11).half(), sink)
