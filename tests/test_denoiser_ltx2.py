"""TiledDenoiser over LTX-2 (`LTX2VideoTransformer3DModel`), called with exactly LTX2Pipeline's inputs.

The stock pipeline needs its Gemma text encoder and connectors, which have no tiny form here; the
transformer is called as LTX2Pipeline calls it (packed video tokens, the audio latent, prompts, grid sizes,
video and audio coords from the model's own ropes). Oracles: one tile equals the untiled call (fp32 <= 1e-5,
video and audio); several tiles at odd sizes and frame counts give the stock shapes; the video_coords each
tile call receives equal the untiled call's at the tile's tokens; isolate_modalities=True gives the exact
audio; the audio of several tiles (audio="mean", an approximation) has its error against the untiled call
recorded (printed, `-s`), not bounded.
"""

from __future__ import annotations

import pytest
import torch

diffusers = pytest.importorskip("diffusers")

from tiny_denoisers import D, rand, seeded  # noqa: E402

from tilewise.diffusion import TiledDenoiser  # noqa: E402

torch.set_num_threads(1)


def ltx2():
    from diffusers import LTX2VideoTransformer3DModel

    return seeded(LTX2VideoTransformer3DModel, in_channels=4, out_channels=4, num_attention_heads=2,
                  attention_head_dim=8, cross_attention_dim=16, audio_in_channels=4, audio_out_channels=4,
                  audio_num_attention_heads=2, audio_attention_head_dim=8, audio_cross_attention_dim=16,
                  num_layers=1, caption_channels=D)


def inputs(tr, frames=3, h=5, w=7, batch=2, coords=True, **extra):
    """LTX2Pipeline's transformer call (pipeline_ltx2.py): CFG batch, latent grid sizes, coords by rope."""
    n, na = frames * h * w, 6
    kw = dict(hidden_states=rand(batch, n, 4, seed=1), audio_hidden_states=rand(batch, na, 4, seed=2),
              encoder_hidden_states=rand(batch, 5, D, seed=3),
              audio_encoder_hidden_states=rand(batch, 5, D, seed=4),
              timestep=torch.full((batch,), 700.0), sigma=torch.full((batch,), 700.0),
              encoder_attention_mask=torch.ones(batch, 5), audio_encoder_attention_mask=torch.ones(batch, 5),
              num_frames=frames, height=h, width=w, fps=24.0, audio_num_frames=na, isolate_modalities=False,
              use_cross_timestep=False, return_dict=False, **extra)
    if coords:
        kw["video_coords"] = tr.rope.prepare_video_coords(batch, frames, h, w, torch.device("cpu"), fps=24.0)
        kw["audio_coords"] = tr.audio_rope.prepare_audio_coords(batch, na, torch.device("cpu"))
    return kw


def call(model, kw):
    with torch.no_grad():
        return model(**kw)


@pytest.mark.parametrize("coords", [True, False])
def test_one_tile_equals_stock(coords):
    tr = ltx2()
    kw = inputs(tr, coords=coords)
    want = call(tr, kw)
    got = call(TiledDenoiser(tr, tile_size=(5, 7), overlap=0), kw)
    for a, b in zip(got, want, strict=True):
        assert a.shape == b.shape
        assert (a - b).abs().max() <= 1e-5


def rel(a, b):
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("frames,h,w", [(3, 5, 7), (2, 7, 9)])
def test_tiles_shapes_and_audio_error(frames, h, w, capsys):
    tr = ltx2()
    kw = inputs(tr, frames, h, w)
    want = call(tr, kw)
    got = call(TiledDenoiser(tr, tile_size=4, overlap=2, method="mixture"), kw)
    assert [t.shape for t in got] == [t.shape for t in want]
    assert all(torch.isfinite(t).all() for t in got)
    err_v, err_a = rel(got[0], want[0]), rel(got[1], want[1])
    with capsys.disabled():
        print(f"\nLTX-2 {frames}x{h}x{w}, 4x4 tiles overlap 2: relative error video {err_v:.3g}, "
              f"audio (mean of tiles) {err_a:.3g}")
    assert err_a > 0  # the audio is an approximation: recorded, not bounded
    batched = call(TiledDenoiser(tr, tile_size=4, overlap=2, method="mixture", batch_size=3), kw)
    assert all((a - b).abs().max() <= 1e-5 for a, b in zip(batched, got, strict=True))  # tiles per call


def test_isolated_audio_is_exact():
    tr = ltx2()
    kw = inputs(tr) | {"isolate_modalities": True}
    want = call(tr, kw)
    got = call(TiledDenoiser(tr, tile_size=4, overlap=2), kw)
    assert (got[1] - want[1]).abs().max() <= 1e-5


def test_exact_audio_refuses_several_tiles():
    tr = ltx2()
    kw = inputs(tr)
    with pytest.raises(NotImplementedError, match="audio='exact'"):
        call(TiledDenoiser(tr, tile_size=4, overlap=2, audio="exact"), kw)
    out = call(TiledDenoiser(tr, tile_size=(5, 7), overlap=0, audio="exact"), kw)
    assert (out[1] - call(tr, kw)[1]).abs().max() <= 1e-5
    with pytest.raises(ValueError, match="expected one of"):
        TiledDenoiser(tr, audio="median")


@pytest.mark.parametrize("coords", [True, False])
def test_positions_are_the_untiled_calls(coords):
    """The rotary input each tile call's rope receives equals the untiled call's at the tile's tokens."""
    tr = ltx2()
    frames, h, w = 3, 5, 7
    kw = inputs(tr, frames, h, w, coords=coords)
    seen = []
    handle = tr.rope.register_forward_hook(lambda m, a, o: seen.append(a[0]))
    call(tr, kw)
    full = seen.pop()
    call(TiledDenoiser(tr, tile_size=(3, 4), overlap=1), kw)
    handle.remove()
    assert len(seen) > 1
    grid = torch.arange(frames * h * w).reshape(frames, h, w)
    for got in seen:  # each tile's (B, 3, n, 2) coords: find its box from its own coords, compare
        ys = (got[0, 1, :, 0] / 32).long()
        xs = (got[0, 2, :, 0] / 32).long()
        box = grid[:, ys.min() : ys.max() + 1, xs.min() : xs.max() + 1].flatten()
        assert got.shape[2] == len(box) < frames * h * w
        assert torch.equal(got, full[:, :, box])


def test_return_dict_output_class():
    tr = ltx2()
    kw = inputs(tr) | {"return_dict": True}
    want, got = call(tr, kw), call(TiledDenoiser(tr, tile_size=(5, 7), overlap=0), kw)
    assert type(got) is type(want)
    assert (got.sample - want.sample).abs().max() <= 1e-5
    assert (got.audio_sample - want.audio_sample).abs().max() <= 1e-5


def test_image_to_video_per_token_timestep():
    """LTX2ImageToVideoPipeline's call: the video timestep per token (0 on the first frame's), the audio's
    per row; one tile equals the untiled call, several tiles give its shapes."""
    tr = ltx2()
    frames, h, w = 3, 5, 7
    kw = inputs(tr, frames, h, w)
    t = kw["timestep"]
    mask = torch.zeros(2, frames * h * w)
    mask[:, : h * w] = 1  # the conditioning (first) frame's tokens
    kw |= {"timestep": t[:, None] * (1 - mask), "audio_timestep": t, "sigma": t}
    want = call(tr, kw)
    one = call(TiledDenoiser(tr, tile_size=(5, 7), overlap=0), kw)
    assert all((a - b).abs().max() <= 1e-5 for a, b in zip(one, want, strict=True))
    seen = []
    handle = tr.time_embed.register_forward_hook(lambda m, a, o: seen.append(a[0]))
    got = call(TiledDenoiser(tr, tile_size=4, overlap=2), kw)
    handle.remove()
    assert [v.shape for v in got] == [v.shape for v in want]
    assert len(seen) > 1 and all(s.numel() < kw["timestep"].numel() for s in seen)  # the tiles' tokens
