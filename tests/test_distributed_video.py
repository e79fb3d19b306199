"""TiledVAE(process_group=...) on 3-D causal VAEs: each rank its band of tile rows with its causal caches,
the steps' staged values summed over the ranks; 2 and 3 gloo ranks equal one process (<= 1e-5).

Runs use start_method="fork" (the parent's modules) and a hard limit, as tests/test_distributed_vae.py.
"""

from __future__ import annotations

import pytest
import torch

from tilewise import distributed as td

torch.set_num_threads(1)
_GLOO = torch.distributed.is_available() and torch.distributed.is_gloo_available()
pytestmark = pytest.mark.skipif(not _GLOO, reason="torch.distributed with gloo is needed")
LIMIT = 120.0

# name -> (family, task, input shape (latent for decode, video for encode), TiledVAE options)
CASES = {
    "wan_decode": ("wan2.1", "decode", (1, 4, 3, 8, 7), dict(tile_size=3)),
    "wan_decode_host": ("wan2.1", "decode", (1, 4, 2, 7, 5), dict(tile_size=2, staging="host")),
    "wan_encode": ("wan2.1", "encode", (1, 3, 5, 64, 56), dict(tile_size=3)),
    "ltx_decode": ("ltx0.9.0", "decode", (1, 4, 2, 7, 6), dict(tile_size=3)),
    "qwen_decode": ("qwen", "decode", (1, 4, 1, 9, 6), dict(tile_size=3)),
}


def _input(name: str) -> torch.Tensor:
    _, task, shape, _ = CASES[name]
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(3))
    return x if task == "decode" else x.clamp(-1, 1)


def _run(name: str, group) -> torch.Tensor:
    from video_vae_support import video_vae

    import tilewise as tw

    family, task, _, opts = CASES[name]
    vae = video_vae(family)
    tv = tw.TiledVAE(vae, progress=False, process_group=group, **opts)
    with torch.no_grad():
        if task == "decode":
            return tv.decode(_input(name)).sample
        return tv.encode(_input(name)).latent_dist.mean


def _decode_to(group) -> torch.Tensor | None:
    """decode_to through rank 0 into a .npy video sink; rank 0's frames, None on the others."""
    import tempfile

    import numpy as np
    from video_vae_support import video_vae

    import tilewise as tw

    tv = tw.TiledVAE(video_vae("wan2.1"), tile_size=3, progress=False, process_group=group)
    z = _input("wan_decode")
    rank = td.rank_world(td.resolve_group(group))[0] if group else 0
    with torch.no_grad():
        if rank != 0:
            tv.decode_to(z, None)
            return None
        with tempfile.TemporaryDirectory() as d:
            with tw.open_video_sink(f"{d}/v.npy", 9, 64, 56, bits=16) as sink:
                tv.decode_to(z, sink)
            return torch.from_numpy(np.load(f"{d}/v.npy").astype(np.int32))


def _all_cases(rank: int, world: int) -> dict:
    out = {name: _run(name, "default") for name in CASES}
    out["decode_to"] = _decode_to("default")
    return out


@pytest.fixture(scope="module")
def reference():
    return {name: _run(name, None) for name in CASES} | {"decode_to": _decode_to(None)}


@pytest.mark.parametrize("world", [2, 3])
def test_video_vae_on_n_ranks_equals_one_process(world, reference):
    from video_vae_support import video_vae

    res = td.spawn(_all_cases, world, start_method="fork", limit=LIMIT, timeout=60)
    for name in CASES:
        for rank, out in enumerate(res):
            assert out[name].shape == reference[name].shape, name
            err = (out[name] - reference[name]).abs().max().item()
            assert err <= 1e-5, f"{name} on {world} ranks, rank {rank}: {err:.2e} vs one process"
    # the single process is itself exact against the untiled VAE
    vae = video_vae("wan2.1")
    with torch.no_grad():
        full = vae.decode(_input("wan_decode")).sample
    assert (reference["wan_decode"] - full).abs().max() <= 1e-4
    # decode_to: rank 0's sink gets every rank's tiles, frame step by frame step
    assert all(out["decode_to"] is None for out in res[1:])
    assert (res[0]["decode_to"] - reference["decode_to"]).abs().max() <= 1  # (16-bit levels: rounding)


def test_a_process_group_plans_and_runs_frame_by_frame():
    """Each step's values are summed over the ranks before the next step reads them: frame order."""
    from video_vae_support import video_vae

    import tilewise as tw
    from tilewise.vae.video.plan import make_video_plan

    tv = tw.TiledVAE(video_vae("wan2.1"), tile_size=3, process_group="default", progress=False)
    assert tv.plan((1, 4, 3, 8, 7)).order == "frames"  # (planned without communication)
    with pytest.raises(ValueError, match="a process group runs order='frames'"):
        make_video_plan(tv.settings, tv.job("decode"), (1, 4, 3, 8, 7), order="tiles")


# the traced families beyond Wan / LTX / Qwen-Image, 2 ranks: GroupNorms over every frame (HunyuanVideo,
# Mochi), a chunked loop of several steps (CogVideoX, KVAE video), rows along time (VidTok), frames-first
# output and GroupNorms of each frame (Allegro); fast mode (every rank estimates the same statistics, then
# runs its band); name -> (builder in video_vae_support, task, shape, options)
TRACED = {
    "hunyuan": ("hunyuan", "decode", (1, 4, 2, 7, 6), dict(tile_size=3)),
    "mochi": ("mochi", "decode", (1, 4, 2, 7, 6), dict(tile_size=3)),
    "cogvideox": ("cogvideox_vae", "decode", (1, 4, 5, 7, 6), dict(tile_size=3)),
    "kvae": ("kvae_video", "encode", (1, 3, 9, 40, 48), dict(tile_size=2)),
    "vidtok": ("vidtok", "decode", (1, 4, 3, 7, 6), dict(tile_size=3)),
    "allegro": ("allegro", "encode", (1, 3, 8, 28, 24), dict(tile_size=3)),
    "hunyuan_fast": ("hunyuan", "decode", (1, 4, 2, 7, 6), dict(tile_size=3, mode="fast")),
    "allegro_fast": ("allegro", "encode", (1, 3, 8, 28, 24), dict(tile_size=3, mode="fast")),
}
_BUILT: dict = {}  # (built in the parent before the ranks fork: each rank has the same weights)


def _traced(name: str, group) -> torch.Tensor:
    import video_vae_support

    import tilewise as tw

    builder, task, shape, opts = TRACED[name]
    if builder not in _BUILT:
        _BUILT[builder] = getattr(video_vae_support, builder)()
    vae = _BUILT[builder]
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(4))
    tv = tw.TiledVAE(vae, progress=False, process_group=group, **opts)
    with torch.no_grad():
        out = tv.decode(x) if task == "decode" else tv.encode(x.clamp(-1, 1)).latent_dist.mean
    return out.sample if hasattr(out, "sample") else out


def _traced_cases(rank: int, world: int) -> dict:
    return {name: _traced(name, "default") for name in TRACED}


def test_the_traced_video_families_on_two_ranks_equal_one_process():
    one = {name: _traced(name, None) for name in TRACED}
    res = td.spawn(_traced_cases, 2, start_method="fork", limit=LIMIT, timeout=120)
    for name, want in one.items():
        for rank, out in enumerate(res):
            assert out[name].shape == want.shape, name
            err = (out[name] - want).abs().max().item()
            assert err <= 1e-5, f"{name} on 2 ranks, rank {rank}: {err:.2e} vs one process"
