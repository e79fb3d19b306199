"""Gradients through a 3-D causal VAE's TiledVAE.decode / .encode (issue #30): the causal steps recomputed
last to first against autograd through the untiled VAE (fp32, max abs error <= 1e-4 of each gradient's
scale), on several tiles, odd sizes and several frames."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")

from video_vae_support import factor, video_vae  # noqa: E402

import tilewise as tw  # noqa: E402

TOL = 1e-4


def _input(vae, kind: str, frames: int):
    """A latent (decode: 5x7 latent px) or a video (encode: 3x5 latent px) of `frames` frames."""
    g = torch.Generator().manual_seed(0)
    if kind == "decode":
        return torch.randn(1, 4, frames, 5, 7, generator=g)
    f = factor(vae)
    return torch.rand(1, 3, frames, 3 * f, 5 * f, generator=g) * 2 - 1


def _call(m, kind: str, t):
    return m.decode(t).sample if kind == "decode" else m.encode(t).latent_dist.parameters


def _grads(m, vae, kind: str, t):
    """(output, gradient of the input, {parameter name: gradient}) of sum(call * a fixed random weight)."""
    x = t.clone().requires_grad_(True)
    y = _call(m, kind, x)
    w = torch.randn(y.shape, generator=torch.Generator().manual_seed(5))
    names, params = zip(*vae.named_parameters(), strict=True)
    gs = torch.autograd.grad((y * w).sum(), [x, *params], allow_unused=True)
    return y.detach(), gs[0], dict(zip(names, gs[1:], strict=True))


def _close(a, b) -> bool:
    return (a - b).abs().max().item() <= TOL * max(b.abs().max().item(), 1e-12)


@pytest.mark.parametrize("name,kind,frames,staging", [
    ("wan2.1", "decode", 3, "device"), ("wan2.1", "decode", 2, "host"), ("wan2.1", "encode", 5, "device"),
    ("ltx0.9.0", "decode", 3, "device"), ("ltx0.9.0", "encode", 5, "device"), ("qwen", "decode", 2, "device"),
])
def test_gradients_equal_the_untiled_vae(name, kind, frames, staging):
    vae = copy.deepcopy(video_vae(name))
    tv = tw.TiledVAE(vae, tile_size=3 if kind == "decode" else 2, staging=staging, progress=False)
    t = _input(vae, kind, frames)
    assert tv.plan(tuple(t.shape), kind=kind).grid[0] * tv.plan(tuple(t.shape), kind=kind).grid[1] >= 4
    ref, rx, rp = _grads(vae, vae, kind, t)
    out, tx, tp = _grads(tv, vae, kind, t)
    assert _close(out, ref) and _close(tx, rx)
    assert rp.keys() == tp.keys()
    for n, g in rp.items():
        assert (g is None) == (tp[n] is None), n
        assert g is None or _close(tp[n], g), n


def test_a_training_vae_gets_parameter_gradients_without_an_input_gradient():
    """vae.train() with an input that does not require grad: the parameters' gradients, accumulated by
    backward() into .grad, are the untiled VAE's."""
    vae = copy.deepcopy(video_vae("wan2.1")).train()
    tv = tw.TiledVAE(vae, tile_size=3, progress=False)
    z = _input(vae, "decode", 2)
    vae.decode(z).sample.square().mean().backward()
    ref = {n: None if p.grad is None else p.grad.clone() for n, p in vae.named_parameters()}
    vae.zero_grad(set_to_none=True)
    tv.decode(z).sample.square().mean().backward()
    assert any(g is not None for g in ref.values())
    for n, p in vae.named_parameters():
        assert (p.grad is None) == (ref[n] is None), n
        assert p.grad is None or _close(p.grad, ref[n]), n


def test_a_second_backward_through_one_call_is_refused():
    vae = copy.deepcopy(video_vae("wan2.1"))
    tv = tw.TiledVAE(vae, tile_size=3, progress=False)
    z = _input(vae, "decode", 2).requires_grad_(True)
    y = tv.decode(z).sample.sum()
    y.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second backward"):
        y.backward()



@pytest.mark.parametrize("temb_grad", [False, True], ids=["z", "z-and-temb"])
@pytest.mark.parametrize("name", ["ltx0.9.5-t", "ltx2-t"])
def test_timestep_conditioned_decode_gradients_equal_the_untiled_vae(name, temb_grad):
    """decode(z, temb) of LTX-Video 0.9.5+ / LTX-2: the per-call timestep embedding (computed once per
    call, with autograd) is a leaf of each recomputed step, its gradient backed through the embedders:
    z's, temb's (where it requires grad) and every parameter's gradient (the embedders' and the norms'
    scale-shift tables included) are the untiled VAE's; two samples, two timesteps, 2x3 tiles."""
    vae = copy.deepcopy(video_vae(name))
    tv = tw.TiledVAE(vae, tile_size=3, progress=False)
    z0 = torch.randn(2, 4, 3, 5, 7, generator=torch.Generator().manual_seed(0))
    assert tv.plan(tuple(z0.shape)).grid == (2, 3)
    names, params = zip(*vae.named_parameters(), strict=True)
    got = []
    for m in (vae, tv):
        z, temb = z0.clone().requires_grad_(True), torch.tensor([0.05, 0.6]).requires_grad_(temb_grad)
        y = m.decode(z, temb).sample
        w = torch.randn(y.shape, generator=torch.Generator().manual_seed(5))
        wrt = [z, temb, *params] if temb_grad else [z, *params]
        got.append((y.detach(), torch.autograd.grad((y * w).sum(), wrt, allow_unused=True)))
    (ref, rg), (out, tg) = got
    assert _close(out, ref)
    table = [i for i, n in enumerate(names) if "scale_shift_table" in n or "time_embedder" in n]
    assert table and all(rg[len(rg) - len(names) + i] is not None for i in table)
    for n, a, b in zip(["z", "temb"][: 1 + temb_grad] + list(names), tg, rg, strict=True):
        assert (a is None) == (b is None), n
        assert b is None or _close(a, b), n


def test_a_timestep_that_requires_grad_alone_builds_the_graph():
    """An eval-mode VAE, z without requires_grad, temb with it: the call builds a graph (temb asks for
    one, as in the stock decode) and temb's gradient is the untiled VAE's."""
    vae = copy.deepcopy(video_vae("ltx2-t"))
    tv = tw.TiledVAE(vae, tile_size=3, progress=False)
    z = torch.randn(1, 4, 2, 5, 7, generator=torch.Generator().manual_seed(0))
    got = []
    for m in (vae, tv):
        temb = torch.tensor([0.3], requires_grad=True)
        got.append(torch.autograd.grad(m.decode(z, temb).sample.square().mean(), [temb])[0])
    assert _close(got[1], got[0]) and float(got[0].abs().max()) > 0
