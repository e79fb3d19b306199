"""TiledDenoiser on the transformers of stock diffusers pipelines: SD3, Flux, Flux.2, Qwen-Image, Z-Image.

Oracles: the stock pipeline (one tile covering the latent must give its image), the same tiled run at
another tile batch size, and the positional inputs the untiled call gives the same tokens (recorded by
hooks on the model, read after TiledDenoiser's own). Tiny real models (tests/tiny_transformers.py), no
text encoders (prompt embeddings are passed), 1-2 steps on 16-32 latent pixels.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

diffusers = pytest.importorskip("diffusers")

from tiny_transformers import FAMILIES, VARIANTS, embeds  # noqa: E402

from tilewise import distributed as td  # noqa: E402
from tilewise.diffusion import Region, TiledDenoiser  # noqa: E402

torch.set_num_threads(1)
PX = 32  # image side in pixels: latents of 32 (SD3, Flux, Flux.2) or 16 (Qwen-Image, Z-Image) latent pixels
TILED = dict(tile_size=8, overlap=4, method="mixture")


def run(pipe, kw, steps: int = 2, px: int = PX, **extra) -> np.ndarray:
    pipe.set_progress_bar_config(disable=True)
    with torch.no_grad():
        return pipe(**kw, height=px, width=px, num_inference_steps=steps, output_type="np",
                    generator=torch.Generator().manual_seed(0), **extra).images


def model_of(pipe):
    t = pipe.transformer
    return t.unet if isinstance(t, TiledDenoiser) else t


# ---- one tile == the stock pipeline; several tiles run and do not depend on the tile batch size ---------
@pytest.mark.parametrize("name", [*FAMILIES, *VARIANTS])
def test_one_tile_covering_the_latent_equals_the_stock_pipeline(name):
    pipe, kw = (FAMILIES | VARIANTS)[name]()
    ref = run(pipe, kw)
    pipe.transformer = TiledDenoiser(pipe.transformer, tile_size=64, overlap=0)
    out = run(pipe, kw)
    assert np.abs(out - ref).max() <= 1e-5
    assert ref.std() > 0.01  # a real image, not a constant


@pytest.mark.parametrize("positions", ["global", "tile"])
@pytest.mark.parametrize("name", [*FAMILIES, "flux-fill"])
def test_several_tiles_run_and_do_not_depend_on_tile_batch_size(name, positions):
    pipe, kw = (FAMILIES | VARIANTS)[name]()
    ref = run(pipe, kw)
    model = pipe.transformer
    outs = []
    for batch_size in (1, 3):
        pipe.transformer = TiledDenoiser(model, **TILED, batch_size=batch_size, positions=positions)
        outs.append(run(pipe, kw))
    assert np.abs(outs[0] - outs[1]).max() <= 1e-5
    assert np.isfinite(outs[0]).all() and np.abs(outs[0] - ref).max() > 1e-4  # tiled: not the untiled image


# ---- positions: what the model's layers receive per tile, against the untiled call ----------------------
def recorder(name: str, model, log: list):
    """Hooks appending, per model call, {"img": (rows, tokens, ...) positions of the image tokens, ...}."""
    if name.startswith("flux"):
        def ids(module, args, kwargs):
            i = kwargs["img_ids"]
            log.append({"img": (i[0] if i.ndim == 3 else i)[None].float()})
        return [model.register_forward_pre_hook(ids, with_kwargs=True)]
    if name == "sd3":
        def added(module, args, out):  # what PatchEmbed added to the projected patches
            log.append({"img": out - module.proj(args[0]).flatten(2).transpose(1, 2)})
        return [model.pos_embed.register_forward_hook(added)]
    if name == "qwen":
        def rope(module, args, kwargs, out):
            log.append({"img": out[0][None], "txt": out[1]})
        return [model.pos_embed.register_forward_hook(rope, with_kwargs=True)]
    if name == "zimage":
        def table(module, args):  # the main layers' rotary table: image tokens first, then the caption
            log.append({"img": args[2]})
        return [model.layers[0].register_forward_pre_hook(table)]
    raise KeyError(name)


def recorded(name: str, pipe, kw, px: int = PX) -> list[dict]:
    log: list[dict] = []
    handles = recorder(name, model_of(pipe), log)
    try:
        run(pipe, kw, steps=1, px=px)
    finally:
        for h in handles:
            h.remove()
    return log


def tokens(box, w: int) -> torch.Tensor:
    """Raster indices of a latent box's 2x2 tokens in a grid w tokens wide."""
    y0, y1, x0, x1 = (c // 2 for c in box)
    return (torch.arange(y0, y1)[:, None] * w + torch.arange(x0, x1)[None, :]).flatten()


@pytest.mark.parametrize("positions", ["global", "tile"])
@pytest.mark.parametrize("name", list(FAMILIES))
def test_each_tile_gets_the_positions_of_its_tokens(name, positions):
    pipe, kw = FAMILIES[name]()
    (whole,) = recorded(name, pipe, kw)  # the untiled call (one step, one call)
    H = W = PX // pipe.vae_scale_factor
    den = TiledDenoiser(pipe.transformer, **TILED, batch_size=1, positions=positions)
    pipe.transformer = den
    pieces = den.plan(H, W)
    if positions == "tile":  # an untiled image the tile's size: what today's tools give every tile
        pipe.transformer = den.unet
        (small,) = recorded(name, pipe, kw, px=TILED["tile_size"] * pipe.vae_scale_factor)
        pipe.transformer = den
    calls = recorded(name, pipe, kw)
    assert len(calls) == len(pieces)  # batch_size 1: one call per tile, in plan order
    seen = set()
    for piece, call in zip(pieces, calls, strict=True):
        idx = tokens(piece.read, W // 2)
        want = whole["img"][0, idx] if positions == "global" else small["img"][0, : len(idx)]
        for row in call["img"]:  # every row of the call (CFG halves) has its tile's positions
            torch.testing.assert_close(row[: len(idx)], want, atol=1e-6, rtol=0)
        if "txt" in call:  # Qwen-Image: the text's positions follow the image's (whole or tile) size
            torch.testing.assert_close(call["txt"], (whole if positions == "global" else small)["txt"])
        seen.update(idx.tolist())
    assert seen == set(range(H * W // 4))  # the tiles' tokens cover every token
    if positions == "tile" and name != "sd3":  # a tile's positions are not its tokens' (SD3: centred crop)
        assert not torch.allclose(calls[-1]["img"][0, : len(idx)], whole["img"][0, idx])


def test_sd3_global_positions_need_the_latent_inside_the_position_table():
    pipe, kw = FAMILIES["sd3"]()  # pos_embed_max_size 24 patches: 48 latent pixels
    with pytest.raises(ValueError, match=r"covers 24x24 patches .* the latent is 32x32.*positions='tile'"):
        pipe.transformer = TiledDenoiser(pipe.transformer, **TILED)
        run(pipe, kw, px=64, steps=1)
    pipe.transformer = TiledDenoiser(pipe.transformer.unet, **TILED, positions="tile")
    assert np.isfinite(run(pipe, kw, px=64, steps=1)).all()  # tile-local positions exist for any size


# ---- drop-in: the model's call and return types; refusals in one line ---------------------------------
def captured(name: str):
    """(model, args, kwargs) of the first transformer call of the stock pipeline."""
    pipe, kw = FAMILIES[name]()
    calls = []
    handle = pipe.transformer.register_forward_pre_hook(
        lambda m, a, k: calls.append((a, dict(k))) if not calls else None, with_kwargs=True)
    run(pipe, kw, steps=1)
    handle.remove()
    return pipe.transformer, *calls[0]


@pytest.mark.parametrize("name", list(FAMILIES))
def test_return_types_match_the_model(name):
    model, args, kwargs = captured(name)
    den = TiledDenoiser(model, tile_size=64)
    for return_dict in (True, False):
        kw = {**kwargs, "return_dict": return_dict}
        with torch.no_grad():
            want, got = model(*args, **kw), den(*args, **kw)
        assert type(got) is type(want)
        a, b = (got[0], want[0]) if not return_dict else (got.sample, want.sample)
        a, b = (torch.stack(list(v)) if isinstance(v, list) else v for v in (a, b))
        assert a.shape == b.shape and (a - b).abs().max() <= 1e-6


def test_an_unsupported_transformer_is_refused_in_one_line():
    from diffusers import PriorTransformer  # an embedding prior: no latent grid to tile

    prior = PriorTransformer(num_attention_heads=2, attention_head_dim=4, num_layers=1, embedding_dim=8,
                             num_embeddings=4, additional_embeddings=4)
    with pytest.raises(ValueError) as e:
        TiledDenoiser(prior)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("TiledDenoiser cannot wrap a PriorTransformer")
    for cls in ("SD3Transformer2DModel", "FluxTransformer2DModel", "Flux2Transformer2DModel",
                "QwenImageTransformer2DModel", "ZImageTransformer2DModel", "UNet2DConditionModel"):
        assert cls in msg


def test_bad_positions_and_refused_inputs():
    model, args, kwargs = captured("flux")
    with pytest.raises(ValueError, match="positions must be one of \\('global', 'tile'\\), got 'local'"):
        TiledDenoiser(model, positions="local")
    with pytest.raises(ValueError, match="tile_size 7 along height is not a multiple of the transformer's "
                                         "patch side in latent pixels, 2; use 6 or 8"):
        TiledDenoiser(model, tile_size=7, overlap=2)
    den = TiledDenoiser(model, **TILED)
    # ControlNet residuals are tiled since issue 18 (tests/test_controlnet.py); a malformed one is refused
    with pytest.raises(TypeError, match=r"controlnet_block_samples: a residual must be a \(batch, \.\.\.\) "
                                        r"tensor .* got Tensor of shape \(1,\)"):
        den(*args, **kwargs, controlnet_block_samples=[torch.zeros(1)])
    with pytest.raises(TypeError, match="FluxTransformer2DModel.*unexpected keyword argument 'sample'"):
        den(*args, **kwargs, sample=1)


# ---- spatial conditioning: cropped with the tile when it has the latent's size, refused otherwise -------
def test_flux_kontext_image_is_cropped_per_tile_or_refused():
    pipe, kw = VARIANTS["flux-kontext"]()  # an image of the output's size: its tokens are the latent's grid
    ref = run(pipe, kw)
    pipe.transformer = TiledDenoiser(pipe.transformer, **TILED)
    out = run(pipe, kw)
    assert np.isfinite(out).all() and np.abs(out - ref).max() > 1e-4
    with pytest.raises(ValueError, match=r"conditioning image \(img_ids first id 1\) is a 8x8 token grid "
                                         r"beside the 16x16 latent"):
        run(pipe, {**kw, "image": kw["image"].resize((16, 16))})


def test_flux2_reference_image_is_cropped_per_tile_or_refused():
    from tiny_transformers import image

    pipe, kw = FAMILIES["flux2"]()  # Flux.2 takes reference images of at least 64 px
    kw = dict(kw, image=image(64))
    ref = run(pipe, kw, px=64)
    pipe.transformer = TiledDenoiser(pipe.transformer, tile_size=64)
    assert np.abs(run(pipe, kw, px=64) - ref).max() <= 1e-5
    pipe.transformer = TiledDenoiser(pipe.transformer.unet, tile_size=32, overlap=8)
    out = run(pipe, kw, px=64)
    assert np.isfinite(out).all() and np.abs(out - ref).max() > 1e-4
    with pytest.raises(ValueError, match=r"conditioning image \(img_ids first id 10\) is a 48x48 token grid "
                                         r"beside the 32x32 latent"):
        run(pipe, {**kw, "image": image(96)}, px=64)


def test_flux_fill_shaped_tokens_and_qwen_edit_reference_images():
    from tiny_transformers import flux_transformer, qwen_transformer

    g = torch.Generator().manual_seed(0)
    fill = flux_transformer(in_channels=32)  # Fill: masked-image channels in every token
    ids = torch.stack(torch.meshgrid(torch.zeros(1), torch.arange(8.0), torch.arange(8.0), indexing="ij"), -1)
    kw = dict(hidden_states=torch.randn(1, 64, 32, generator=g), timestep=torch.tensor([0.5]),
              encoder_hidden_states=embeds()[0], pooled_projections=embeds()[1], img_ids=ids.reshape(-1, 3),
              txt_ids=torch.zeros(5, 3), return_dict=False)
    with torch.no_grad():
        one = TiledDenoiser(fill, tile_size=64)(**kw)[0]
        torch.testing.assert_close(one, fill(**kw)[0], atol=1e-6, rtol=0)
        assert TiledDenoiser(fill, **TILED)(**kw)[0].shape == (1, 64, 16)
    qwen = qwen_transformer()
    same = [[(1, 4, 4), (1, 4, 4)]]  # Qwen-Image-Edit: a reference image of the latent's size
    kw = dict(hidden_states=torch.randn(1, 32, 16, generator=g), timestep=torch.tensor([0.5]),
              encoder_hidden_states=embeds()[0], img_shapes=same, return_dict=False)
    with torch.no_grad():
        one = TiledDenoiser(qwen, tile_size=64)(**kw)[0]
        torch.testing.assert_close(one, qwen(**kw)[0], atol=1e-6, rtol=0)
        assert TiledDenoiser(qwen, tile_size=4, overlap=2)(**kw)[0].shape == (1, 32, 16)
        kw.update(hidden_states=torch.randn(1, 20, 16, generator=g), img_shapes=[[(1, 4, 4), (1, 2, 2)]])
        with pytest.raises(ValueError, match=r"img_shapes \[\(1, 4, 4\), \(1, 2, 2\)\]: TiledDenoiser "
                                             r"crops a reference image per tile only when it has the latent"):
            TiledDenoiser(qwen, tile_size=4, overlap=2)(**kw)


# ---- regions: a region over the whole image is the pipeline with the region's prompt -------------------
@pytest.mark.parametrize("name", list(FAMILIES))
def test_a_region_over_everything_equals_its_prompt(name):
    pipe, kw = FAMILIES[name]()
    n = 5 if name == "sd3" else 7  # another prompt of another length (Flux: text ids rebuilt); SD3's
    e2, p2 = embeds(seed=11, tokens=n)  # pipeline needs the negative prompt's length
    region = Region(box=(0, 0, PX, PX), prompt_embeds=e2, pooled_prompt_embeds=p2)
    model, s = pipe.transformer, pipe.vae_scale_factor
    pipe.transformer = TiledDenoiser(model, **TILED, regions=[region], vae_scale_factor=s)
    out = run(pipe, kw)
    kw2 = dict(kw)
    if name == "zimage":
        kw2["prompt_embeds"] = [e2[0]]
    else:
        kw2["prompt_embeds"] = e2
    if "pooled_prompt_embeds" in kw2:
        kw2["pooled_prompt_embeds"] = p2
    if "prompt_embeds_mask" in kw2:
        kw2["prompt_embeds_mask"] = torch.ones(1, n, dtype=torch.long)
    pipe.transformer = TiledDenoiser(model, **TILED, vae_scale_factor=s)
    assert np.abs(out - run(pipe, kw2)).max() <= 1e-5


# ---- process_group: two ranks == one process --------------------------------------------------------------
def _flux_latents(rank: int, world: int, group) -> torch.Tensor:
    pipe, kw = FAMILIES["flux"]()
    pipe.transformer = TiledDenoiser(pipe.transformer, **TILED, process_group=group)
    pipe.set_progress_bar_config(disable=True)
    with torch.no_grad():
        return pipe(**kw, height=PX, width=PX, num_inference_steps=2, output_type="latent",
                    generator=torch.Generator().manual_seed(0)).images


@pytest.mark.skipif(not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
                    reason="torch.distributed with gloo is needed")
def test_flux_on_two_ranks_equals_one_process():
    one = _flux_latents(0, 1, None)
    ranks = td.spawn(_flux_latents, 2, args=("default",), start_method="fork", limit=120, timeout=60)
    for out in ranks:
        assert (out - one).abs().max() <= 1e-5
