"""ControlNets and T2I-Adapters per tile in stock diffusers pipelines (SD 1.x, SDXL, SD3, Flux).

Oracles: the stock pipeline (one tile covering the latent must give its image); the whole-image inputs
the pipeline gave the ControlNet, against which every tile's call must be the tile's crop (recorded by
forward pre-hooks on the real ControlNet); the same tiled run at another tile batch size. Tiny real
models (tests/tiny_controlnets.py) whose zero convolutions carry seeded noise, 2 steps.
"""

from __future__ import annotations

import inspect

import numpy as np
import pytest
import torch

pytest.importorskip("diffusers")

import tiny_controlnets as tc  # noqa: E402

import tilewise as tw  # noqa: E402
from tilewise.diffusion.residuals import Residual  # noqa: E402

torch.set_num_threads(1)
TILED = {"unet": dict(tile_size=4, overlap=2), "transformer": dict(tile_size=16, overlap=8)}
CONTROLNETS = [n for n in tc.CASES if not n.startswith("t2i")]


def tiled(name: str, controlnet: str | None = "tiled", **denoiser):
    """The case's pipeline with its denoiser tiled and its ControlNet wrapped ("tiled"), each net of a
    MultiControlNet wrapped ("each") or left stock (None)."""
    build, kw, attr, _ = tc.CASES[name]
    pipe = build()
    setattr(pipe, attr, tw.TiledDenoiser(getattr(pipe, attr), **denoiser))
    if controlnet == "tiled":
        pipe.controlnet = tw.TiledControlNet(pipe.controlnet)
    elif controlnet == "each":
        from diffusers.models.controlnets.multicontrolnet import MultiControlNetModel

        pipe.controlnet = MultiControlNetModel([tw.TiledControlNet(n) for n in pipe.controlnet.nets])
    return pipe, kw


@pytest.mark.parametrize("name", list(tc.CASES))
def test_one_tile_covering_the_latent_equals_the_stock_pipeline(name):
    build, kw, _, off = tc.CASES[name]
    ref = tc.run(build(), kw)
    assert np.abs(ref - tc.run(build(), kw, **off)).max() > 1e-3  # the control changes the image
    for controlnet in ([None] if name.startswith("t2i") else ["tiled", None]):
        pipe, kw = tiled(name, controlnet, tile_size=64, overlap=0)
        assert np.abs(tc.run(pipe, kw) - ref).max() <= 1e-5, controlnet


def test_each_net_of_a_multicontrolnet_wrapped_equals_the_stock_pipeline():
    _, kw, _, _ = tc.CASES["sd-multi"]
    ref = tc.run(tc.sd_multi(), kw)
    pipe, kw = tiled("sd-multi", "each", tile_size=64, overlap=0)
    assert np.abs(tc.run(pipe, kw) - ref).max() <= 1e-5


# ---- several tiles: each ControlNet call gets its tile's crops; the result does not depend on batching ----
def _recorder(module, log: list, signature_of=None):
    """Appends each call's arguments by name (lists copied: the UNet pops from its residual lists)."""
    sig = inspect.signature((signature_of or module).forward)

    def hook(mod, args, kwargs):
        given = sig.bind(*args, **kwargs).arguments
        log.append({k: list(v) if isinstance(v, list) else v for k, v in given.items()})
    return module.register_forward_pre_hook(hook, with_kwargs=True)


def _tokens(box, w: int) -> torch.Tensor:
    """Raster indices of a latent box's 2x2-patch tokens in a grid w tokens wide (written out here)."""
    y0, y1, x0, x1 = (c // 2 for c in box)
    return torch.tensor([y * w + x for y in range(y0, y1) for x in range(x0, x1)])


@pytest.mark.parametrize("name", ["sd", "sdxl-guess-mode", "sd-multi", "sd3", "flux"])
def test_every_tile_gets_its_crop_of_the_control_image(name):
    attr = tc.CASES[name][2]
    pipe, kw = tiled(name, **TILED[attr], method="mixture")
    whole, per_tile = [], []
    inner = pipe.controlnet.controlnet
    hooks = [_recorder(pipe.controlnet, whole, inner), _recorder(inner, per_tile)]
    tc.run(pipe, kw)
    for h in hooks:
        h.remove()
    sample_arg = "sample" if attr == "unet" else "hidden_states"
    full = whole[0][sample_arg]
    H, W = full.shape[-2:] if full.ndim == 4 else (32, 32)
    boxes = [p.read for p in getattr(pipe, attr).plan(H, W)]
    assert len(whole) == 2 and len(per_tile) == 2 * len(boxes) > 2  # one ControlNet call per tile per step
    for step, call in enumerate(whole):
        for box, got in zip(boxes, per_tile[step * len(boxes):], strict=False):
            y0, y1, x0, x1 = box
            conds = call["controlnet_cond"]
            for c, g in zip(conds if isinstance(conds, list) else [conds],
                            got["controlnet_cond"] if isinstance(conds, list) else [got["controlnet_cond"]],
                            strict=True):
                if name == "flux":  # packed tokens: the tile's tokens of the whole latent, and their ids
                    idx = _tokens(box, W // 2)
                    assert torch.equal(g, c[:, idx])
                    assert torch.equal(got[sample_arg], call[sample_arg][:, idx])
                    assert torch.equal(got["img_ids"], call["img_ids"][idx])
                    continue
                f = c.shape[-2] // H  # 8: pixel control images; 1: SD3's latent control image
                assert f == (8 if attr == "unet" else 1)
                assert torch.equal(g, c[..., y0 * f : y1 * f, x0 * f : x1 * f])
                assert torch.equal(got[sample_arg], call[sample_arg][..., y0:y1, x0:x1])


@pytest.mark.parametrize("name", ["sd", "sd-guess-mode", "sd-multi", "sdxl", "sd3", "flux"])
def test_several_tiles_do_not_depend_on_tile_batch_size(name):
    attr = tc.CASES[name][2]
    outs = [tc.run(*tiled(name, **TILED[attr], method="mixture", batch_size=b)) for b in (1, 3)]
    assert np.abs(outs[0] - outs[1]).max() <= 1e-5
    assert np.isfinite(outs[0]).all() and outs[0].std() > 0.01


@pytest.mark.parametrize("name", ["sd3", "flux"])
def test_tile_local_positions_batch_the_controlnet_calls_and_do_not_depend_on_batch_size(name):
    outs = [tc.run(*tiled(name, **TILED["transformer"], positions="tile", batch_size=b)) for b in (1, 3)]
    assert np.abs(outs[0] - outs[1]).max() <= 1e-5


def test_regions_with_a_tiled_controlnet_in_guess_mode_do_not_depend_on_batch_size():
    """Regions split the rows (unconditional, conditional); guess mode's zeros take the ControlNet's rows."""
    region = tw.Region(box=(0, 0, 24, 64), prompt_embeds=torch.randn(1, 5, 32, generator=torch.Generator()
                                                                     .manual_seed(11)))
    outs = [tc.run(*tiled("sd-guess-mode", tile_size=4, overlap=2, batch_size=b, regions=[region]))
            for b in (1, 3)]
    assert np.abs(outs[0] - outs[1]).max() <= 1e-5
    plain = tc.run(*tiled("sd-guess-mode", tile_size=4, overlap=2))
    assert np.abs(outs[0] - plain).max() > 1e-4  # the region took part


# ---- residuals computed before tiling: cropped per tile at their own resolution --------------------------
@pytest.mark.parametrize("name", ["sd", "t2i-adapter"])
def test_untiled_residuals_are_cropped_per_tile_at_their_resolution(name):
    pipe, kw = tiled(name, None, tile_size=4, overlap=2)
    model = pipe.unet.unet
    calls = []
    hook = _recorder(model, calls)
    source = pipe.controlnet if name == "sd" else pipe.adapter
    made = []
    out_hook = source.register_forward_hook(lambda m, a, out: made.append(out))
    tc.run(pipe, kw)
    hook.remove()
    out_hook.remove()
    key = "down_block_additional_residuals" if name == "sd" else "down_intrablock_additional_residuals"
    full = list(made[0][0] if name == "sd" else made[0])
    full = [f if f.shape[0] == 2 else torch.cat([f] * 2) for f in full]  # T2I: features repeated for CFG
    boxes = [p.read for p in pipe.unet.plan(8, 6)]
    for box, got in zip(boxes, calls, strict=False):
        y0, y1, x0, x1 = box
        for r, g in zip(full, got[key], strict=True):
            f = 8 // r.shape[-2]  # 1 or 2: the residual's factor below the 8x6 latent
            assert torch.equal(g, r[..., y0 // f : -(-y1 // f), x0 // f : -(-x1 // f)])


# ---- refusals ----------------------------------------------------------------------------------------------
def _deferred():
    pipe = tc.sd()
    cn = tw.TiledControlNet(pipe.controlnet)
    x = torch.zeros(2, 4, 8, 6)
    return cn(x, 1, encoder_hidden_states=torch.zeros(2, 5, 32), controlnet_cond=torch.zeros(2, 3, 64, 48),
              return_dict=False)


def test_deferred_residuals_take_the_pipelines_arithmetic_and_refuse_the_rest():
    down, mid = _deferred()
    assert len(down) == len(tc.sd().controlnet.controlnet_down_blocks)
    assert all(isinstance(d, Residual) for d in [*down, mid])
    guess = torch.cat([torch.zeros_like(mid), mid])
    assert isinstance(guess, Residual) and guess.batch == 4
    assert isinstance(mid + mid, Residual) and isinstance(torch.zeros(2, 64, 4, 3) + mid, Residual)
    assert isinstance(0.5 * mid, Residual)
    with pytest.raises(TypeError, match=r"^mean\(\) on a deferred ControlNet residual: .*only torch.cat"):
        torch.mean(mid)
    with pytest.raises(TypeError, match="only along the batch"):
        torch.cat([mid, mid], dim=1)


def test_a_stock_unet_given_deferred_residuals_says_to_tile_it():
    down, mid = _deferred()
    unet = tc.sd().unet
    with pytest.raises(TypeError, match=r"wrap the denoiser too"):
        unet(torch.zeros(2, 4, 8, 6), 1, encoder_hidden_states=torch.zeros(2, 5, 32),
             down_block_additional_residuals=down, mid_block_additional_residual=mid)


def test_wrapping_what_is_not_a_controlnet_is_refused_by_name():
    with pytest.raises(ValueError, match=r"cannot wrap a UNet2DConditionModel: supported ControlNet classes "
                                         r"are ControlNetModel, MultiControlNetModel"):
        tw.TiledControlNet(tc.sd().unet)
    with pytest.raises(ValueError, match="not already tiled"):
        tw.TiledControlNet(tw.TiledControlNet(tc.sd().controlnet))


def test_a_residual_whose_batch_is_not_the_denoisers_is_refused():
    down, mid = _deferred()  # 2 rows
    pipe = tc.sd()
    td = tw.TiledDenoiser(pipe.unet, tile_size=4, overlap=2)
    with pytest.raises(ValueError, match="a residual has 2 rows but the denoiser's sample 4"):
        td(torch.zeros(4, 4, 8, 6), 1, encoder_hidden_states=torch.zeros(4, 5, 32),
           down_block_additional_residuals=down, mid_block_additional_residual=mid)


def test_the_wrapper_presents_the_controlnet():
    from diffusers import ControlNetModel

    pipe = tc.sd()
    inner = pipe.controlnet
    pipe.controlnet = tw.TiledControlNet(inner)
    assert isinstance(pipe.controlnet, ControlNetModel) and type(pipe.controlnet) is tw.TiledControlNet
    assert pipe.controlnet.config is inner.config and pipe.to(torch.float32).controlnet.dtype == torch.float32
    assert list(pipe.controlnet.state_dict()) == list(inner.state_dict())


# ---- upscale with a tile ControlNet: every tile's control image is its crop of the resized input ----------
def test_upscale_feeds_each_tile_its_crop_of_the_resized_input_as_control_image():
    import tiny_pipes as tp

    from tilewise.diffusion.upscale import lanczos_resize

    image = tp._image(24, 20, seed=9)[0]  # -> 48x40 px, a 6x5 latent
    pe, ne = tp._embeds()
    kw = dict(scale=2, strength=0.5, tile_size=4, overlap=2, num_inference_steps=4, guidance_scale=2.0,
              prompt_embeds=pe, negative_prompt_embeds=ne, disable=True)
    controlnet = tw.TiledControlNet(tp._controlnet())
    whole, per_tile = [], []
    hooks = [_recorder(controlnet, whole, controlnet.controlnet), _recorder(controlnet.controlnet, per_tile)]
    out = tw.upscale(tp.sd(), image, controlnet=controlnet, **kw)
    for h in hooks:
        h.remove()
    plain = tw.upscale(tp.sd(), image, **kw)
    assert out.shape == plain.shape == (1, 3, 48, 40) and (out - plain).abs().max() > 1e-3
    want = lanczos_resize(image[None], (48, 40))
    assert len(whole) == 2  # one recorded ControlNet call per step: 4 steps at strength 0.5
    for call in whole:
        assert torch.allclose(call["controlnet_cond"], torch.cat([want] * 2), atol=1e-6)  # CFG rows
    boxes = [p.read for p in tw.TiledDenoiser(tp._unet(), tile_size=4, overlap=2).plan(6, 5)]
    assert len(per_tile) == len(whole) * len(boxes)
    for i, got in enumerate(per_tile):
        y0, y1, x0, x1 = boxes[i % len(boxes)]
        full = whole[0]["controlnet_cond"]
        assert torch.equal(got["controlnet_cond"], full[..., y0 * 8 : y1 * 8, x0 * 8 : x1 * 8])


def test_an_unwrapped_controlnet_s_residuals_fit_tiles_at_odd_places():
    """Issue 33: SD ControlNet pipeline, UNet tiled, ControlNet left unwrapped, 200 x 328 px (a 25 x 41
    latent): tiles start off the residuals' grid (stride 5) and each gets ceil(side / f) cells of every
    residual, so the UNet's residual additions fit; the image keeps the stock shape."""
    import tiny_pipes as tp

    pipe, kw = tc.CASES["sd"][0](), dict(tc.CASES["sd"][1], height=200, width=328,
                                         image=tp._image(200, 328, seed=5), num_inference_steps=1)
    ref = tc.run(pipe, kw)
    calls = []
    pipe.unet = tw.TiledDenoiser(pipe.unet, tile_size=8, overlap=3)
    hook = _recorder(pipe.unet.unet, calls)
    out = tc.run(pipe, kw)
    hook.remove()
    assert out.shape == ref.shape and np.isfinite(out).all()
    pieces = pipe.unet.plan(25, 41)
    assert any(p.read[0] % 2 or p.read[2] % 2 for p in pieces)  # tiles off the 2x grid
    for p, got in zip(pieces, calls, strict=False):
        h, w = p.read[1] - p.read[0], p.read[3] - p.read[2]
        fits = {(-(-h // f), -(-w // f)) for f in (1, 2, 4, 8)}  # what the UNet's levels make of the tile
        assert all(tuple(r.shape[-2:]) in fits for r in got["down_block_additional_residuals"])
