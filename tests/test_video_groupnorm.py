"""3-D VAEs whose GroupNorms reduce over frames x space (HunyuanVideo): each GroupNorm a sync op of the
video program, its statistics merged over every tile of the causal step; the mid-block's attention over
every token of the step with the causal mask between frames. Tiled decode, encode and gradients equal the
stock VAE's one-pass computation (fp32, max abs <= 1e-4)."""

import pytest

torch = pytest.importorskip("torch")

from video_vae_support import video_vae  # noqa: E402

import tilewise as tw  # noqa: E402
from tilewise.locality.ops3d_sync import StepAttention, VideoGroupNorm  # noqa: E402
from tilewise.locality.program3d import VideoProgram  # noqa: E402
from tilewise.vae.video.executor import VideoExecutor  # noqa: E402
from tilewise.vae.video.plan import make_video_plan  # noqa: E402
from tilewise.vae.video.units import video_segments  # noqa: E402

TOL = 1e-4


def _latent(frames, h, w, seed=0, batch=1):
    return torch.randn(batch, 4, frames, h, w, generator=torch.Generator().manual_seed(seed))


def _stock_decode(vae, z):
    """The stock decode in one pass (`decode` itself for <= 4 latent frames; past them its framewise
    decoding, on by default, is a temporal tiling with blending, which it is switched off for)."""
    was, vae.use_framewise_decoding = vae.use_framewise_decoding, False
    try:
        return vae.decode(z).sample
    finally:
        vae.use_framewise_decoding = was


# odd latent sizes, tiles of 3 latent px (a 2 x 3 grid); one frame, several, more than the stock VAE
# decodes in one pass by default (6 > 4)
@pytest.mark.parametrize("frames", [1, 3, 6])
def test_hunyuan_video_decode_is_exact(frames, caplog):
    vae = video_vae("hunyuan")
    tv = tw.TiledVAE(vae, tile_size=3, progress=False)
    z = _latent(frames, 5, 7, seed=frames)
    with torch.no_grad(), caplog.at_level("INFO", logger="tilewise"):
        ref = _stock_decode(vae, z)
        out = tv.decode(z).sample
    said = "would decode these 6 latent frames framewise (use_framewise_decoding past 4" in caplog.text
    assert said is (frames > 4)
    assert out.shape == ref.shape == (1, 3, 1 + 4 * (frames - 1), 40, 56)
    assert (out - ref).abs().max() <= TOL
    plan = tv.plan(tuple(z.shape))
    assert plan.grid == (2, 3) and plan.sync_ops == sum(op.sync for op in tv.program("decode").ops) > 20
    if frames <= 4:  # (the stock decode's own path: one pass)
        with torch.no_grad():
            assert (vae.decode(z).sample - ref).abs().max() == 0


# 9 frames (1 + 4 k), 10 and 4 (the causal strided convolutions take any count)
@pytest.mark.parametrize("frames", [1, 4, 9, 10])
def test_hunyuan_video_encode_is_exact(frames):
    vae = video_vae("hunyuan")
    tv = tw.TiledVAE(vae, tile_size=2, progress=False)
    x = torch.rand(1, 3, frames, 24, 40, generator=torch.Generator().manual_seed(frames)) * 2 - 1
    with torch.no_grad():
        ref = vae.encode(x).latent_dist
        out = tv.encode(x).latent_dist
    assert out.mean.shape == ref.mean.shape == (1, 4, 1 + (frames - 1) // 4, 3, 5)
    assert (out.mean - ref.mean).abs().max() <= TOL and (out.logvar - ref.logvar).abs().max() <= TOL


@pytest.mark.parametrize("order,staging", [("frames", "host"), ("tiles", "device")])
def test_both_orders_are_exact_and_hold_what_the_plan_says(order, staging):
    vae = video_vae("hunyuan")
    tv = tw.TiledVAE(vae, tile_size=3, progress=False)
    z = _latent(2, 7, 5, seed=2, batch=2)
    plan = make_video_plan(tv.settings, tv.job("decode"), tuple(z.shape), staging=staging, order=order)
    p = tv.program("decode")
    ex = VideoExecutor(p, plan.tile_size, p.input, staging=staging, order=order, progress=False)
    with torch.no_grad():
        res = ex.run(z)
        ref = _stock_decode(vae, z)
    assert (res.output - ref).abs().max() <= TOL
    assert res.staged_peak == plan.staged_peak > 0 and res.cache_peak == plan.cache_bytes == 0
    norms = sum(op.kind == "group_norm" for op in p.ops)
    assert plan.stats_bytes == norms * 2 * 2 * 4 * 8  # (mean, var) x batch 2 x 4 groups, float64
    assert "GroupNorm statistics" in str(plan) and plan.attention_bytes > 0


@pytest.mark.parametrize("name", ["hunyuan", "mochi"])
def test_given_statistics_cut_no_segment_and_a_runs_own_reproduce_it(name):
    """A run returns every GroupNorm's merged statistics per step; given back (`fixed_stats`), its
    GroupNorms are affines inside their segments (only attention cuts), nothing between them is staged,
    and the output is the same (HunyuanVideo's over the step's frames; Mochi's of each frame, in a
    program of several causal steps)."""
    vae = video_vae(name)
    p = tw.TiledVAE(vae, progress=False).program("decode")
    c = p.in_channels
    z = torch.randn(1, c, 3, 5, 7, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        exact = VideoExecutor(p, 2, p.input, progress=False).run(z)
        norms = [op for op in p.ops if op.kind == "group_norm"]
        steps = len(p.chunks(z.shape[2]))
        assert set(exact.stats) == {(id(op), k) for op in norms for k in range(steps)}
        given = VideoExecutor(p, 2, p.input, progress=False, fixed_stats=exact.stats)
        res = given.run(z)
        off = {k: (m + 1, v) for k, (m, v) in exact.stats.items()}  # (the statistics are the ones applied)
        moved = VideoExecutor(p, 2, p.input, progress=False, fixed_stats=off).run(z).output
    assert (res.output - exact.output).abs().max() <= TOL and (moved - exact.output).abs().max() > 0.1
    ids = {id(op) for op in norms}
    cuts = video_segments(p, given.attention, ids)
    assert len(cuts) < len(video_segments(p, given.attention))
    kinds = [seg.kind for seg in cuts]  # (no two local segments in a row: only attention cuts)
    assert all(a != "local" or b != "local" for a, b in zip(kinds, kinds[1:], strict=False))
    assert res.staged_peak < exact.staged_peak and res.stats == {}


def test_gradients_through_the_decode_equal_the_stock_vae():
    vae = video_vae("hunyuan")
    tv = tw.TiledVAE(vae, tile_size=3, progress=False)
    z = _latent(2, 5, 6, seed=4)
    w = torch.randn(1, 3, 5, 40, 48, generator=torch.Generator().manual_seed(5))
    d = vae.decoder
    params = [d.mid_block.attentions[0].to_q.weight, d.up_blocks[1].resnets[0].norm1.weight,
              d.conv_in.conv.weight]
    grads = []
    for run in (lambda t: _stock_decode(vae, t), lambda t: tv.decode(t).sample):
        zz = z.clone().requires_grad_(True)
        grads.append(torch.autograd.grad((run(zz) * w).sum(), [zz, *params]))
    for a, b in zip(*grads, strict=True):
        assert (a - b).abs().max() <= TOL * b.abs().max()


def test_gradients_through_the_encode_equal_the_stock_vae():
    vae = video_vae("hunyuan")
    tv = tw.TiledVAE(vae, tile_size=2, progress=False)
    x = torch.rand(1, 3, 5, 24, 40, generator=torch.Generator().manual_seed(6)) * 2 - 1
    e = vae.encoder
    params = [e.mid_block.attentions[0].to_k.weight, e.conv_norm_out.bias,
              e.down_blocks[0].resnets[0].norm2.weight]
    grads = []
    for run in (vae, tv):
        xx = x.clone().requires_grad_(True)
        grads.append(torch.autograd.grad(run.encode(xx).latent_dist.mean.square().sum(), [xx, *params]))
    for a, b in zip(*grads, strict=True):
        assert (a - b).abs().max() <= TOL * b.abs().max()


def test_drops_into_a_stock_hunyuan_video_pipeline():
    """pipe.vae = TiledVAE(pipe.vae) in HunyuanVideoPipeline (prompt embeddings given: its Llama and CLIP
    text encoders are not built): the decoded video (9 frames from 3 latent frames, a 3 x 4 grid of
    tiles) equals the stock VAE's."""
    from tiny_denoisers import hunyuan_video

    pipe, call = hunyuan_video()
    pipe.set_progress_bar_config(disable=True)
    call = dict(call, num_inference_steps=2, output_type="pt")
    ref = pipe(generator=torch.Generator().manual_seed(1), **call).frames
    pipe.vae = tw.TiledVAE(pipe.vae, tile_size=3, progress=False)
    out = pipe(generator=torch.Generator().manual_seed(1), **call).frames
    assert pipe.vae.plan((1, 4, 3, 8, 12)).grid == (3, 4)
    assert out.shape == ref.shape == (1, 9, 3, 32, 48) and (out - ref).abs().max() <= TOL
    assert ((ref > 0) & (ref < 1)).float().mean() > 0.5  # (most pixels not clamped: the test sees them)


def test_a_norm_over_the_frames_of_a_step_is_refused_in_a_program_of_several_steps():
    vae = video_vae("hunyuan")
    p = tv_program = tw.TiledVAE(vae, progress=False).program("decode")
    several = VideoProgram(ops=tv_program.ops, input=p.input, output=p.output, in_channels=p.in_channels,
                           name="several", first=1, every=4)
    assert any(isinstance(op, VideoGroupNorm) for op in p.ops) and any(isinstance(op, StepAttention)
                                                                       for op in p.ops)
    with pytest.raises(ValueError, match="reduces over the frames of a causal step, but the program runs 1 "
                                         r"\+ 4 k frames a step"):
        VideoExecutor(several, 3, p.input, progress=False)


def _decode_on_ranks(rank: int, world: int):
    torch.set_num_threads(1)
    tv = tw.TiledVAE(video_vae("hunyuan"), tile_size=3, progress=False, process_group="default")
    with torch.no_grad():
        return tv.decode(_latent(2, 7, 5, seed=9)).sample


@pytest.mark.skipif(not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
                    reason="torch.distributed with gloo is needed")
def test_a_process_group_merges_each_steps_statistics_over_the_ranks():
    """Each rank runs its band of tile rows; every GroupNorm's moments are merged over the ranks (Chan,
    float64) before its segment: 2 gloo ranks equal the stock VAE."""
    from tilewise import distributed as td

    vae = video_vae("hunyuan")
    with torch.no_grad():
        ref = _stock_decode(vae, _latent(2, 7, 5, seed=9))
    res = td.spawn(_decode_on_ranks, 2, start_method="fork", limit=120.0, timeout=60)
    for out in res:
        assert out.shape == ref.shape and (out - ref).abs().max() <= TOL


class _TokenAttention(torch.nn.Module):
    """A causal 3-D convolution, then diffusers' Attention over every frame's tokens as HunyuanVideo's
    mid-block calls it, with its causal mask, no mask, or another mask (`mask`)."""

    def __init__(self, mask: str):
        from diffusers.models.attention_processor import Attention

        super().__init__()
        self.conv = torch.nn.Conv3d(4, 8, 3, padding=(0, 1, 1))
        self.attn = Attention(8, heads=2, dim_head=4, norm_num_groups=2, residual_connection=True, bias=True,
                              _from_deprecated_attn_block=True)
        self.mask = mask

    def forward(self, x):
        from diffusers.models.autoencoders.autoencoder_kl_hunyuan_video import prepare_causal_attention_mask

        h = self.conv(torch.nn.functional.pad(x, (0, 0, 0, 0, 2, 0), mode="replicate"))
        b, c, t, hh, ww = h.shape
        tokens = h.permute(0, 2, 3, 4, 1).flatten(1, 3)
        mask = None
        if self.mask == "causal":
            mask = prepare_causal_attention_mask(t, hh * ww, h.dtype, h.device, batch_size=b)
        elif self.mask == "other":
            mask = torch.zeros(b, t * hh * ww, t * hh * ww, dtype=h.dtype, device=h.device)
        y = self.attn(tokens, attention_mask=mask)
        return y.unflatten(1, (t, hh, ww)).permute(0, 4, 1, 2, 3)


@pytest.mark.parametrize("mask", ["causal", "none"])
def test_attention_over_every_frames_tokens_is_exact_with_the_causal_mask_or_none(mask):
    from tilewise.locality.trace import lower_traced

    torch.manual_seed(0)
    m = _TokenAttention(mask).eval()
    p = lower_traced(m, m, torch.empty(1, 4, 9, 13, 11, device="meta"))
    att = [op for op in p.ops if isinstance(op, StepAttention)]
    assert len(att) == 1 and att[0].causal is (mask == "causal") and att[0].heads == 2
    x = _latent(4, 7, 6, seed=11, batch=2)
    with torch.no_grad():
        ref = m(x)
        out = VideoExecutor(p, 3, p.input, progress=False).run(x).output
    assert (out - ref).abs().max() <= TOL


def test_another_attention_mask_over_the_tokens_is_refused():
    from tilewise.locality import LoweringError
    from tilewise.locality.trace import lower_traced

    m = _TokenAttention("other").eval()
    with pytest.raises(LoweringError, match="an attention mask over a video value's tokens that is not the "
                                            "causal mask between frames"):
        lower_traced(m, m, torch.empty(1, 4, 9, 13, 11, device="meta"))


def test_decode_to_a_video_sink_streams_the_exact_video(tmp_path):
    import numpy as np

    vae = video_vae("hunyuan")
    tv = tw.TiledVAE(vae, tile_size=3, progress=False)
    z = _latent(2, 5, 4, seed=12)
    with torch.no_grad():
        ref = _stock_decode(vae, z)
    with tw.open_video_sink(str(tmp_path / "v.npy"), 5, 40, 32, bits=32) as sink:
        tv.decode_to(z, sink)
    got = torch.from_numpy(np.load(tmp_path / "v.npy"))  # (T, H, W, C) in [-1, 1] as written
    assert got.shape == (5, 40, 32, 3)
    assert (got - ref[0].permute(1, 2, 3, 0)).abs().max() <= TOL
