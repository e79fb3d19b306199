"""Gradients through TiledVAE.decode / .encode (issue #30): the reverse tile program against autograd
through the untiled VAE (fp32, max abs error <= 1e-4 of each gradient's scale), its memory against the
untiled backward's, and what stays refused."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from vae_support import family_vae, kl_vae, structured_latent, tiny_vae

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from counting import Counter  # noqa: E402

import tilewise as tw  # noqa: E402
from tilewise.locality.ops import RunContext  # noqa: E402
from tilewise.vae.fast.run import crop_stats  # noqa: E402
from tilewise.vae.settings import Place  # noqa: E402

TOL = 1e-4


def _decode(m, z):
    return m.decode(z).sample


def _encode(m, x):
    out = m.encode(x)
    if hasattr(out, "latent_dist"):
        return out.latent_dist.parameters
    return out.latent if hasattr(out, "latent") else out.latents


def _grads(fn, module, vae, t, g):
    """(output, gradients of the input and of every parameter of vae) of sum(fn(module, t) * g)."""
    params = list(vae.parameters())
    y = fn(module, t)
    return y, torch.autograd.grad(y, [t, *params], g(y), allow_unused=True)


def _assert_close(got, want, names) -> float:
    """Every gradient within TOL of its scale (its max abs, floored at 1e-3 of the largest parameter
    gradient's: a key projection's bias has a zero gradient in exact arithmetic, softmax being shift
    invariant, and float noise there has no scale of its own); the worst relative error."""
    floor = 1e-3 * max(float(w.abs().max()) for w in want[1:] if w is not None)
    worst = 0.0
    for name, a, b in zip(names, got, want, strict=True):
        if b is None:
            assert a is None or float(a.abs().max()) == 0, f"{name}: a gradient where the VAE has none"
            continue
        assert a is not None, f"{name}: no gradient, the untiled VAE has one"
        err = float((a - b).abs().max()) / max(float(b.abs().max()), floor)
        assert err <= TOL, f"{name}: gradient error {err:.2e} of its scale"
        worst = max(worst, err)
    return worst


def _seeded(shape, seed=3):
    return lambda y: torch.randn(y.shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("staging", ["device", "host", "disk"])
def test_decode_gradients_equal_untiled(staging):
    """SD-architecture decoder (GroupNorms, mid-block global attention), 3x3 tiles of an odd latent."""
    vae = kl_vae("sd")
    tv = tw.TiledVAE(vae, tile_size=4, staging=staging, progress=False)
    z = structured_latent(1, 4, 9, 11).requires_grad_(True)
    y, got = _grads(_decode, tv, vae, z, _seeded(None))
    y0, want = _grads(_decode, vae, vae, z, _seeded(None))
    assert y.grad_fn is not None and float((y - y0).detach().abs().max()) <= TOL
    _assert_close(got, want, ["z", *(n for n, _ in vae.named_parameters())])


def test_encode_gradients_equal_untiled():
    vae = kl_vae("sd")
    tv = tw.TiledVAE(vae, tile_size=4, progress=False)
    x = torch.randn(1, 3, 72, 88, generator=torch.Generator().manual_seed(1)).requires_grad_(True)
    _, got = _grads(_encode, tv, vae, x, _seeded(None))
    _, want = _grads(_encode, vae, vae, x, _seeded(None))
    _assert_close(got, want, ["x", *(n for n, _ in vae.named_parameters())])


@pytest.mark.parametrize("fn", [_decode, _encode], ids=["decode", "encode"])
def test_tiny_autoencoder_gradients_equal_untiled(fn):
    vae = tiny_vae()
    tv = tw.TiledVAE(vae, tile_size=4, progress=False)
    t = (structured_latent(1, 4, 9, 11) if fn is _decode else
         torch.rand(1, 3, 72, 88, generator=torch.Generator().manual_seed(2))).requires_grad_(True)
    _, got = _grads(fn, tv, vae, t, _seeded(None))
    _, want = _grads(fn, vae, vae, t, _seeded(None))
    _assert_close(got, want, ["input", *(n for n, _ in vae.named_parameters())])


@pytest.mark.parametrize("fn", [_decode, _encode], ids=["decode", "encode"])
@pytest.mark.parametrize("name", ["dc", *(pytest.param(n, marks=pytest.mark.slow)  # (~10 s each: DC-AE,
                                          for n in ("asym", "flux2", "kvae", "hunyuan"))])  # with its global
def test_traced_family_gradients_equal_untiled(name, fn):  # segment, by default; the rest with -m slow)
    # (the 2-D families the trace lowers beyond AutoencoderKL, AutoencoderTiny and VQModel: the same reverse
    # tile program; DC-AE's linear attention at the latent's resolution a global segment)
    vae = family_vae(name)
    tv = tw.TiledVAE(vae, tile_size=4, progress=False)
    f = tv.factor("encode")
    g = torch.Generator().manual_seed(4)
    t = (torch.randn(1, tv.program("decode").in_channels, 7, 9, generator=g) if fn is _decode else
         torch.randn(1, 3, 7 * f, 9 * f, generator=g)).requires_grad_(True)
    _, got = _grads(fn, tv, vae, t, _seeded(None))
    _, want = _grads(fn, vae, vae, t, _seeded(None))
    _assert_close(got, want, ["input", *(n for n, _ in vae.named_parameters())])


@pytest.mark.parametrize("force_not_quantize", [False, True], ids=["quantized", "not-quantized"])
@pytest.mark.parametrize("name", ["vq", "movq64"])
def test_vq_decode_gradients_equal_untiled(name, force_not_quantize):
    """VQModel decode: the quantiser (nearest codebook entry, straight-through to z) runs untiled with
    autograd, as the stock decode's; the loss adds the commitment loss, so the codebook has a gradient
    where quantised. MoVQ (spatial norm: the decoder reads the quantised latent too) with
    force_not_quantize=True is how Kandinsky 2.2 decodes."""
    vae = family_vae(name)
    tv = tw.TiledVAE(vae, tile_size=4, progress=False)
    z = structured_latent(1, 4, 9, 11).requires_grad_(True)
    g = torch.randn(1, 3, 18, 22, generator=torch.Generator().manual_seed(3))
    params = list(vae.parameters())
    grads, outs = [], []
    for m in (tv, vae):
        out = m.decode(z, force_not_quantize=force_not_quantize)
        loss = (out.sample * g).sum() + out.commit_loss.sum()
        grads.append(torch.autograd.grad(loss, [z, *params], allow_unused=True))
        outs.append(out)
    assert tv.plan(tuple(z.shape)).grid == (3, 3)
    assert float((outs[0].sample - outs[1].sample).detach().abs().max()) <= TOL
    assert torch.allclose(outs[0].commit_loss, outs[1].commit_loss)
    names = ["z", *(n for n, _ in vae.named_parameters())]
    worst = _assert_close(grads[0], grads[1], names)
    print(f"{name} decode (force_not_quantize={force_not_quantize}): worst gradient error {worst:.2e}")
    codebook = grads[1][names.index("quantize.embedding.weight")]
    assert (codebook is not None and float(codebook.abs().max()) > 0) == (not force_not_quantize)


def test_vq_forward_gradients_equal_untiled():
    """VQModel.forward (encode, quantise, decode) through the tiled encode and decode: the image's and
    every parameter's gradient of output and commitment loss are the stock forward's."""
    vae = family_vae("vq")
    tv = tw.TiledVAE(vae, tile_size=4, progress=False)
    x = torch.rand(1, 3, 18, 22, generator=torch.Generator().manual_seed(1)) * 2 - 1
    params, grads = list(vae.parameters()), []
    for m in (tv, vae):
        xi = x.clone().requires_grad_(True)
        out = m(xi)
        loss = out.sample.square().mean() + out.commit_loss.sum()
        grads.append(torch.autograd.grad(loss, [xi, *params], allow_unused=True))
    _assert_close(grads[0], grads[1], ["x", *(n for n, _ in vae.named_parameters())])


def test_backward_accumulates_parameter_gradients_of_a_training_decoder():
    """Fine-tuning a decoder: the latent needs no gradient, the training VAE's parameters get theirs in
    .grad through loss.backward(), as the untiled VAE's do (twice: accumulated)."""
    vae = kl_vae("sd")
    vae.train()
    vae.encoder.requires_grad_(False)
    tv = tw.TiledVAE(vae, tile_size=4, progress=False)
    z = structured_latent(1, 4, 7, 9)
    target = torch.randn(1, 3, 56, 72, generator=torch.Generator().manual_seed(5))
    names = [n for n, q in vae.named_parameters() if q.requires_grad]
    grads = []
    for m in (tv, vae):
        vae.zero_grad(set_to_none=True)
        for _ in range(2):
            ((_decode(m, z) - target) ** 2).mean().backward()
        grads.append([q.grad for q in vae.parameters() if q.requires_grad])
    assert all(g is None for g in (q.grad for q in vae.encoder.parameters()))
    _assert_close([None, *grads[0]], [None, *grads[1]], ["-", *names])


def test_no_graph_when_nothing_asks_for_one():
    """An eval-mode VAE on an input without requires_grad: the plain tiled run (no graph, nothing kept),
    the same staged peak as under no_grad."""
    tv = tw.TiledVAE(kl_vae("sd"), tile_size=4, progress=False)
    z = structured_latent(1, 4, 9, 11)
    y = tv.decode(z).sample
    peak = tv.last_staged_peak
    with torch.no_grad():
        y0 = tv.decode(z).sample
    assert y.grad_fn is None and not y.requires_grad
    assert tv.last_staged_peak == peak and torch.equal(y, y0)


def test_backward_peak_is_below_the_untiled_backward_and_planned():
    """Live bytes counted over forward + backward (every storage born in the call, autograd's saved
    tensors included): the tiled run holds its staged values and one tile's graph, the untiled one every
    activation. The plan's backward peak bounds the count."""
    vae = kl_vae("sd")
    tv = tw.TiledVAE(vae, tile_size=6, progress=False)
    z = structured_latent(1, 4, 18, 18).requires_grad_(True)
    peaks = []
    for m in (tv, vae):
        counter = Counter("cpu")
        with counter, torch.enable_grad():
            y = _decode(m, z)
            (gz,) = torch.autograd.grad(y, [z], torch.ones_like(y))
            del y, gz
        peaks.append(counter.counts.device_peak("cpu"))
    plan = tv.plan(tuple(z.shape), backward=True)
    assert plan.grid == (3, 3) and plan.backward is not None
    assert peaks[0] < 0.6 * peaks[1], f"tiled {peaks[0]:,} B, untiled {peaks[1]:,} B"
    assert peaks[0] <= plan.backward.peak, f"counted {peaks[0]:,} B, planned {plan.backward.peak:,} B"
    assert "backward:" in str(plan)


def test_memory_budget_bounds_the_backward_too():
    """Within a memory budget a differentiable call's tile shrinks until the backward's planned peak
    fits as well as the forward's (disk staging takes the staged values out of it); a budget no backward
    meets is refused before anything runs."""
    vae = kl_vae("sd")
    shape, budget = (1, 4, 48, 48), 130 << 20
    tv = tw.TiledVAE(vae, tile_size=64, memory_budget=budget, progress=False)
    forward, both = tv.plan(shape), tv.plan(shape, backward=True)
    assert both.tile_size < forward.tile_size and both.peak <= budget and both.backward.peak <= budget
    tv.memory_budget = 60 << 20  # (the staged values alone are ~88 MiB: on disk, out of the peak)
    both = tv.plan(shape, backward=True)
    assert both.staging is Place.DISK and both.backward.peak <= 60 << 20 < both.backward.staged
    tv.memory_budget = 40 << 20  # (the forward fits, no backward does)
    assert tv.plan(shape).peak <= 40 << 20
    with pytest.raises(tw.errors.WontFit, match="backward"):
        tv.decode(torch.zeros(shape, requires_grad=True))


def _held_constant(program, x, stats):
    """The program untiled, op by op (no in-place op), with the GroupNorm statistics `stats` applied as
    constants: the oracle of fast mode's backward."""
    shapes = program.shapes(tuple(x.shape[-2:]))
    full = {v: (0, h, 0, w) for v, (h, w) in shapes.items()}
    vals, ctx = {program.input: x}, RunContext(stats=stats)
    for op in program.ops:
        vals[op.dst] = op.run(ctx, [vals[s] for s in op.src], [full[s] for s in op.src], full[op.dst],
                              [shapes[s] for s in op.src])
    return vals[program.output]


def test_fast_mode_crop_estimator_holds_its_statistics_constant_and_its_error_is_measured():
    """Fast mode's crop estimator differentiates with its estimated statistics held constant: its
    gradient equals the untiled program's with those statistics as constants; its error against the
    exact gradient is measured and printed (not bounded by a made-up figure)."""
    vae = kl_vae("sd")
    z = structured_latent(1, 4, 12, 12).requires_grad_(True)
    fast = tw.TiledVAE(vae, tile_size=4, mode="fast", fast_estimator="crops", progress=False)
    job = fast.job("decode")
    stats = crop_stats(job, fast.settings.fast, z.detach(), 4, None)
    g = torch.randn(1, 3, 96, 96, generator=torch.Generator().manual_seed(3))
    (gf,) = torch.autograd.grad(_decode(fast, z), [z], g)
    (gc,) = torch.autograd.grad(_held_constant(job.program, z, stats), [z], g)
    (ge,) = torch.autograd.grad(_decode(vae, z), [z], g)
    assert float((gf - gc).abs().max() / gc.abs().max()) <= TOL
    err = float((gf - ge).abs().max() / ge.abs().max())
    print(f"fast mode (crops, statistics held constant): gradient error {err:.3e} of the exact gradient's "
          "max abs")
    assert torch.isfinite(gf).all() and err > 0


def test_refused_gradients_say_why():
    vae = kl_vae("sd")
    z = structured_latent(1, 4, 12, 12).requires_grad_(True)
    tv = tw.TiledVAE(vae, tile_size=4, mode="fast", progress=False)
    with pytest.raises(RuntimeError, match="no backward.*fast_estimator='tiles'"):
        tv.decode(z)
    with torch.no_grad():  # (the forward alone still runs)
        tv.decode(z)
    y = tw.TiledVAE(vae, tile_size=4, progress=False).decode(z).sample.sum()
    y.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second backward"):
        y.backward()
