"""TiledDenoiser over every denoiser family it tiles, in stock pipelines (tests/tiny_denoisers.py).

Oracles: the stock pipeline (one tile covering the latent gives its latents, fp32 <= 1e-5); with several
tiles at odd sizes (and odd frame counts) the stock output's shape; the positional values each tile's
model call receives (a position module's output, recorded by a hook that runs after TiledDenoiser's,
or the positions passed to forward) against the untiled call's at the same tokens, whose indices the
test computes itself from the grid.
"""

from __future__ import annotations

import pytest
import torch

diffusers = pytest.importorskip("diffusers")

from tiny_denoisers import CASES, g  # noqa: E402

from tilewise.diffusion import TiledDenoiser  # noqa: E402
from tilewise.diffusion.adapters.flux import FluxAdapter  # noqa: E402
from tilewise.diffusion.adapters.grid import GridAdapter  # noqa: E402

torch.set_num_threads(1)
SMALL = dict(tile_size=4, overlap=2, method="mixture")


def run(case, pipe, kw) -> torch.Tensor:
    """The pipeline's latents (output_type="latent"), or the direct call's prediction."""
    if case.direct:
        model, inputs = getattr(pipe, case.slot), kw
        with torch.no_grad():
            out = model(**inputs, return_dict=False)
        return out[0]
    pipe.set_progress_bar_config(disable=True)
    with torch.no_grad():
        out = pipe(**kw, num_inference_steps=case.steps, generator=g(0), output_type="latent", **case.extra)
    for name in ("frames", "images", "latents"):
        v = getattr(out, name, None)
        if v is not None:
            return torch.as_tensor(v)  # DiT's pipeline decodes whatever output_type says
    return out[0]


def built(name):
    case = CASES[name]
    pipe, kw = case.build()
    if case.direct:  # (model, inputs): a namespace holding the model where a pipeline would
        holder = type("Direct", (), {})()
        setattr(holder, case.slot, pipe)
        pipe = holder
    return case, pipe, kw


def wrap(case, pipe, **options) -> TiledDenoiser:
    model = getattr(pipe, case.slot)
    den = TiledDenoiser(model.unet if isinstance(model, TiledDenoiser) else model, **options)
    setattr(pipe, case.slot, den)
    return den


# ---- one tile == stock; several tiles at odd sizes keep the stock shape ----------------------------------
@pytest.mark.parametrize("name", list(CASES))
def test_one_tile_equals_stock_and_several_tiles_keep_its_shape(name):
    case, pipe, kw = built(name)
    ref = run(case, pipe, kw)
    wrap(case, pipe, tile_size=256, overlap=0)
    one = run(case, pipe, kw)
    assert one.shape == ref.shape and (one - ref).abs().max() <= 1e-5
    assert ref.std() > 1e-3  # a real prediction, not a constant
    wrap(case, pipe, **{**SMALL, **case.tiles})
    tiled = run(case, pipe, kw)
    assert tiled.shape == ref.shape and torch.isfinite(tiled).all()
    assert (tiled - ref).abs().max() > 1e-5  # tiled: not the untiled result


# ---- positions: what each tile's call receives, against the untiled call at the same tokens --------------
def declared(den):
    """(position modules, positional forward arguments, per-axis argument, patch) of the wrapped family."""
    a = den.adapter
    if isinstance(a, GridAdapter):
        spec = a.spec
        names = [k for k in (*spec.tokens, spec.axis_positions) if k and k != spec.timestep]
        if spec.method is not None:
            names.append(spec.method.positions)
        return spec.sources, names, spec.axis_positions, tuple(spec.patch(den.unet.config))
    if isinstance(a, FluxAdapter):  # Flux's token layout: positions in img_ids, one row per 2x2 token
        return (), ["img_ids"], None, (2, 2)
    raise KeyError(type(a).__name__)


def record(den, log: list) -> list:
    """Hooks appending, per model call, the positional values it receives: each position module's output
    (run after TiledDenoiser's hook) and the per-token positional arguments of forward."""
    model = den.unet
    sources, names, _, _ = declared(den)
    handles = []
    for src in sources:
        module = src.find(model)
        if module is not None:
            handles.append(module.register_forward_hook(
                lambda m, a, out, key=src.module: log.append({key: out})))
    method = getattr(getattr(den.adapter, "spec", None), "method", None)
    if names:
        def args(m, a, kwargs):
            got = {k: kwargs.get(k) for k in names}
            if method is not None and got[method.positions] is None:  # the untiled call: the model's own
                made = getattr(model, method.method)(kwargs[den.adapter.spec.sample])
                got[method.positions] = made[method.returns.index(method.positions)]
            log.append(got)
        handles.append(model.register_forward_pre_hook(args, with_kwargs=True))
    return handles


def recorded(case, pipe, kw, den) -> list[dict]:
    log: list[dict] = []
    handles = record(den, log)
    try:
        run(case, pipe, kw)
    finally:
        for h in handles:
            h.remove()
    calls: list[dict] = []  # one dict per model call: the module outputs come before the next call's
    for entry in log:
        if not calls or set(entry) & set(calls[-1]):
            calls.append({})
        calls[-1].update(entry)
    return [c for c in calls if c]


def tile_indices(box, sides, patch) -> torch.Tensor:
    """The test's own token indices of a box: a raster numbering of the patch grid, sliced."""
    k = len(box) // 2
    grid = torch.arange(int(torch.tensor([-(-s // p) for s, p in zip(sides, patch)]).prod()))
    grid = grid.reshape([-(-s // p) for s, p in zip(sides, patch)])
    sl = tuple(slice(box[2 * i] // p, -(-box[2 * i + 1] // p)) for i, p in enumerate(patch[-k:]))
    return grid[sl].flatten()


def same_at(whole, tile, idx, n_whole, where="after"):
    """Every tensor of `tile` equals `whole`'s at tokens `idx` along the axis holding n_whole tokens (and
    the e other tokens, text, both have `where` the declaration says: before or after the image's)."""
    if isinstance(whole, (tuple, list)):
        for w, t in zip(whole, tile, strict=True):
            same_at(w, t, idx, n_whole, where)
        return
    if not isinstance(whole, torch.Tensor) or whole.shape == tile.shape and n_whole not in whole.shape:
        return
    d = next(i for i, n in enumerate(whole.shape) if n >= n_whole and tile.shape[i] < n)
    e = whole.shape[d] - n_whole
    lo = e if where == "before" else 0
    want = whole.narrow(d, lo, n_whole).index_select(d, idx)
    others = whole.narrow(d, 0 if where == "before" else n_whole, e)
    want = torch.cat([others, want] if where == "before" else [want, others], dim=d)
    torch.testing.assert_close(tile, want, atol=1e-5, rtol=0)


GRID_CASES = [n for n in CASES if CASES[n].positions]


@pytest.mark.parametrize("name", GRID_CASES)
def test_each_tile_gets_the_positions_of_its_tokens(name):
    case, pipe, kw = built(name)
    den = wrap(case, pipe, tile_size=256)
    whole = recorded(case, pipe, kw, den)
    den = wrap(case, pipe, **SMALL, tile_frames=case.tile_frames, frame_overlap=1 if case.tile_frames else 0)
    seen = []
    den.register_forward_pre_hook(lambda m, a, k: seen.append((a, k)) if not seen else None, with_kwargs=True)
    calls = recorded(case, pipe, kw, den)
    sample = tuple(den.adapter.parse(den.unet, *seen[0]).sample.shape[2:])  # the latent's ([T,] H, W)
    pieces = den.plan(*sample[-2:], frames=sample[0] if len(sample) == 3 else None)
    assert len(calls) == len(whole) * len(pieces) and len(pieces) > 1
    sources, _, axis_positions, patch = declared(den)
    method = getattr(den.adapter, "spec", None) and den.adapter.spec.method
    patch = patch[-len(sample):]
    n_whole = int(tile_indices(tuple(c for s in sample for c in (0, s)), sample, patch).numel())
    for j, untiled in enumerate(whole):
        for piece, call in zip(pieces, calls[j * len(pieces):(j + 1) * len(pieces)], strict=True):
            idx = tile_indices(piece.read, sample, patch)
            where = {src.module: src.others for src in sources}
            for key, value in untiled.items():
                if key == axis_positions:  # per-axis positions: the tile's ranges of the untiled's
                    value = value or [torch.arange(-(-s // p)) for s, p in zip(sample, patch)]
                    box = piece.read
                    for i, (v, p) in enumerate(zip(value, patch)):
                        assert torch.equal(call[key][i], v[box[2 * i] // p:-(-box[2 * i + 1] // p)])
                    continue
                tile = call[key]
                if method is not None and key == method.positions:  # padded to max_seq: tokens first
                    value, tile = value[:, :n_whole], tile[:, : len(idx)]
                same_at(value, tile, idx, n_whole, where.get(key, "after"))


def test_qwen_image_21_prefix_cache_keeps_every_tile_exact():
    """Qwen-Image 2.1's prefix KV cache (its pipeline's default): the first step's calls fill it ("extract"),
    the next's read it ("cached": the output is the target's tokens only). Through one tile as stock; through
    several tiles equal to the same tiles without the cache (it holds only what every tile shares)."""
    from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21KVCache

    _, holder, kw = built("qwen-image-2.1")
    model = holder.transformer

    def steps(m):
        cache = QwenImage21KVCache(len(model.transformer_blocks))
        with torch.no_grad():
            return [m(**kw, kv_cache=cache, kv_cache_mode=mode, return_dict=False)[0]
                    for mode in ("extract", "cached")]

    for got, want in zip(steps(TiledDenoiser(model, tile_size=256)), steps(model), strict=True):
        assert got.shape == want.shape and (got - want).abs().max() <= 1e-5
    tiled = TiledDenoiser(model, **SMALL)
    with torch.no_grad():
        plain = tiled(**kw, return_dict=False)[0]
    extract, cached = steps(tiled)
    n = kw["hidden_states"].shape[1] - 8  # the target's tokens (after the condition image's 8)
    assert extract.shape == plain.shape and (extract - plain).abs().max() <= 1e-5
    assert cached.shape == (1, n, 4) and (cached - plain[:, -n:]).abs().max() <= 1e-5
    import tilewise

    region = tilewise.Region(box=(0, 0, 4, 4), prompt_embeds=kw["encoder_hidden_states"])
    with pytest.raises(ValueError, match="qwen-image-2.1 family cannot take regional prompts"):
        TiledDenoiser(model, **SMALL, regions=[region])
    tiled.regions = [region]
    with pytest.raises(ValueError, match="img_mask"):
        tiled(**kw)
