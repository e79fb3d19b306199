"""Gradients through TiledDenoiser (issue #30): a tiny float64 UNet, several tiles, odd latent sizes.

Oracles: a straightforward tiled reference (crop each piece, call the UNet, fuse out of place with the
same windows), held whole by autograd; central finite differences along random directions (float64);
the stock UNet where one tile covers the latent. Both backward modes; `torch.autograd.grad` and
`loss.backward()`; the peak of live bytes during backward, recompute against keep (measured).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from diffusers import UNet2DConditionModel

from tilewise.blending import weight_window
from tilewise.diffusion import TiledDenoiser
from tilewise.memory import measure_live_peak

D = 8
H, W = 13, 19  # odd: edge tiles overlap more, the one-tile case runs the UNet on an odd latent
T = torch.tensor([437.0])
METHODS = {"multidiffusion": {}, "mixture": {}, "spot": {}, "halo": dict(halo=2)}


def tiny_unet(seed: int = 0) -> UNet2DConditionModel:
    torch.manual_seed(seed)
    return UNet2DConditionModel(
        block_out_channels=(8, 16), layers_per_block=1, sample_size=8, in_channels=4, out_channels=4,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        cross_attention_dim=D, norm_num_groups=4, attention_head_dim=4).eval().double()


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread: these tiny models are call-bound, and two threads on a shared 2-core machine
    spin against other processes (10x slower here)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def unet():
    return tiny_unet()


def inputs(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 4, H, W, generator=g, dtype=torch.float64)
    emb = torch.randn(2, 3, D, generator=g, dtype=torch.float64)
    probe = torch.randn(2, 4, H, W, generator=g, dtype=torch.float64)  # loss = <prediction, probe>
    return x, emb, probe


def tiled(unet, method: str, backward: str = "recompute", tile: int = 8) -> TiledDenoiser:
    return TiledDenoiser(unet, tile_size=tile, overlap=4, method=method, backward=backward, **METHODS[method])


def reference(td: TiledDenoiser, unet, x, emb):
    """MultiDiffusion eq. 5 written out: every piece read, predicted, cropped, weighted and summed into
    whole-latent buffers out of place (zero padding), divided once."""
    value, weight = torch.zeros_like(x), x.new_zeros(x.shape[-2:])
    for p in td.plan(H, W, T):
        y0, y1, x0, x1 = p.read
        pred = unet(x[..., y0:y1, x0:x1], T, encoder_hidden_states=emb).sample[(..., *p.crop)]
        o = p.out
        kind = "gaussian" if td.method == "mixture" else "uniform"
        w = weight_window(kind, (o[1] - o[0], o[3] - o[2]), var=td.var, dtype=x.dtype)
        pad = (o[2], W - o[3], o[0], H - o[1])
        value = value + F.pad(pred * w, pad)
        weight = weight + F.pad(w, pad)
    assert bool((weight > 0).all())
    return value / weight


def grads(fn, x, params):
    """The prediction and the gradients of <prediction, probe> with respect to x and params."""
    _, emb, probe = inputs()
    x = x.detach().requires_grad_()
    out = fn(x, emb)
    g = torch.autograd.grad((out * probe).sum(), [x, *params])
    return out.detach(), g


def params_of(unet):
    """A few parameters across the UNet: input conv, a cross-attention projection, the output conv."""
    names = ("conv_in.weight", "down_blocks.1.attentions.0.transformer_blocks.0.attn2.to_k.weight",
             "up_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q.weight", "conv_out.bias")
    named = dict(unet.named_parameters())
    return [named[n] for n in names]


def close(a, b, tol: float = 1e-10) -> float:
    err = (a - b).abs().max().item()
    assert err <= tol * max(1.0, b.abs().max().item()), f"max abs error {err:.2e}"
    return err


@pytest.mark.parametrize("method", list(METHODS))
@pytest.mark.parametrize("backward", ["recompute", "keep"])
def test_gradients_equal_the_tiled_computation_held_whole(unet, method, backward):
    td = tiled(unet, method, backward)
    assert td.count(H, W) >= 6  # several tiles, overlapping (multidiffusion, mixture) or not
    params = params_of(unet)
    x = inputs()[0]
    ref, ref_g = grads(lambda x, e: reference(td, unet, x, e), x, params)
    out, out_g = grads(lambda x, e: td(x, T, encoder_hidden_states=e).sample, x, params)
    close(out, ref)
    for a, b in zip(out_g, ref_g, strict=True):
        assert b.abs().max() > 0  # a real gradient
        close(a, b)


@pytest.mark.parametrize("method", ["multidiffusion", "mixture"])
def test_gradients_agree_with_finite_differences(unet, method):
    """<grad, v> against (f(x + eps v) - f(x - eps v)) / (2 eps), for the latent and for the parameters:
    a float64 UNet's tiled prediction is float64 throughout (a float32 accumulator made this 1-15% off)."""
    td = tiled(unet, method)
    params = params_of(unet)
    x, emb, probe = inputs()
    _, (gx, *gp) = grads(lambda x, e: td(x, T, encoder_hidden_states=e).sample, x, params)
    g = torch.Generator().manual_seed(3)
    v = torch.randn(x.shape, generator=g, dtype=x.dtype)
    vp = [torch.randn(p.shape, generator=g, dtype=p.dtype) for p in params]
    eps = 1e-5

    def loss(x):
        with torch.no_grad():
            return (td(x, T, encoder_hidden_states=emb).sample * probe).sum().item()

    fd_x = (loss(x + eps * v) - loss(x - eps * v)) / (2 * eps)
    assert abs((gx * v).sum().item() - fd_x) <= 1e-6 * abs(fd_x)

    def shifted(sign: float) -> float:
        with torch.no_grad():
            for p, d in zip(params, vp, strict=True):
                p.add_(sign * eps * d)
        try:
            return loss(x)
        finally:
            with torch.no_grad():
                for p, d in zip(params, vp, strict=True):
                    p.sub_(sign * eps * d)

    fd_p = (shifted(1.0) - shifted(-1.0)) / (2 * eps)
    dot = sum((a * d).sum().item() for a, d in zip(gp, vp, strict=True))
    assert abs(dot - fd_p) <= 1e-6 * abs(fd_p)


@pytest.mark.parametrize("backward", ["recompute", "keep"])
def test_one_tile_gradient_equals_the_unets(unet, backward):
    td = TiledDenoiser(unet, tile_size=20, overlap=4, backward=backward)  # 20 > both sides: one tile
    assert td.count(H, W) == 1
    params = params_of(unet)
    x = inputs()[0]
    ref, ref_g = grads(lambda x, e: unet(x, T, encoder_hidden_states=e).sample, x, params)
    out, out_g = grads(lambda x, e: td(x, T, encoder_hidden_states=e).sample, x, params)
    close(out, ref, 0)
    for a, b in zip(out_g, ref_g, strict=True):
        close(a, b, 1e-12)


def test_loss_backward_fills_what_autograd_grad_returns(unet):
    td = tiled(unet, "mixture")
    params = params_of(unet)
    x, emb, probe = inputs()
    _, want = grads(lambda x, e: td(x, T, encoder_hidden_states=e).sample, x, params)
    x = x.clone().requires_grad_()
    unet.zero_grad(set_to_none=True)
    (td(x, T, encoder_hidden_states=emb).sample * probe).sum().backward()
    for got, w in zip([x.grad, *(p.grad for p in params)], want, strict=True):
        close(got, w, 1e-12)
    unet.zero_grad(set_to_none=True)


def test_gradient_to_the_conditioning(unet):
    """Gradients reach the prompt embeddings (repeated per tile and per row) as in the reference."""
    td = tiled(unet, "multidiffusion")
    x, emb, probe = inputs()
    e1, e2 = emb.clone().requires_grad_(), emb.clone().requires_grad_()
    (g1,) = torch.autograd.grad((td(x, T, encoder_hidden_states=e1).sample * probe).sum(), e1)
    (g2,) = torch.autograd.grad((reference(td, unet, x, e2) * probe).sum(), e2)
    close(g1, g2)


def test_regions_and_batches_recompute_what_keep_keeps(unet):
    """Several model calls per chunk (a region's conditional rows beside the prompt's, tiles batched): each
    recomputation during backward is its own call's, so recompute's gradients are keep's."""
    from tilewise.diffusion import Region

    x, emb, probe = inputs()
    region = Region(box=(40, 16, 120, 88), prompt_embeds=inputs(5)[1][:1], feather=8)
    params = params_of(unet)
    got = {}
    for backward in ("keep", "recompute"):
        td = TiledDenoiser(unet, 8, 4, method="mixture", batch_size=3, regions=[region], cfg=True,
                           backward=backward)
        got[backward] = grads(lambda x, e, td=td: td(x, T, encoder_hidden_states=e).sample, x, params)
    close(got["recompute"][0], got["keep"][0], 0)
    for a, b in zip(got["recompute"][1], got["keep"][1], strict=True):
        assert b.abs().max() > 0
        close(a, b, 1e-12)


def test_no_graph_without_gradients(unet):
    td = tiled(unet, "mixture")
    x, emb, _ = inputs()
    with torch.no_grad():
        assert not td(x, T, encoder_hidden_states=emb).sample.requires_grad
    frozen = tiny_unet().requires_grad_(False)
    assert not TiledDenoiser(frozen, 8, 4)(x, T, encoder_hidden_states=emb).sample.requires_grad


def _forward_calls(td, unet, x, emb, probe) -> tuple[int, int]:
    """(UNet calls in forward, UNet calls in backward) of one differentiable call (a pre-hook: a
    recomputation stops once it has what backward needs, before the call's end)."""
    calls = []
    handle = unet.register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        out = td(x.requires_grad_(), T, encoder_hidden_states=emb).sample
        n_forward = len(calls)
        torch.autograd.grad((out * probe).sum(), x)
    finally:
        handle.remove()
    return n_forward, len(calls) - n_forward


def test_recompute_runs_each_tile_again_in_backward_and_keep_does_not(unet):
    x, emb, probe = inputs()
    n = tiled(unet, "mixture").count(H, W)
    assert _forward_calls(tiled(unet, "mixture", "keep"), unet, x.clone(), emb, probe) == (n, 0)
    assert _forward_calls(tiled(unet, "mixture", "recompute"), unet, x.clone(), emb, probe) == (n, n)


def test_recompute_holds_fewer_live_bytes_than_keep():
    """Peak live bytes of forward + backward (measured): recompute holds one tile's activations at a
    time, keep every tile's; printed for the record."""
    unet = tiny_unet().float()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 4, 24, 24, generator=g)
    emb, probe = torch.randn(1, 3, D, generator=g), torch.randn(1, 4, 24, 24, generator=g)

    def step(backward: str):
        td = TiledDenoiser(unet, tile_size=8, overlap=4, method="mixture", backward=backward)
        xg = x.clone().requires_grad_()
        out = td(xg, T, encoder_hidden_states=emb).sample
        return torch.autograd.grad((out * probe).sum(), [xg, *unet.parameters()])

    keep_g, keep = measure_live_peak(step, "keep")
    rec_g, rec = measure_live_peak(step, "recompute")
    print(f"live peak: keep {keep / 2**20:.1f} MiB, recompute {rec / 2**20:.1f} MiB")
    for a, b in zip(rec_g, keep_g, strict=True):
        assert (a - b).abs().max() <= 1e-5 * max(1.0, b.abs().max().item())
    assert rec < keep / 3  # 25 tiles: keep holds them all


def test_backward_mode_is_checked(unet):
    with pytest.raises(ValueError, match=r"backward must be one of \('recompute', 'keep'\).*got 'store'"):
        TiledDenoiser(unet, 8, 4, backward="store")


@pytest.mark.skipif(not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
                    reason="torch.distributed with gloo is needed")
def test_process_group_with_gradients_is_refused_before_any_tile(unet, tmp_path):
    import torch.distributed as dist

    x, emb, _ = inputs()
    td = TiledDenoiser(unet, 8, 4, process_group="default")
    with pytest.raises(ValueError, match="needs torch.distributed initialised"):
        td(x.clone().requires_grad_(), T, encoder_hidden_states=emb)  # the group's own check first
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    calls = []
    handle = unet.register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        with pytest.raises(ValueError, match=r"process_group=\.\.\.\) with gradients"):
            td(x.clone().requires_grad_(), T, encoder_hidden_states=emb)
        assert not calls  # refused before any tile ran
        with torch.no_grad():  # without gradients: one rank equals one process
            out = td(x, T, encoder_hidden_states=emb).sample
        single = tiled(unet, "multidiffusion")(x, T, encoder_hidden_states=emb).sample
        assert torch.equal(out, single.detach())
    finally:
        handle.remove()
        dist.destroy_process_group()
