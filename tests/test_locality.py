"""Lowering reproduces the module's forward; static analysis agrees with the empirical probe."""

import pytest

torch = pytest.importorskip("torch")

from vae_support import kl_vae, structured_latent, tiny_vae  # noqa: E402

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


def test_any_module_of_placed_operators_lowers_and_others_are_refused_by_call_and_path():
    # what a module computes decides, not its class: a Sequential of a convolution lowers, exactly
    m = torch.nn.Sequential(torch.nn.Conv2d(3, 3, 3, padding=1), torch.nn.SiLU()).eval()
    x = torch.randn(1, 3, 9, 7)
    with torch.no_grad():
        assert torch.equal(lower(m, x).run(x), m(x))
    # a call that reads the whole image (global pooling) is refused, naming it, its module and the probe
    pooled = torch.nn.Sequential(torch.nn.Conv2d(3, 3, 3, padding=1), torch.nn.AdaptiveAvgPool2d(1))
    said = "Sequential.*the call 'adaptive_avg_pool2d' at '1'.*probe_receptive_field"
    with pytest.raises(LoweringError, match=said):
        lower(pooled, x)


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


def _staged_run(program, x, tile_box):
    """run_boxes of the whole program as one segment on one box, its input staged on the host."""
    from tilewise.locality.ops import RunContext
    from tilewise.locality.program import back_propagate, last_use
    from tilewise.vae.run.bands import run_boxes
    from tilewise.vae.run.staging import Staging

    seg = split_segments(program, lambda op: False)[0]
    shapes = program.shapes(tuple(x.shape[-2:]))
    need = back_propagate(seg.ops, {program.output: tile_box}, shapes)
    stage = Staging("host", "cpu")
    stage.put(program.input, x)
    stats = {id(op): (torch.zeros(x.shape[0], op.groups, dtype=torch.float64),
                      torch.ones(x.shape[0], op.groups, dtype=torch.float64))
             for op in program.ops if op.kind == "group_norm"}
    vals = run_boxes(seg, stage, RunContext(stats=stats), need, shapes,
                     last_use(seg.ops, [program.output]), keep=[program.output])
    return vals[program.output]


def test_working_memory_reuse_keeps_values_and_inputs():
    """In-place activations / GroupNorm, the unmaterialised upsampling and the 1x1 projection on the whole
    input give the values of plain op-by-op evaluation, and never write into the program input or a
    staged value, also through an identity activation that aliases its input."""
    import torch.nn.functional as F

    from tilewise.locality.boxes import sub_tensor
    from tilewise.locality.ops import Add, Conv, GroupNorm, Pointwise, Resample, RunContext
    from tilewise.locality.program import Program

    g = torch.Generator().manual_seed(5)

    def w(co, ci, k):
        return torch.randn(co, ci, k, k, generator=g) * 0.2

    silu_ = lambda t: F.silu(t, inplace=True)  # noqa: E731
    ops = [
        Pointwise(("x",), "a", "identity", fn=lambda t: t, label="identity"),
        Pointwise(("a",), "b", "act", fn=F.silu, fn_=silu_),
        Conv(("x",), "s", "shortcut", weight=w(6, 4, 1), bias=torch.randn(6, generator=g)),
        GroupNorm(("b",), "n", "norm", groups=2, eps=1e-6, weight=torch.rand(4, generator=g) + 0.5,
                  bias=torch.randn(4, generator=g)),
        Pointwise(("n",), "m", "act2", fn=F.silu, fn_=silu_),
        Resample(("m",), "u", "up", scale=2),
        Conv(("u",), "c", "conv", weight=w(6, 4, 3), bias=None, padding=(1, 1, 1, 1)),
        Resample(("s",), "su", "up2", scale=2),
        Add(("su", "c"), "y", "add"),
    ]
    program = Program(ops=ops, input="x", output="y", in_channels=4)
    x = torch.randn(2, 4, 9, 7, generator=g)
    keep = x.clone()

    def plain(x):  # every op on the whole image, out of place, each value materialised
        vals, shapes = {"x": x}, program.shapes((9, 7))
        ctx = RunContext(stats={id(ops[3]): (torch.zeros(2, 2, dtype=torch.float64),
                                              torch.ones(2, 2, dtype=torch.float64))})
        for op in ops:
            full = (0, shapes[op.dst][0], 0, shapes[op.dst][1])
            have = [(0, shapes[s][0], 0, shapes[s][1]) for s in op.src]
            vals[op.dst] = op.run(ctx, [vals[s] for s in op.src], have, full, [shapes[s] for s in op.src])
        return vals["y"]

    ref = plain(x.clone())
    with torch.no_grad():
        ctx = RunContext(stats={id(ops[3]): (torch.zeros(2, 2, dtype=torch.float64),
                                              torch.ones(2, 2, dtype=torch.float64))})
        assert torch.equal(program.run(x, ctx), ref)
        assert torch.equal(x, keep)  # the program input is read, never overwritten
        box = (3, 15, 2, 11)
        t, have = _staged_run(program, x, box)
        # (a convolution over another box may sum in another order: equal to float rounding)
        assert (sub_tensor(t, have, box) - ref[..., 3:15, 2:11]).abs().max() <= 1e-6
        assert torch.equal(x, keep)  # nor the staged value


def test_upsampled_crop_equals_materialised():
    from tilewise.locality.boxes import Upsampled

    x = torch.randn(1, 3, 5, 6)
    full = torch.nn.functional.interpolate(x[..., 1:5, 2:6], scale_factor=2.0, mode="nearest")
    u = Upsampled(x[..., 1:5, 2:6], (1, 5, 2, 6), 2)
    for want in [(2, 10, 4, 12), (3, 7, 5, 11), (9, 10, 11, 12)]:
        y0, y1, x0, x1 = want
        assert torch.equal(u.crop(want, want), full[..., y0 - 2 : y1 - 2, x0 - 4 : x1 - 4])


def test_box_index_meets_what_brute_force_meets():
    import random

    from tilewise.locality.boxes import BoxIndex

    rng = random.Random(0)
    # a grid's cores mapped down (some empty, some repeated), and boxes of any size
    boxes = [(y * 7 // 3, (y + 1) * 7 // 3, x * 5 // 4, (x + 1) * 5 // 4)
             for y in range(9) for x in range(11)]
    boxes += [(a, a + rng.randint(-2, 9), b, b + rng.randint(-2, 9)) for a, b in
              ((rng.randint(0, 20), rng.randint(0, 14)) for _ in range(60))]
    boxes += boxes[:5]
    index = BoxIndex(boxes)
    for _ in range(300):
        y0, x0 = rng.randint(-3, 22), rng.randint(-3, 16)
        box = (y0, y0 + rng.randint(1, 12), x0, x0 + rng.randint(1, 12))
        want = [(max(b[0], box[0]), min(b[1], box[1]), max(b[2], box[2]), min(b[3], box[3])) for b in boxes]
        want = sorted(c for c in want if c[0] < c[1] and c[2] < c[3])
        assert sorted(index.meeting(box)) == want
