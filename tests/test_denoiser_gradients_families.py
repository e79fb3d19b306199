"""Gradients through TiledDenoiser for transformer families and through TiledControlNet (issue #30).

Each family's denoiser call is captured from its tiny stock pipeline (or built as its pipeline makes it),
cast to float64 and called with gradients: with one tile covering the latent the gradients (latent and
parameters) equal the stock model's; with several tiles recompute's equal keep's and both agree with a
central finite difference along a random direction of the latent and the parameters together.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import tiny_denoisers as tden  # noqa: E402
import tiny_pipes as tp  # noqa: E402
import tiny_transformers as tt  # noqa: E402

from tilewise.diffusion import TiledControlNet, TiledDenoiser  # noqa: E402
from tilewise.diffusion.adapters.transformer import bind_call  # noqa: E402

PX = 16  # image side: latents of 16 (SD3, Flux, Flux.2) or 8 (Qwen-Image, Z-Image) latent pixels
PIPES = {"sd3": tt.sd3, "flux": tt.flux, "flux2": tt.flux2, "qwen-image": tt.qwen, "z-image": tt.zimage,
         "pixart-sigma": tden.pixart,  # a patch embedding adding its position table (hooked)
         "wan": tden.wan}  # a video: (B, C, T, H, W), rotary table from the latent's shape (hooked)
DIRECT = {"qwen-image-2.1": tden.qwen_image21}  # a joint sequence: condition tokens kept for every tile


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def as64(v):
    """Floating tensors (in lists, tuples, dicts) as float64, detached."""
    if isinstance(v, torch.Tensor):
        return v.detach().double() if v.is_floating_point() else v
    if isinstance(v, (list, tuple)):
        return type(v)(as64(x) for x in v)
    if isinstance(v, dict):
        return {k: as64(x) for k, x in v.items()}
    return v


def captured(name: str, guidance: float | None = None):
    """(float64 model, its call's arguments by name): the first denoiser call of the stock pipeline."""
    if name in DIRECT:
        model, given = DIRECT[name]()
        return model.double(), as64(bind_call(model, (), given))
    pipe, kw = PIPES[name]()
    size = dict(height=kw.pop("height", PX), width=kw.pop("width", PX))  # pixart's own: 24 x 40 px
    if guidance is not None:
        kw["guidance_scale"] = guidance
    calls = []
    model = pipe.transformer
    handle = model.register_forward_pre_hook(
        lambda m, a, k: calls.append(bind_call(m, a, k)) if not calls else None, with_kwargs=True)
    pipe.set_progress_bar_config(disable=True)
    with torch.no_grad():
        pipe(**kw, **size, num_inference_steps=1, output_type="latent",
             generator=torch.Generator().manual_seed(0))
    handle.remove()
    return model.double(), as64(calls[0])


def prediction(out) -> torch.Tensor:
    v = out[0] if isinstance(out, (tuple, list)) else getattr(out, "sample", out)
    return torch.stack(list(v)) if isinstance(v, (list, tuple)) else v


def sample_name(model) -> str:
    return TiledDenoiser(model).adapter.sample_arg


def grads(fn, given: dict, name: str, params: list, probe=None):
    """fn's prediction and the gradients of <prediction, probe> w.r.t. the sample (a tensor or Z-Image's
    list of tensors) and `params` (zeros where unused)."""
    s = given[name]
    xs = [t.detach().clone().requires_grad_() for t in (s if isinstance(s, (list, tuple)) else [s])]
    out = prediction(fn(**{**given, name: xs if isinstance(s, (list, tuple)) else xs[0]}))
    probe = torch.randn(out.shape, generator=torch.Generator().manual_seed(9), dtype=out.dtype) \
        if probe is None else probe
    g = torch.autograd.grad((out * probe).sum(), [*xs, *params], allow_unused=True)
    g = [torch.zeros_like(t) if d is None else d for d, t in zip(g, [*xs, *params], strict=True)]
    return out.detach(), g, probe


def close(a, b, tol: float) -> None:
    err = (a - b).abs().max().item()
    assert err <= tol * max(1.0, b.abs().max().item()), f"max abs error {err:.2e}"


def latent_sides(model, given, name) -> tuple[int, int]:
    td = TiledDenoiser(model, tile_size=256)
    call = td.adapter.parse(model, (), dict(given))
    return tuple(call.sample.shape[-2:])


@pytest.mark.parametrize("name", [*PIPES, *DIRECT])
def test_one_tile_gradient_equals_the_stock_models(name):
    model, given = captured(name)
    name_x = sample_name(model)
    params = list(model.parameters())
    want, want_g, probe = grads(model, given, name_x, params)
    td = TiledDenoiser(model, tile_size=256, overlap=4)
    got, got_g, _ = grads(td, given, name_x, params, probe)
    close(got, want, 1e-12)
    assert want_g[0].abs().max() > 0 and sum(float(g.abs().sum()) for g in want_g[1:]) > 0
    for a, b in zip(got_g, want_g, strict=True):
        close(a, b, 1e-10)


def smooth_params(model) -> list:
    """The attention query projections: parameters the prediction is smooth in (unlike a padding token
    or a parameter that a float32 upcast inside a norm rounds), for a finite-difference check."""
    return [p for n, p in model.named_parameters() if n.endswith("to_q.weight")]


def several_tiles(model, given, name_x) -> dict:
    """TiledDenoiser options giving about 3 x 3 tiles (mixture) on this call's latent."""
    H, W = latent_sides(model, given, name_x)
    step = 2 * TiledDenoiser(model).align
    tile = tuple(max(step, n // 2 // step * step) for n in (H, W))
    return dict(tile_size=tile, overlap=(tile[0] // 2, tile[1] // 2), method="mixture")


def directional(fn, given: dict, name_x: str, params: list, probe, v: list, vp: list, eps: float) -> float:
    """d/dh <fn(x + h v, p + h vp), probe> at h = 0, by the five-point central stencil (error O(eps^4))."""
    s = given[name_x]
    xs = list(s) if isinstance(s, (list, tuple)) else [s]

    def loss(h: float) -> float:
        moved = [t + h * d for t, d in zip(xs, v, strict=True)]
        with torch.no_grad():
            for p, d in zip(params, vp, strict=True):
                p.add_(h * d)
            try:
                x = type(s)(moved) if isinstance(s, (list, tuple)) else moved[0]
                return float((prediction(fn(**{**given, name_x: x})) * probe).sum())
            finally:
                for p, d in zip(params, vp, strict=True):
                    p.sub_(h * d)

    return (8 * (loss(eps) - loss(-eps)) - (loss(2 * eps) - loss(-2 * eps))) / (12 * eps)


FRAMES = dict(tile_frames=2, frame_overlap=1)  # Wan's 3 latent frames in two overlapping windows


@pytest.mark.parametrize("name, extra", [*((n, {}) for n in [*PIPES, *DIRECT]), ("wan", FRAMES)],
                         ids=[*PIPES, *DIRECT, "wan-frame-windows"])
def test_several_tiles_recompute_equals_keep_and_finite_differences(name, extra):
    model, given = captured(name)
    name_x, params = sample_name(model), list(model.parameters())
    opts = {**several_tiles(model, given, name_x), **extra}
    keep, recompute = (TiledDenoiser(model, backward=b, **opts) for b in ("keep", "recompute"))
    H, W = latent_sides(model, given, name_x)
    frames = given[name_x].shape[2] if extra else None
    assert keep.count(H, W, frames) >= 4 * (1 + bool(extra)), f"{name}: {keep.count(H, W, frames)} tiles"
    out_k, g_k, probe = grads(keep, given, name_x, params)
    out_r, g_r, _ = grads(recompute, given, name_x, params, probe)
    close(out_r, out_k, 0)
    for a, b in zip(g_r, g_k, strict=True):
        close(a, b, 1e-12)
    # the latent's and the query projections' gradients along a random direction of both, against
    # finite differences: as close as the stock model's own gradient is (several of these models round
    # inside to float32, e.g. a norm's variance, so their finite differences are good to ~1e-5 only)
    smooth = smooth_params(model)
    assert smooth, f"{name}: no attention query projection"
    gen = torch.Generator().manual_seed(4)
    n_x = len(g_r) - len(params)
    v = [torch.randn(g.shape, generator=gen, dtype=g.dtype) for g in g_r[:n_x]]
    vp = [torch.randn(p.shape, generator=gen, dtype=p.dtype) for p in smooth]
    ids = {id(p) for p in smooth}

    def error(fn, g) -> float:
        g_smooth = [a for a, p in zip(g[n_x:], params, strict=True) if id(p) in ids]
        dot = sum(float((a * b).sum()) for a, b in zip([*g[:n_x], *g_smooth], [*v, *vp], strict=True))
        fd = directional(fn, given, name_x, smooth, probe, v, vp, 1e-3)
        return abs(dot - fd) / abs(fd)

    stock = error(model, grads(model, given, name_x, params, probe)[1])
    tiled = error(recompute, g_r)
    assert tiled <= max(1e-6, 10 * stock), (name, tiled, stock)


def test_zimage_cfg_gradients_reach_each_rows_own_latent():
    """Z-Image's [conditional, unconditional] batch is swapped into the fusion core's order: each row's
    gradient is its own latent's (the swap once sent it to the other half's equal latent)."""
    model, given = captured("z-image", guidance=4.0)
    assert len(given["x"]) == 2 and torch.equal(given["x"][0], given["x"][1])  # a CFG batch
    params = list(model.parameters())[:3]
    want, want_g, probe = grads(model, given, "x", params)
    got, got_g, _ = grads(TiledDenoiser(model, tile_size=256), given, "x", params, probe)
    close(got, want, 1e-12)
    assert (want_g[0] - want_g[1]).abs().max() > 1e-3  # the rows' gradients differ
    for a, b in zip(got_g, want_g, strict=True):
        close(a, b, 1e-10)


# ---- TiledControlNet: the ControlNet run per tile, gradients to it and to its control image -------------
def controlnet_call(tiled: bool, opts: dict | None = None):
    """f(sample, controlnet_cond) -> the UNet's prediction with the ControlNet's residuals (float64)."""
    unet, cn = tp._unet().double(), tp._controlnet().double()
    g = torch.Generator().manual_seed(5)
    emb = torch.randn(1, 5, tp.D, generator=g, dtype=torch.float64)
    t = torch.tensor([321.0])
    den = TiledDenoiser(unet, **opts) if tiled else unet
    net = TiledControlNet(cn) if tiled else cn

    def call(sample, controlnet_cond):
        down, mid = net(sample, t, encoder_hidden_states=emb, controlnet_cond=controlnet_cond,
                        return_dict=False)
        return den(sample, t, encoder_hidden_states=emb, down_block_additional_residuals=down,
                   mid_block_additional_residual=mid)

    return call, [*cn.parameters()][::7], unet


def controlnet_grads(call, params, x, image, probe):
    x, image = x.clone().requires_grad_(), image.clone().requires_grad_()
    out = prediction(call(x, image))
    return out.detach(), torch.autograd.grad((out * probe).sum(), [x, image, *params])


def test_tiled_controlnet_gradients():
    g = torch.Generator().manual_seed(6)
    x = torch.randn(1, 4, 12, 10, generator=g, dtype=torch.float64)
    image = torch.rand(1, 3, 96, 80, generator=g, dtype=torch.float64)
    probe = torch.randn(1, 4, 12, 10, generator=g, dtype=torch.float64)
    stock, p0, _ = controlnet_call(False)
    want, want_g = controlnet_grads(stock, p0, x, image, probe)
    one, p1, _ = controlnet_call(True, dict(tile_size=16, overlap=4))
    got, got_g = controlnet_grads(one, p1, x, image, probe)
    close(got, want, 1e-12)
    for a, b in zip(got_g, want_g, strict=True):
        assert b.abs().max() > 0
        close(a, b, 1e-10)
    several = {}
    for backward in ("keep", "recompute"):
        call, params, unet = controlnet_call(True, dict(tile_size=8, overlap=4, method="mixture",
                                                        backward=backward))
        several[backward] = controlnet_grads(call, params, x, image, probe)
    assert TiledDenoiser(unet, 8, 4).count(12, 10) == 4
    for a, b in zip(several["recompute"][1], several["keep"][1], strict=True):
        close(a, b, 1e-12)
    # the control image's gradient against finite differences along a random direction
    v = torch.randn(image.shape, generator=g, dtype=image.dtype)
    fd = directional(call, dict(sample=x, controlnet_cond=image), "controlnet_cond", [], probe, [v], [], 1e-3)
    dot = float((several["recompute"][1][1] * v).sum())
    assert abs(dot - fd) <= 1e-7 * abs(fd)


# ---- transformer ControlNets (SD3, Flux): captured from their stock pipelines ----------------------------
RESIDUALS = {"sd3": ("block_controlnet_hidden_states",),
             "flux": ("controlnet_block_samples", "controlnet_single_block_samples")}


def control_pair(name: str):
    """(f(hidden_states, controlnet_cond, tiled, **options) -> prediction, the call's sample and control
    image, the ControlNet's parameters): the first ControlNet and transformer calls of the stock pipeline,
    float64, the ControlNet's residuals passed to the transformer as the pipeline passes them."""
    import tiny_controlnets as tcn

    build, kw, slot, _ = tcn.CASES[name]
    pipe = build()
    cn, tr, calls = pipe.controlnet, getattr(pipe, slot), {}

    def hook(key):
        def record(m, a, k):
            calls.setdefault(key, bind_call(m, a, k))  # the first call; returns None: inputs unchanged
        return record

    hooks = [m.register_forward_pre_hook(hook(key), with_kwargs=True) for key, m in (("cn", cn), ("tr", tr))]
    torch.manual_seed(0)
    with torch.no_grad():
        pipe(**{**kw, "num_inference_steps": 1}, generator=tp._g(), output_type="latent")
    for h in hooks:
        h.remove()
    cn, tr = cn.double(), tr.double()
    cn_args, tr_args = as64(calls["cn"]), as64(calls["tr"])

    def f(hidden_states, controlnet_cond, tiled: bool = False, **options):
        net, den = (TiledControlNet(cn), TiledDenoiser(tr, **options)) if tiled else (cn, tr)
        out = net(**{**cn_args, "hidden_states": hidden_states, "controlnet_cond": controlnet_cond,
                     "return_dict": False})
        res = dict(zip(RESIDUALS[name], out, strict=False))
        return den(**{**tr_args, **res, "hidden_states": hidden_states, "return_dict": False})

    return f, tr_args["hidden_states"], cn_args["controlnet_cond"], [*cn.parameters()][::5], tr, tr_args


@pytest.mark.parametrize("name", list(RESIDUALS))
def test_transformer_controlnet_gradients(name):
    """One tile: the stock pair's gradients (latent, control image, ControlNet parameters); 3 x 3 tiles:
    recompute equals keep."""
    f, x, image, params, tr, tr_args = control_pair(name)
    image = image.clone().requires_grad_()  # a leaf: its gradient is returned after the latent's
    got = {}
    several = dict(tile_size=16, overlap=8, method="mixture")
    assert TiledDenoiser(tr, **several).count(*latent_sides(tr, tr_args, "hidden_states")) == 9
    for label, options in (("stock", None), ("one", dict(tile_size=256)),
                           ("keep", {**several, "backward": "keep"}),
                           ("recompute", {**several, "backward": "recompute"})):
        def fn(hidden_states, options=options, **_):
            return f(hidden_states, image, tiled=options is not None, **(options or {}))

        got[label] = grads(fn, dict(hidden_states=x), "hidden_states", [image, *params],
                           got["stock"][2] if got else None)
    (want, want_g, _), (one, one_g, _) = got["stock"], got["one"]
    close(one, want, 1e-12)
    assert all(g.abs().max() > 0 for g in want_g[:2])  # the latent and the control image
    for a, b in zip(one_g, want_g, strict=True):
        close(a, b, 1e-10)
    close(got["recompute"][0], got["keep"][0], 0)
    for a, b in zip(got["recompute"][1], got["keep"][1], strict=True):
        close(a, b, 1e-12)
