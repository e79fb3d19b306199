"""Magvit's VAE (`AutoencoderKLMagvit`, EasyAnimate) through TiledVAE, traced from what it computes. Its
decode and encode are chunked loops (the first frame, then chunks of latent / video frames) whose causal
convolutions carry their last input frames over as a cache, each convolution itself a loop over its
windows of frames: one convolution over every frame (`trace.video_windows`), chunk by chunk; its GroupNorms
of each frame (spatial_group_norm=True, the default); its temporal upsamplers double every chunk's frames
but the first's. Traced as the one pass that equals (`vae.video_calls.magvit_decode`), the tiled decode,
encode and gradients equal the stock VAE's chunked loop (fp32, max abs <= 1e-4)."""

import pytest

torch = pytest.importorskip("torch")

from video_vae_support import latent, magvit, same_gradients, video, video_vae  # noqa: E402

import tilewise as tw  # noqa: E402
from tilewise.locality import LoweringError  # noqa: E402
from tilewise.locality.ops3d import CausalConv3d  # noqa: E402
from tilewise.locality.ops3d_sync import FrameGroupNorm  # noqa: E402
from tilewise.vae.video.executor import VideoExecutor  # noqa: E402

TOL = 1e-4


def _caches(vae) -> list:
    """Every cache its loop keeps (convolutions' and upsamplers' prev_features): None between calls."""
    return [m.prev_features for m in vae.modules() if hasattr(m, "prev_features")]


# odd latent sizes, tiles of 2 latent px (a 2 x 3 grid); 1, 2, 3 latent frames (1, 5, 9 out: the stock
# loop decodes the first latent frame alone, its upsamplers doubling every later chunk's frames)
@pytest.mark.parametrize("frames", [1, 2, 3])
def test_magvit_decode_is_exact(frames):
    vae = video_vae("magvit")
    tv = tw.TiledVAE(vae, tile_size=2, progress=False)
    assert all(c is None for c in _caches(vae))  # (tracing it leaves no cache behind)
    z = latent(frames, 3, 5, seed=frames)
    with torch.no_grad():
        ref = vae.decode(z).sample
        out = tv.decode(z).sample
    assert out.shape == ref.shape == (1, 3, 1 + 4 * (frames - 1), 24, 40)
    assert (out - ref).abs().max() <= TOL
    assert tv.plan(tuple(z.shape)).grid == (2, 3)


# the frame counts its encode loop takes (1 + 4 k: the first frame, then chunks of 4 that halve to whole
# frames at both temporal downsamplings); 3 x 5 latent px, tiles of 2 (a 2 x 3 grid)
@pytest.mark.parametrize("frames", [1, 5, 9])
def test_magvit_encode_is_exact(frames):
    vae = video_vae("magvit")
    tv = tw.TiledVAE(vae, tile_size=2, progress=False)
    x = video(frames, 24, 40, seed=frames)
    with torch.no_grad():
        ref = vae.encode(x).latent_dist
        out = tv.encode(x).latent_dist
    assert out.mean.shape == ref.mean.shape == (1, 4, 1 + (frames - 1) // 4, 3, 5)
    assert (out.mean - ref.mean).abs().max() <= TOL and (out.logvar - ref.logvar).abs().max() <= TOL
    assert all(c is None for c in _caches(vae))


def test_a_frame_count_its_encode_loop_does_not_take_is_refused_at_the_call():
    """3 frames: the stock loop's chunk of 2 halves to one frame, which its next downsampling cannot
    stride over (it fails); the tiled encode refuses the call, naming the counts it takes."""
    vae = video_vae("magvit")
    tv = tw.TiledVAE(vae, tile_size=2, progress=False)
    x = video(3, 16, 16)
    with torch.no_grad(), pytest.raises(ValueError, match="expected a non-empty list of Tensors"):
        vae.encode(x)
    vae._clear_conv_cache()  # (the failed stock call leaves its caches behind)
    with pytest.raises(ValueError, match=r"encode\(\): AutoencoderKLMagvit encodes 1 \+ 4 k frames.*fails on "
                       r"3 frames"):
        tv.encode(x)


def test_its_program_is_placed_by_rules_and_analyzed():
    """Every op placed by what it computes (no measured op): each convolution's loop over its windows one
    causal convolution, its GroupNorms of each frame the sync ops."""
    vae = video_vae("magvit")
    tv = tw.TiledVAE(vae, progress=False)
    for kind, scale, coder in (("decode", 8.0, vae.decoder), ("encode", 0.125, vae.encoder)):
        p = tv.program(kind)
        convs = sum(type(m).__name__ == "EasyAnimateCausalConv3d" for m in coder.modules())
        assert {type(op).__name__ for op in p.ops} <= {"Add", "CausalConv3d", "FrameGroupNorm", "Pointwise",
                                                      "Rearrange"}
        causal = [op for op in p.ops if isinstance(op, CausalConv3d) and op.pad_t == 2]
        assert all(op.fill == "first" for op in causal) and len(causal) == convs
        r = tw.analyze(p)
        norms = [op for op in p.ops if isinstance(op, FrameGroupNorm)]
        assert r.scale == scale and len(r.sync_ops) == len(norms) > 0


def test_per_chunk_group_norms_are_refused_by_name():
    with pytest.raises(LoweringError, match=r"cannot tile AutoencoderKLMagvit: its GroupNorms "
                       r"\(spatial_group_norm=False\) reduce over the frames of each chunk"):
        tw.TiledVAE(magvit(spatial_group_norm=False), progress=False)


def test_gradients_through_the_decode_equal_the_stock_vae():
    vae = video_vae("magvit")
    tv = tw.TiledVAE(vae, tile_size=1, progress=False)
    d = vae.decoder
    w = torch.randn(1, 3, 5, 16, 16, generator=torch.Generator().manual_seed(5))
    same_gradients(vae, tv, latent(2, 2, 2, seed=4),
                    [d.conv_in.weight, d.up_blocks[1].upsampler.conv.weight,
                     d.mid_block.convs[0].norm1.weight, vae.post_quant_conv.weight],
                    lambda m, t: (m.decode(t).sample * w).sum())


def test_gradients_through_the_encode_equal_the_stock_vae():
    vae = video_vae("magvit")
    tv = tw.TiledVAE(vae, tile_size=1, progress=False)
    e = vae.encoder
    same_gradients(vae, tv, video(5, 16, 24, seed=6),
                    [e.conv_in.weight, e.down_blocks[1].downsampler.conv.weight, e.conv_norm_out.bias,
                     vae.quant_conv.weight],
                    lambda m, t: m.encode(t).latent_dist.mode().square().sum())


@pytest.mark.slow
def test_both_orders_and_stagings_are_exact():
    vae = video_vae("magvit")
    p = tw.TiledVAE(vae, progress=False).program("decode")
    z = latent(2, 3, 4, seed=3)
    with torch.no_grad():
        ref = vae.decode(z).sample
        for order, staging in (("frames", "host"), ("tiles", "device")):
            ex = VideoExecutor(p, 2, p.input, staging=staging, order=order, progress=False)
            assert (ex.run(z).output - ref).abs().max() <= TOL


class _Windows(torch.nn.Conv3d):
    """A causal convolution looping over its windows of frames as Magvit's does: from frame `first`, every
    `step` frames, `short` windows before the last that fits (Magvit's: from 0, its stride, none short)."""

    def __init__(self, first=0, step=1, short=0):
        super().__init__(2, 2, 3, padding=(0, 1, 1))
        self.first, self.step, self.short = first, step, short

    def forward(self, x):
        x = torch.nn.functional.pad(x, (0, 0, 0, 0, 2, 0), mode="replicate")
        outs = [super(_Windows, self).forward(x[:, :, i : i + 3])
                for i in range(self.first, x.size(2) - 2 - self.short, self.step)]
        return torch.concat(outs, 2)


@pytest.mark.parametrize("first,step,short,said", [
    (0, 1, 0, None), (0, 2, 0, None), (0, 3, 0, None), (1, 1, 0, r"windows from frames \[1, 2, .*\] of 11"),
    (0, 2, 2, r"windows from frames \[0, 2, 4, 6\] of 11")])
def test_a_loop_over_windows_is_one_convolution_only_where_it_is_every_window(first, step, short, said):
    """Every window in order, one stride apart (1, 2, 3): one convolution, equal to the loop on other frame
    counts; from frame 1, or stopping short of the last window, refused by call and module path."""
    from tilewise.locality.trace import lower_traced

    torch.manual_seed(0)
    m = _Windows(first, step, short).eval()
    example = torch.empty(1, 2, 9, 13, 11, device="meta")
    if said is not None:
        with pytest.raises(LoweringError, match=r"the call 'concat' at '\(its forward\)'.*" + said):
            lower_traced(m, m, example)
        return
    p = lower_traced(m, m, example)
    convs = [op for op in p.ops if isinstance(op, CausalConv3d)]
    assert len(convs) == 1 and convs[0].stride_t == step and convs[0].fill == "first"
    for frames in (1, 4, 6):
        x = torch.randn(1, 2, frames, 5, 6, generator=torch.Generator().manual_seed(frames))
        ex = VideoExecutor(p, 2, p.input, progress=False)
        with torch.no_grad():
            assert (ex.run(x).output - m(x)).abs().max() <= TOL
