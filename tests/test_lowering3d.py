"""Video tile programs: the lowered 3-D causal VAEs equal the modules step by step; LTX-Video's, Wan's and
Qwen-Image's traced programs are their hand lowerings' (`hand_lowering_ltx`, `hand_lowering_wan`, the
oracles); the static analysis agrees with the
empirical probe."""

import pytest

torch = pytest.importorskip("torch")

from hand_lowering_ltx import lower_ltx  # noqa: E402
from hand_lowering_wan import lower_video_vae  # noqa: E402
from video_vae_support import factor, ltx, video_vae, wan  # noqa: E402

import tilewise as tw  # noqa: E402
from tilewise.locality import LoweringError, analyze, lower, probe_receptive_field  # noqa: E402
from tilewise.locality.analysis import analyze_program  # noqa: E402
from tilewise.locality.ops import OpKind  # noqa: E402
from tilewise.locality.program import split_segments  # noqa: E402

NAMES = ["qwen", "wan2.1", "wan2.2", "ltx0.9.0", "ltx0.9.5"]


def _latent(frames, h=5, w=7, seed=0):
    return torch.randn(1, 4, frames, h, w, generator=torch.Generator().manual_seed(seed))


def _program(vae, kind):
    """The video program TiledVAE runs for a decode or encode of vae (its family's lowering)."""
    return tw.TiledVAE(vae, progress=False).program(kind)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("frames", [1, 3])
def test_lowered_decode_equals_the_vae_step_by_step(name, frames):
    vae = video_vae(name)
    z = _latent(frames)
    with torch.no_grad():
        ref = vae.decode(z).sample
        out = _program(vae, "decode").run_steps(z)
    assert out.shape == ref.shape and (out - ref).abs().max() <= 1e-5


# frames: one, a full causal chunk after the first, and counts that are not 1 + a multiple of the temporal
# compression (Wan encodes 1 + 4k frames and drops the rest, as its encode does; LTX 0.9.0 takes any)
@pytest.mark.parametrize("name,frames", [("qwen", 1), ("wan2.1", 5), ("wan2.1", 7), ("wan2.2", 6),
                                         ("ltx0.9.0", 6), ("ltx0.9.5", 9)])
def test_lowered_encode_equals_the_vae(name, frames):
    vae = video_vae(name)
    f = factor(vae)
    x = torch.rand(1, 3, frames, 2 * f, 3 * f, generator=torch.Generator().manual_seed(1)) * 2 - 1
    with torch.no_grad():
        ref = vae.encode(x).latent_dist.parameters
        out = _program(vae, "encode").run_steps(x)
    assert out.shape == ref.shape and (out - ref).abs().max() <= 1e-5


def test_causal_steps_are_the_models_chunks():
    dec, enc = _program(video_vae("wan2.1"), "decode"), _program(video_vae("wan2.1"), "encode")
    assert dec.chunks(3) == [(0, 1), (1, 2), (2, 3)]
    assert enc.chunks(7) == [(0, 1), (1, 5)]  # frames 5, 6 are not encoded (AutoencoderKLWan._encode)
    assert enc.chunks(9) == [(0, 1), (1, 5), (5, 9)]
    assert _program(video_vae("ltx0.9.0"), "decode").chunks(5) == [(0, 5)]
    frames = dec.frames(dec.chunks(3))
    assert frames[dec.output] == [1, 4, 4]  # Wan's first latent frame makes one frame, the others four


def test_wan_report_names_the_per_frame_attention_and_the_probe_sees_it_global():
    vae = video_vae("wan2.1")
    z = _latent(2, 9, 9)
    report = analyze(vae.decoder, z)
    assert not report.exact_tileable and report.halo is None
    assert [s.kind for s in report.segments] == ["local", "attention", "local"]
    assert report.sync_ops == [("mid_block.attentions.0", "attention")]
    assert "attention" in str(report) and report.local_halo > 8
    probe = probe_receptive_field(lambda t: vae.decode(t).sample, z)
    assert probe.whole_output
    enc = analyze(vae.encoder, torch.zeros(1, 3, 1, 64, 64))
    assert enc.align == 8 and [s.kind for s in enc.segments] == ["local", "attention", "local"]


def test_wan_decoder_without_attention_static_halo_equals_probe():
    """With the mid-block attention removed (WanMidBlock skips it), the decode is local: the halo from the
    graph (convolutions, resampling, caches) equals the one measured by perturbing a latent pixel."""
    vae = wan("2.1")
    vae.decoder.mid_block.attentions = torch.nn.ModuleList()
    program = _program(vae, "decode")
    report = analyze(program)
    assert report.exact_tileable
    z = _latent(2, 27, 27, seed=3)
    probe = probe_receptive_field(lambda t: vae.decode(t).sample, z)
    assert not probe.whole_output and probe.radius == report.halo


def test_ltx_is_exact_tileable_and_static_halo_equals_probe():
    vae = video_vae("ltx0.9.0")
    z = _latent(2, 29, 29, seed=4)
    report = analyze(vae.decoder, z)
    assert report.exact_tileable and "exact_tileable: yes" in str(report)
    probe = probe_receptive_field(lambda t: vae.decode(t).sample, z)
    assert not probe.whole_output and probe.radius == report.halo
    enc = analyze(vae.encoder)
    x = torch.rand(1, 3, 1, 8 * 24, 8 * 24, generator=torch.Generator().manual_seed(5))
    probe = probe_receptive_field(lambda t: vae.encode(t).latent_dist.mean, x)
    assert enc.align == 8 and 0 < probe.radius <= enc.halo


def test_lowered_programs_cut_only_at_the_attention():
    program = lower(video_vae("qwen").decoder)
    segs = split_segments(program)
    assert [s.kind for s in segs] == ["local", "attention", "local"]
    assert program.output in segs[-1].outputs


def _structure(program, frames, hw):
    """What the planner and executor read of a video program: its 3-D convolutions' geometry (kernel,
    strides, spatial and temporal padding, what the padding repeats; in any order: a resnet's shortcut
    may come first or last), its rearrangements' scales, its segments' kinds, halos and scales, its sync
    ops, halo and alignment, and its frames per step."""
    made = {op.dst: op for op in program.ops}
    convs = sorted((op.kernel, int(op.weight.shape[2]), op.stride, op.stride_t, op.dilation_t, op.padding,
                    op.pad_t + _front(made.get(op.src[0])), op.pad_end, op.fill if op.pad_t else None,
                    op.fill_end if op.pad_end else None, op.groups)
                   for op in program.ops if op.kind is OpKind.CONV3D)
    scales = [(op.down, op.up) for op in program.ops if op.kind is OpKind.REARRANGE and op.down * op.up > 1]
    r = analyze_program(program, hw)
    segments = [(s.kind, s.halo, s.scale) for s in r.segments]
    steps = [program.frames(program.chunks(t))[program.output] for t in frames]
    return convs, scales, segments, [k for _, k in r.sync_ops], r.local_halo, r.align, r.scale, steps


def _front(op) -> int:
    """Frames the hand lowering's "first k frames again in front" op (LTX-Video 0.9.5's downsamplers) adds
    before a convolution; the traced lowering merges them into the convolution's causal padding."""
    if op is None or op.kind is not OpKind.REARRANGE or not op.label.startswith("first "):
        return 0
    return op.frames([5], 0) - 5


@pytest.mark.parametrize("name", ["ltx0.9.0", "ltx0.9.5"])
def test_ltx_traced_programs_are_the_hand_lowerings(name):
    """The traced decode and encode of LTX-Video (read from what they compute) have the hand lowering's
    convolutions, rearrangements, segments, halos, sync points and frames, and compute the same."""
    vae = video_vae(name)
    f = factor(vae)
    z, x = _latent(3), torch.rand(1, 3, 9, 2 * f, 3 * f, generator=torch.Generator().manual_seed(1))
    for kind, module, t, frames, hw in (("decode", vae.decoder, z, (1, 3, 4), (13, 11)),
                                        ("encode", vae.encoder, x, (1, 9, 17), (13 * f, 11 * f))):
        traced, hand = _program(vae, kind), lower_ltx(module)
        assert _structure(traced, frames, hw) == _structure(hand, frames, hw), kind
        with torch.no_grad():
            assert torch.equal(traced.run_steps(t), hand.run_steps(t)), kind


def _caches(program, frames):
    """The frames each causal cache holds after each step of a video of `frames` (of one pixel and
    channel), for every op keeping one (sorted)."""
    steps = len(program.chunks(frames))
    held = [tuple(op.cache_elems((0, 1, 0, 1), [(1, 1)], 1, k) for k in range(steps))
            for op in program.ops if hasattr(op, "cache_elems")]
    return sorted(h for h in held if any(h))


@pytest.mark.parametrize("name", ["wan2.1", "wan2.2", "qwen"])
def test_wan_traced_programs_are_the_hand_lowerings(name):
    """The traced decode and encode of Wan 2.1 / 2.2 and Qwen-Image (their first and a later loop call,
    merged) have the hand lowering's convolutions (the time resamplers' as causal convolutions there),
    segments, halos, sync points, frames per step and causal caches' frames, and compute the same."""
    vae = video_vae(name)
    f = factor(vae)
    z, x = _latent(3), torch.rand(1, 3, 9, 2 * f, 3 * f, generator=torch.Generator().manual_seed(1))
    for kind, t, frames, hw in (("decode", z, (1, 3, 4), (13, 11)),
                                ("encode", x, (1, 5, 9, 11), (13 * f, 11 * f))):
        traced, hand = _program(vae, kind), lower_video_vae(vae, kind)
        hand3 = _as_convs(hand)
        a, b = _structure(traced, frames, hw), _structure(hand3, frames, hw)
        assert a[:1] + a[2:] == b[:1] + b[2:] and _scales(traced) == _scales(hand3), kind
        assert [_caches(traced, n) for n in frames] == [_caches(hand, n) for n in frames], kind
        with torch.no_grad():
            assert (traced.run_steps(t) - hand.run_steps(t)).abs().max() <= 1e-5, kind


def _scales(program):
    """The spatial scales of a program's resamplings in order: a rearrangement's (down, up), a per-frame
    nearest upsampling's (1, scale) (the hand lowering's FrameUpsample, the traced one's Rearrange)."""
    return [(op.down, op.up) if op.kind is OpKind.REARRANGE else (1, op.scale) for op in program.ops
            if op.kind is OpKind.UPSAMPLE or op.kind is OpKind.REARRANGE and op.down * op.up > 1]


def _as_convs(program):
    """The hand lowering with its TimeUp / TimeDown ops as the causal convolutions they compute (kernel 3x1x1,
    cache 2 / stride 2 and cache 1), as the traced lowering reads them, for `_structure`'s conv list."""
    from tilewise.locality.ops3d import CausalConv3d

    ops = []
    for op in program.ops:
        if op.kind in (OpKind.TIME_UP, OpKind.TIME_DOWN):
            up = op.kind is OpKind.TIME_UP
            conv = CausalConv3d(src=op.src, dst=op.dst, name=op.name, weight=op.weight, bias=op.bias,
                                stride_t=1 if up else 2, pad_t=2 if up else 1)
            conv.frames = op.frames  # (the frames the op makes: the interleave's, the first step's too)
            ops.append(conv)
        else:
            ops.append(op)
    return type(program)(**{**program.__dict__, "ops": ops})


@pytest.mark.parametrize("option,match", [
    ({"decoder_inject_noise": (True, False, False, False, False)},
     r"its decoder injects noise \(decoder_inject_noise=\(True, False, False, False, False\)")])
def test_ltx_decoders_that_cannot_be_exact_are_refused_with_the_reason(option, match):
    """LTX-Video 0.9.1's noise injection (a fresh draw each call) is refused when the TiledVAE is built, by
    name and reason (timestep conditioning is tiled exactly: tests/test_vae_timestep.py)."""
    from diffusers import AutoencoderKLLTXVideo

    vae = AutoencoderKLLTXVideo(**{**ltx("0.9.0").config, **option})
    with pytest.raises(LoweringError, match=f"TiledVAE cannot tile AutoencoderKLLTXVideo.*{match}"):
        tw.TiledVAE(vae)


def test_unknown_3d_module_names_it_and_points_to_probe():
    vae = video_vae("wan2.1")
    with pytest.raises(LoweringError, match="AutoencoderKLWan.*probe_receptive_field"):
        lower(vae)


# (decoder scale, encoder align); Wan 2.2's whole VAE (its decoder alone, without the loop's caches, does
# not run: its DupUp3D shortcuts double the frames its uncached upsamplers keep), its (un)patchify 2x
ANALYSIS = {"qwen": (8, 8), "wan2.1": (8, 8), "wan2.2": (16, 16), "ltx0.9.0": (8, 8), "ltx0.9.5": (16, 16)}


@pytest.mark.parametrize("name", NAMES)
def test_analyze_reports_segments_halos_sync_points_and_verdict(name):
    """tw.analyze on the decoder and the encoder: Wan / Qwen-Image cut at the one mid-block attention,
    LTX-Video has no sync op (exact_tileable with a finite halo); the alignment is the downsampling
    along one path (a downsampler and its parallel shortcut count once)."""
    vae = video_vae(name)
    scale, align = ANALYSIS[name]
    if name == "wan2.2":
        dec, enc = tw.analyze(vae), tw.analyze(vae, kind="encode")
    else:
        dec, enc = analyze(vae.decoder), analyze(vae.encoder)
    assert dec.scale == scale and enc.scale == 1 / align and enc.align == align and dec.align == 1
    for report in (dec, enc):
        text = str(report)
        if name.startswith("ltx"):
            assert report.exact_tileable and report.sync_ops == [] and len(report.segments) == 1
            assert report.halo == report.local_halo > 0 and f"halo {report.halo} input px" in text
        else:
            assert [s.kind for s in report.segments] == ["local", "attention", "local"]
            where = ("decoder." if report is dec else "encoder.") if name == "wan2.2" else ""
            assert report.sync_ops == [(f"{where}mid_block.attentions.0", "attention")]
            assert report.halo is None
            assert report.segments[0].halo > 0 and report.segments[2].halo > 0
            assert "exact_tileable: no, global ops: attention" in text
