"""tilewise.distributed and TiledDenoiser(process_group=...): gloo ranks on CPU vs single-process oracles.

Collectives are checked against closed forms computed from every rank's known inputs; the tiled denoiser on
1, 2 and 3 ranks against the single-process TiledDenoiser in a real tiny StableDiffusionPipeline. Heavy
imports (diffusers) live inside functions: children started with "spawn" import this module by name.
Pipeline runs use start_method="fork" (no re-import: seconds instead of tens of seconds on 2 cores).
"""

from __future__ import annotations

import os
import time

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tilewise import distributed as td

torch.set_num_threads(1)
_GLOO = torch.distributed.is_available() and torch.distributed.is_gloo_available()
pytestmark = pytest.mark.skipif(not _GLOO, reason="torch.distributed with gloo is needed")
D = 32
STEPS = 2
LIMIT = 120.0  # no test may wait longer than this for its ranks


# ---- sharding ----------------------------------------------------------------------------------------
@given(n=st.integers(0, 40), world=st.integers(1, 6), seed=st.integers(0, 10**6),
       strategy=st.sampled_from(["greedy", "contiguous"]))
def test_shards_partition_balance_and_ignore_order(n, world, seed, strategy):
    import random

    items = [(i * 7 % 13, i) for i in range(n)]
    shuffled = items[:]
    random.Random(seed).shuffle(shuffled)
    shards = [td.shard(items, r, world, strategy=strategy) for r in range(world)]
    again = [td.shard(shuffled, r, world, strategy=strategy) for r in range(world)]
    assert sorted(x for s in shards for x in s) == sorted(items)  # a partition
    assert [sorted(s) for s in shards] == [sorted(s) for s in again]  # the list order does not matter
    for s in shards:  # each shard keeps the given order
        assert s == [x for x in items if x in s]
    sizes = [len(s) for s in shards]
    assert max(sizes) - min(sizes) <= 1
    if strategy == "contiguous":  # runs of the sorted keys, in rank order
        flat = [x for s in shards for x in sorted(s)]
        assert flat == sorted(items)


def test_greedy_shard_balances_costs_lpt():
    costs = {"a": 7, "b": 5, "c": 4, "d": 3, "e": 1}
    shards = [td.shard(list(costs), r, 2, cost=costs.get) for r in range(2)]
    # LPT: a->0 (7), b->1 (5), c->1 (5 < 7: 9), d->0 (7 < 9: 10), e->1 (9 < 10: 10)
    loads = [sum(costs[k] for k in s) for s in shards]
    assert shards == [["a", "d"], ["b", "c", "e"]] and loads == [10, 10]


def test_shard_and_spawn_reject_bad_arguments():
    with pytest.raises(ValueError, match=r"rank must be an int in \[0, 2\), got 2"):
        td.shard([1, 2], 2, 2)
    with pytest.raises(ValueError, match="world size must be a positive int, got 0"):
        td.shard([1, 2], 0, 0)
    with pytest.raises(ValueError, match="1 duplicates"):
        td.shard([1, 1], 0, 2)
    with pytest.raises(ValueError, match="strategy must be"):
        td.shard([1], 0, 1, strategy="random")
    with pytest.raises(ValueError, match="costs must be >= 0"):
        td.shard([1], 0, 1, cost=lambda i: -1)
    with pytest.raises(ValueError, match="nprocs must be a positive int, got 0"):
        td.spawn(_sum_ranks, 0)
    with pytest.raises(ValueError, match="backend must be one of"):
        td.spawn(_sum_ranks, 1, backend="mpi")
    with pytest.raises(ValueError, match="start_method must be one of"):
        td.spawn(_sum_ranks, 1, start_method="thread")
    with pytest.raises(ValueError, match="process_group='default' needs torch.distributed initialised"):
        td.resolve_group("default")
    with pytest.raises(ValueError, match="got 'world'"):
        td.resolve_group("world")
    with pytest.raises(ValueError, match="got int"):
        td.resolve_group(3)
    assert td.resolve_group(None) is None and td.rank_world(None) == (0, 1)


def test_torchrun_command_and_env_check(monkeypatch):
    argv = ["generate", "--nproc", "3", "--prompt", "x", "--nproc=2", "--out", "a.png"]
    assert td.torchrun_command(argv, 2)[1:] == [
        "-m", "tilewise.distributed.torchrun", "--standalone", "--nproc-per-node=2", "-m", "tilewise.cli",
        "generate", "--prompt", "x", "--out", "a.png"]
    with pytest.raises(ValueError, match="nproc must be a positive int, got 0"):
        td.torchrun_command([], 0)
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    with pytest.raises(ValueError, match=r"missing \['RANK', 'WORLD_SIZE', 'MASTER_ADDR', 'MASTER_PORT'\]"):
        td.init_from_env()


def test_exchange_plan_sends_each_needed_pixel_once_from_its_owner():
    owned = [[(0, 2, 0, 4)], [(2, 4, 0, 4)], []]
    needed = [[(0, 3, 0, 4), (1, 3, 0, 4)], [(1, 4, 0, 2)], [(0, 4, 0, 4)]]
    assert td.exchange_plan(owned, needed) == [
        (1, 0, (2, 3, 0, 4)), (0, 1, (1, 2, 0, 2)), (0, 2, (0, 2, 0, 4)), (1, 2, (2, 4, 0, 4))]


_rect = st.tuples(st.integers(0, 7), st.integers(1, 4), st.integers(0, 7), st.integers(1, 4)).map(
    lambda t: (t[0], t[0] + t[1], t[2], t[2] + t[3]))


@given(rects=st.lists(_rect, max_size=6))
def test_disjoint_union_covers_each_pixel_exactly_once(rects):
    def mask(boxes, count=False):
        m = torch.zeros(12, 12, dtype=torch.int64)
        for y0, y1, x0, x1 in boxes:
            m[y0:y1, x0:x1] += 1
        return m if count else m > 0

    parts = td._disjoint_union(rects)
    assert torch.equal(mask(parts), mask(rects))
    assert int(mask(parts, count=True).max()) <= 1


def test_merge_moments_is_exact_for_far_apart_shard_means():
    g = torch.Generator().manual_seed(3)
    data = [torch.randn(2, 3, n, generator=g, dtype=torch.float64) * (1 + k) + 1000 * k
            for k, n in enumerate((5, 0, 17, 1))]
    zero = torch.zeros(2, 3, dtype=torch.float64)
    parts = [(d.shape[-1], d.mean(-1), _m2(d)) if d.shape[-1] else (0, zero, zero) for d in data]
    n, mean, m2 = td.merge_moments(parts)
    full = torch.cat(data, -1)
    assert n == full.shape[-1]
    assert torch.allclose(mean, full.mean(-1), rtol=0, atol=1e-10)
    assert torch.allclose(m2 / n, full.var(-1, unbiased=False), rtol=1e-12, atol=1e-9)


# ---- workers (module level: "spawn" children import them by name) ----------------------------------------
def _m2(x: torch.Tensor) -> torch.Tensor:
    """Sum of squared deviations about the mean over the last dim."""
    return ((x - x.mean(-1, keepdim=True)) ** 2).sum(-1)


def _shard_data(rank: int) -> torch.Tensor:
    """Rank r's pixels: shard means 50 apart, where merging per-shard variances naively is wrong."""
    g = torch.Generator().manual_seed(rank)
    return torch.randn(2, 4, 3 + 5 * rank, generator=g, dtype=torch.float64) * (rank + 1) + 50.0 * rank


def _sum_ranks(rank: int, world: int) -> int:
    return rank


def _transport(rank: int, world: int) -> dict:
    """Every collective on inputs that are a closed-form function of the rank."""
    from tilewise.blending import Accumulator

    group = td.resolve_group("default")
    out = {"rank_world": td.rank_world(group)}
    a = torch.full((2, 3), 0.1, dtype=torch.float32) * (rank + 1)
    td.all_reduce_sum([a], group)
    out["sum"] = a
    acc = Accumulator((1, 2, 4, 5))
    y0 = rank % 2 * 2
    acc.add(torch.full((1, 2, 2, 5), float(rank + 1)), (y0, y0 + 2, 0, 5), torch.ones(2, 5))
    td.all_reduce_accumulator(acc, group)
    out["acc"] = acc.result().clone()
    out["max"] = td.all_reduce_max(10 * rank + 3, group)
    kv = torch.arange(rank * 2 * 3, dtype=torch.float32).reshape(1, 3, rank * 2) + 100 * rank  # rank 0: empty
    out["cat"] = td.all_gather_cat(kv, group, dim=-1)
    x = _shard_data(rank)
    n, mean, m2 = td.all_merge_moments(x.shape[-1], x.mean(-1), _m2(x), group)
    out["moments"] = (n, mean, m2)
    out["bcast"] = td.broadcast(torch.full((3,), float(rank)), group, src=world - 1)
    out["obj"] = td.broadcast({"r": rank, "s": "x" * rank}, group, src=world - 1)
    full = _field()
    x = torch.full_like(full, float("nan"))
    owned, needed = _boxes(rank, world)
    for b in owned:
        x[..., b[0]:b[1], b[2]:b[3]] = full[..., b[0]:b[1], b[2]:b[3]]
    out["received"] = td.exchange_boxes(x, owned, needed, group)
    out["exchanged"] = x
    td.barrier(group, timeout=60)
    return out


def _field() -> torch.Tensor:
    """A (1, 2, 9, 10) closed-form image: every pixel a distinct value."""
    y, x = torch.meshgrid(torch.arange(9.0), torch.arange(10.0), indexing="ij")
    return torch.stack([100 * y + x, -(100 * y + x) - 0.5])[None]


def _boxes(rank: int, world: int) -> tuple[list, list]:
    """Row band of 3 rows owned by each rank (split in two boxes); it needs 2 halo rows, rank 0 everything."""
    y0, y1 = 3 * rank, 3 * rank + 3
    owned = [(y0, y1, 0, 4), (y0, y1, 4, 10)]
    needed = [(max(0, y0 - 2), min(9, y1 + 2), 0, 10)] + ([(0, 9, 0, 10)] if rank == 0 else [])
    return owned, needed


def _fail_on_rank_one(rank: int, world: int) -> None:
    if rank == 1:
        raise ValueError(f"rank one broke (world {world})")
    t = torch.ones(1)
    torch.distributed.all_reduce(t)  # would wait for rank 1 until the collective timeout


def _die_on_rank_one(rank: int, world: int) -> None:
    if rank == 1:
        os._exit(3)
    torch.distributed.barrier()


def _sleep(rank: int, world: int) -> None:
    time.sleep(60)


# ---- collectives on 3 ranks -----------------------------------------------------------------------------
def test_collectives_match_closed_forms_on_three_ranks():
    world = 3
    res = td.spawn(_transport, world, start_method="fork", limit=LIMIT, timeout=60)
    expect_cat = torch.cat([torch.arange(r * 2 * 3, dtype=torch.float32).reshape(1, 3, r * 2) + 100 * r
                            for r in range(world)], dim=-1)
    full = torch.cat([_shard_data(r) for r in range(world)], -1)
    expect_sum = sum((torch.full((2, 3), 0.1) * (r + 1)).double() for r in range(world)).float()
    acc = torch.zeros(1, 2, 4, 5)
    acc[..., 0:2, :] = (1 + 3) / 2  # ranks 0 and 2 write rows 0-1, rank 1 rows 2-3
    acc[..., 2:4, :] = 2
    for r, out in enumerate(res):
        assert out["rank_world"] == (r, world)
        assert torch.equal(out["sum"], expect_sum)
        assert torch.equal(out["acc"], acc)
        assert out["max"] == 23
        assert torch.equal(out["cat"], expect_cat)
        n, mean, m2 = out["moments"]
        assert n == full.shape[-1]
        assert torch.allclose(mean, full.mean(-1), rtol=0, atol=1e-12)
        assert torch.allclose(m2 / n, full.var(-1, unbiased=False), rtol=1e-12, atol=1e-10)
        assert torch.equal(out["bcast"], torch.full((3,), 2.0))
        assert out["obj"] == {"r": 2, "s": "xx"}
        owned, needed = _boxes(r, world)
        mask = torch.zeros(9, 10, dtype=torch.bool)
        for b in needed:
            mask[b[0]:b[1], b[2]:b[3]] = True
        assert torch.equal(out["exchanged"][..., mask], _field()[..., mask])  # halos / the gather arrived
        assert out["exchanged"][..., ~mask].isnan().all()  # nothing else was sent
        own = sum((b[1] - b[0]) * (b[3] - b[2]) for b in owned)
        assert out["received"] == 2 * (int(mask.sum()) - own)  # each needed pixel once, 2 channels


# ---- failures stop every rank, fast ------------------------------------------------------------------
def test_a_raising_rank_stops_all_ranks_and_reraises_with_its_traceback():
    t0 = time.monotonic()
    with pytest.raises(td.RankError) as info:  # default start method: children import this module
        td.spawn(_fail_on_rank_one, 2, timeout=300, limit=LIMIT)
    elapsed = time.monotonic() - t0
    assert info.value.rank == 1
    assert "ValueError: rank one broke (world 2)" in info.value.traceback
    assert "_fail_on_rank_one" in info.value.traceback and "rank 1 failed" in str(info.value)
    assert elapsed < 60, f"took {elapsed:.1f} s: the failure did not stop rank 0 (collective timeout 300 s)"


def test_a_dying_rank_and_a_stuck_run_do_not_hang():
    t0 = time.monotonic()
    with pytest.raises(td.RankError, match="rank 1 died: .*exit code 3"):
        td.spawn(_die_on_rank_one, 2, start_method="fork", timeout=300, limit=LIMIT)
    with pytest.raises(TimeoutError, match=r"ranks \[0, 1\] still running after limit=2.0 s"):
        td.spawn(_sleep, 2, start_method="fork", limit=2.0)
    assert time.monotonic() - t0 < 40


# ---- tiled denoising on 1, 2, 3 ranks == single process ------------------------------------------------
def _pipe():
    from diffusers import AutoencoderKL, DDIMScheduler, StableDiffusionPipeline, UNet2DConditionModel

    torch.manual_seed(0)
    unet = UNet2DConditionModel(
        block_out_channels=(32, 64), layers_per_block=1, sample_size=16, in_channels=4, out_channels=4,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        cross_attention_dim=D, norm_num_groups=32).eval()
    torch.manual_seed(1)
    vae = AutoencoderKL(block_out_channels=(8, 8, 8, 8), down_block_types=("DownEncoderBlock2D",) * 4,
                        up_block_types=("UpDecoderBlock2D",) * 4, latent_channels=4, norm_num_groups=4,
                        layers_per_block=1).eval()  # vae_scale_factor 8: latents are pixels / 8
    scheduler = DDIMScheduler(clip_sample=False, steps_offset=1)
    pipe = StableDiffusionPipeline(vae=vae, text_encoder=None, tokenizer=None, unet=unet, scheduler=scheduler,
                                   safety_checker=None, feature_extractor=None, requires_safety_checker=False)
    pipe.set_progress_bar_config(disable=True)
    return pipe


CASES = {  # name -> (latent h, w, TiledDenoiser options)
    "multidiffusion": (16, 32, dict(tile_size=16, overlap=8)),
    "mixture": (16, 32, dict(tile_size=16, overlap=8, method="mixture")),
    "mixture_batch2": (16, 32, dict(tile_size=16, overlap=8, method="mixture", batch_size=2)),
    "spot": (16, 32, dict(tile_size=16, method="spot", seed=3)),
    "halo": (16, 32, dict(tile_size=8, method="halo", halo=2)),
    "regions": (16, 32, dict(tile_size=16, overlap=8, method="mixture", regions="box")),
    "one_tile": (16, 16, dict(tile_size=16, overlap=8)),  # fewer tiles than ranks: empty shards
}


def _denoise(pipe, process_group, h: int, w: int, opts: dict) -> torch.Tensor:
    """STEPS DDIM steps with CFG of the tiny pipeline wrapped in a TiledDenoiser; the final latents."""
    from tilewise.diffusion import Region, TiledDenoiser

    g = torch.Generator().manual_seed(7)
    pe, ne = torch.randn(1, 5, D, generator=g), torch.randn(1, 5, D, generator=g)
    opts = dict(opts)
    if opts.get("regions") == "box":
        re = torch.randn(1, 5, D, generator=g)
        opts["regions"] = [Region(box=(64, 0, 256, 96), prompt_embeds=re, feather=8)]
    unet = pipe.unet.unet if hasattr(pipe.unet, "unet") else pipe.unet
    pipe.unet = TiledDenoiser(unet, process_group=process_group, **opts)
    with torch.no_grad():
        return pipe(prompt_embeds=pe, negative_prompt_embeds=ne, height=8 * h, width=8 * w,
                    guidance_scale=5.0, num_inference_steps=STEPS, output_type="latent",
                    generator=torch.Generator().manual_seed(0)).images


def _denoise_all(rank: int, world: int, names: list[str]) -> dict:
    pipe = _pipe()
    return {name: _denoise(pipe, "default", CASES[name][0], CASES[name][1], CASES[name][2]) for name in names}


@pytest.fixture(scope="module")
def reference():
    """Single-process TiledDenoiser latents (process_group=None): the oracle."""
    pipe = _pipe()
    return {name: _denoise(pipe, None, *CASES[name][:2], CASES[name][2]) for name in CASES}


def tolerance(name: str, reference: dict) -> float:
    """1e-5; with batch_size 2 the ranks' UNet batches hold other tiles than the single process's, and
    float32 kernels round differently per batch composition: allow twice what batch 1 vs 2 changes in
    one process."""
    if CASES[name][2].get("batch_size", 1) == 1:
        return 1e-5
    return max(1e-5, 2 * (reference[name] - reference["mixture"]).abs().max().item())


@pytest.mark.parametrize("world", [1, 2, 3])
def test_tiled_denoiser_on_n_ranks_equals_single_process(world, reference):
    t0 = time.monotonic()
    res = td.spawn(_denoise_all, world, args=(list(CASES),), start_method="fork", limit=LIMIT, timeout=60)
    for name, ref in reference.items():
        for rank, out in enumerate(res):
            assert torch.equal(out[name], res[0][name]), f"{name}: rank {rank} differs from rank 0"
        err = (res[0][name] - ref).abs().max().item()
        tol = tolerance(name, reference)
        assert err <= tol, f"{name} on {world} ranks: max abs error {err:.2e} > {tol:.1e} vs single process"
        assert ref.abs().max() > 0.1  # a real trajectory, not zeros
    assert tolerance("mixture_batch2", reference) < 1e-4
    assert time.monotonic() - t0 < LIMIT


def test_bad_process_group_is_a_value_error():
    pipe = _pipe()
    from tilewise.diffusion import TiledDenoiser

    with pytest.raises(ValueError, match="must be None, 'default' or a ProcessGroup, got 'all'"):
        TiledDenoiser(pipe.unet, tile_size=16, overlap=8, process_group="all")
    tiled = TiledDenoiser(pipe.unet, tile_size=16, overlap=8, process_group="default")
    x = torch.zeros(2, 4, 16, 16)
    with pytest.raises(ValueError, match="process_group='default' needs torch.distributed initialised"):
        tiled(x, 10, encoder_hidden_states=torch.zeros(2, 5, D))


# ---- torchrun: the documented launch line, end to end ---------------------------------------------------
TORCHRUN_SCRIPT = '''
import sys
import torch
from tilewise.diffusion import TiledDenoiser
from tilewise.distributed import init_from_env


class Local(torch.nn.Module):
    """A conv denoiser with the UNet call signature."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv = torch.nn.Conv2d(4, 4, 3, padding=1)

    def forward(self, sample, timestep, encoder_hidden_states=None, return_dict=True, **kw):
        return (self.conv(sample) * (1 + float(timestep) / 1000),)


def run(group):
    x = torch.randn(2, 4, 24, 40, generator=torch.Generator().manual_seed(5))
    tiled = TiledDenoiser(Local(), tile_size=16, overlap=6, method="mixture", process_group=group)
    with torch.no_grad():
        return tiled(x, 300, return_dict=False)[0]


if __name__ == "__main__":
    rank, world = init_from_env(timeout=60)
    torch.set_num_threads(1)
    out = run("default")
    torch.save({"rank": rank, "world": world, "out": out}, f"{sys.argv[1]}/rank{rank}.pt")
'''


def test_torchrun_launch_line_runs_ranks_that_agree_with_one_process(tmp_path):
    import importlib.util
    import subprocess

    (tmp_path / "tw_torchrun_rank.py").write_text(TORCHRUN_SCRIPT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    cmd = td.torchrun_command([str(tmp_path), "--nproc", "7"], 2, module="tw_torchrun_rank")
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=LIMIT)
    assert done.returncode == 0, done.stderr[-3000:]
    spec = importlib.util.spec_from_file_location("tw_torchrun_rank", tmp_path / "tw_torchrun_rank.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    one = script.run(None)  # the single-process oracle, same model and input
    for r in range(2):
        res = torch.load(tmp_path / f"rank{r}.pt", weights_only=True)
        assert (res["rank"], res["world"]) == (r, 2)
        assert (res["out"] - one).abs().max() <= 1e-6


def test_the_earliest_failure_is_reported_not_a_peer_that_failed_after_it(tmp_path):
    # rank 1 fails first; rank 0 then fails in a collective ("connection closed by peer") and may reach
    # the parent first: the parent must still name rank 1
    (tmp_path / "rank0.failed").write_text("200.5\nRuntimeError: Connection closed by peer")
    (tmp_path / "rank1.failed").write_text("100.25\nValueError: rank one broke")
    (tmp_path / "rank0.pt").write_text("not a failure record")
    assert td._first_failure(str(tmp_path)) == (1, "ValueError: rank one broke")
    (tmp_path / "rank0.failed").unlink()
    (tmp_path / "rank1.failed").unlink()
    assert td._first_failure(str(tmp_path)) is None
