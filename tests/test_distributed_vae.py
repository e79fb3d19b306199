"""TiledVAE(process_group=...): exact and fast decode / encode on 2 and 3 gloo ranks vs one process.

Every rank builds the same seeded VAE and input; the single-process TiledVAE is the oracle (<= 1e-5), the
untiled VAE the exactness check (<= 1e-4). Runs use start_method="fork" (the parent's modules, no
re-import) and a hard limit so a hung collective fails the test instead of the suite.
"""

from __future__ import annotations

import time

import pytest
import torch

from tilewise import distributed as td
from tilewise.vae.devices import CUDA

torch.set_num_threads(1)
_GLOO = torch.distributed.is_available() and torch.distributed.is_gloo_available()
pytestmark = pytest.mark.skipif(not _GLOO, reason="torch.distributed with gloo is needed")
LIMIT = 120.0
FREE = CUDA.replace(launch_s=0.0)

# name -> (vae kind, task, input shape, TiledVAE options)
CASES = {
    "decode_host": ("sdxl", "decode", (1, 4, 13, 9), dict(tile_size=3, staging="host")),
    "decode_disk_batch2": ("sdxl", "decode", (2, 4, 11, 7), dict(tile_size=2, staging="disk")),
    "decode_sd3_device": ("sd3", "decode", (1, 16, 9, 12), dict(tile_size=2, staging="device")),
    "encode_sd": ("sd", "encode", (1, 3, 48, 40), dict(tile_size=2, staging="host")),
    "decode_fast_tiles": ("sdxl", "decode", (1, 4, 16, 12), dict(tile_size=4, mode="fast")),
    "decode_fast_crops": ("sdxl", "decode", (1, 4, 16, 12),
                          dict(tile_size=4, mode="fast", fast_estimator="crops")),
    "encode_fast_tiles": ("sd", "encode", (1, 3, 48, 40), dict(tile_size=2, mode="fast")),
    "encode_fast_crops": ("sd", "encode", (1, 3, 48, 40),
                          dict(tile_size=2, mode="fast", fast_estimator="crops")),
    "one_row": ("sdxl", "decode", (1, 4, 3, 9), dict(tile_size=3, staging="host")),  # fewer tile rows
    # fast mode in pieces (a GPU plan's choice; its launches free here, so the pieces pay)
    "decode_fast_pieces": ("sdxl", "decode", (1, 4, 16, 12),
                           dict(tile_size=4, mode="fast", device_kind=FREE)),
    "encode_fast_pieces": ("sd", "encode", (1, 3, 64, 48), dict(tile_size=2, mode="fast", device_kind=FREE)),
}


def _input(task: str, shape: tuple) -> torch.Tensor:
    from vae_support import structured_latent

    if task == "decode":
        return structured_latent(*shape)
    return torch.randn(*shape, generator=torch.Generator().manual_seed(3)).clamp(-1, 1)


def _run(name: str, group) -> torch.Tensor:
    from vae_support import kl_vae

    import tilewise as tw

    kind, task, shape, opts = CASES[name]
    tv = tw.TiledVAE(kl_vae(kind), progress=False, process_group=group, **opts)
    x = _input(task, shape)
    if task == "decode":
        return tv.decode(x).sample
    return tv.encode(x).latent_dist.mean


def _staged_peak(group, tile: int) -> int:
    """Most staged bytes one process holds in an exact decode of a tall latent."""
    from vae_support import kl_vae

    import tilewise as tw
    from tilewise.vae.run.executor import Executor
    from tilewise.vae.run.options import RunOptions

    tv = tw.TiledVAE(kl_vae("sdxl"), progress=False)
    p = tv.program("decode")
    ex = Executor(p, tile, p.input, RunOptions(staging="host", progress=False), group=group)
    with torch.no_grad():
        return ex.run(_input("decode", (1, 4, 24, 6))).staged_peak


def _decode_to(group) -> torch.Tensor | None:
    """decode_to through rank 0 into a memmap sink; returns rank 0's image."""
    import tempfile

    from vae_support import kl_vae

    import tilewise as tw
    from tilewise.sinks import MemmapSink

    tv = tw.TiledVAE(kl_vae("sdxl"), tile_size=3, progress=False, process_group=group)
    z = _input("decode", (1, 4, 13, 9))
    rank = td.rank_world(td.resolve_group(group))[0] if group else 0
    if rank != 0:
        tv.decode_to(z, None)
        return None
    with tempfile.TemporaryDirectory() as d:
        path = f"{d}/img.npy"
        sink = MemmapSink(path, 52, 36, channels=3, dtype="float32")
        with sink:
            tv.decode_to(z, sink)
        import numpy as np

        return torch.from_numpy(np.load(path).copy())


def _all_cases(rank: int, world: int) -> dict:
    out = {name: _run(name, "default") for name in CASES}
    out["staged_peak"] = _staged_peak(td.resolve_group("default"), 4)
    out["decode_to"] = _decode_to("default")
    return out


def _bad_rank(rank: int, world: int) -> None:
    from vae_support import kl_vae

    import tilewise as tw

    tv = tw.TiledVAE(kl_vae("sdxl"), tile_size=3, progress=False, process_group="default")
    z = _input("decode", (1, 4 if rank != 1 else 3, 13, 9))
    tv.decode(z)


@pytest.fixture(scope="module")
def reference():
    return {name: _run(name, None) for name in CASES}


# (3 ranks, bands of unequal rows: -m slow, 35 s on 2 cores; tests/test_distributed_video.py runs 3 ranks
# of a 3-D VAE by default)
@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_tiled_vae_on_n_ranks_equals_single_process(world, reference):
    from vae_support import kl_vae

    t0 = time.monotonic()
    res = td.spawn(_all_cases, world, start_method="fork", limit=LIMIT, timeout=60)
    for name, ref in reference.items():
        for rank, out in enumerate(res):
            assert out[name].shape == ref.shape, name
            err = (out[name] - ref).abs().max().item()
            assert err <= 1e-5, f"{name} on {world} ranks, rank {rank}: {err:.2e} vs single process"
        kind, task, shape, opts = CASES[name]
        if name.endswith("_pieces"):  # (the single process runs in pieces too)
            import tilewise as tw

            assert tw.TiledVAE(kl_vae(kind), progress=False, **opts).plan(shape, kind=task).fast_cuts
        if opts.get("mode", "exact") == "exact":  # and the single process is exact vs untiled
            vae, x = kl_vae(kind), _input(task, shape)
            with torch.no_grad():
                full = vae.decode(x).sample if task == "decode" else vae.encode(x).latent_dist.mean
            assert (ref - full).abs().max() <= 1e-4, name
    # per-rank staging is a band plus halos: about 1/N of the single-process bytes
    one = _staged_peak(None, 4)
    peaks = [out["staged_peak"] for out in res]
    assert max(peaks) < one * (1 / world + 0.35), f"per-rank staged {peaks} vs one process {one}"
    assert sum(peaks) >= one  # every row is held by some rank
    # and the per-rank plan predicts exactly what each rank staged
    import tilewise as tw
    from tilewise.vae import plan_ranks

    tv = tw.TiledVAE(kl_vae("sdxl"), tile_size=4)
    assert [rp.staged_peak for rp in plan_ranks(tv, (1, 4, 24, 6), world)] == peaks
    assert plan_ranks(tv, (1, 4, 24, 6), 1)[0].staged_peak == one
    # decode_to: rank 0 streams every rank's rows into its sink
    img = res[0]["decode_to"]
    assert img is not None and all(out["decode_to"] is None for out in res[1:])
    assert (img - reference["decode_host"][0].permute(1, 2, 0)).abs().max() <= 1e-5
    assert time.monotonic() - t0 < LIMIT


def test_a_rank_with_bad_input_stops_all_ranks_fast():
    t0 = time.monotonic()
    with pytest.raises(td.RankError) as info:
        td.spawn(_bad_rank, 2, start_method="fork", limit=LIMIT, timeout=300)
    assert info.value.rank == 1
    assert "latent z has 3 channels, the VAE decoder expects 4" in info.value.traceback
    assert time.monotonic() - t0 < 60


def test_bad_process_group_arguments():
    from vae_support import kl_vae

    import tilewise as tw

    vae = kl_vae("sd3")
    with pytest.raises(ValueError, match="must be None, 'default' or a ProcessGroup, got 'all'"):
        tw.TiledVAE(vae, process_group="all")
    with pytest.raises(ValueError, match="retry_on_oom=True is single-process only"):
        tw.TiledVAE(vae, process_group="default", retry_on_oom=True)
    tv = tw.TiledVAE(vae, tile_size=2, process_group="default", progress=False)
    with pytest.raises(ValueError, match="process_group='default' needs torch.distributed initialised"):
        tv.decode(torch.zeros(1, 16, 4, 4))
