"""The plan of a TiledVAE run, made before anything runs: the arithmetic behind its records
(`plan_records`).

A `Plan` lists the tile grid, the recomputation the halos cost, every staged value with its bytes and
where it lives, the per-tile working set and the estimated device peak, and what the run will dispatch
(`counts`): FLOPs, kernel launches, host<->device bytes, and the time they take on the device profile it
was made for (`devices`); each pass is planned as one Executor run (`plan_pass`), fast mode's pass by
pass (`plan_fast`). `make_plan` plans given tile and staging; `settle` chooses them within a memory
budget; `plan_ranks` shows what each rank of a multi-process run will stage.
"""

from __future__ import annotations

from .counts import Setting, untiled_cost
from .devices import device_profile
from .fast import WHOLE_TILE_SLACK, fast_split, fixed_ops
from .plan_fast import fast_passes
from .plan_pass import conv_work, pass_plan, pass_seconds, untiled_pass
from .plan_records import Choices, Pass, Plan, Stage  # noqa: F401  (part of this module's interface)
from .ranks import RankPlan, plan_ranks  # noqa: F401  (part of this module's interface)
from .staging import TRIM_FREE

_PROFILE = object()  # make_plan(band_bytes=...) default: the device profile's row bands


def make_plan(tv, shape: tuple[int, ...], kind: str = "decode", tile_size: int | None = None,
              staging: str | None = None, band_bytes=_PROFILE, untiled: bool = False,
              on_device: frozenset = frozenset(), attention: tuple[int, int] = (0, 0),
              read_ahead: bool = True, cuts: tuple[int, ...] | None = None) -> Plan:
    """The plan for an input of `shape` (B, C, H, W): grid, halo overhead, staged bytes, peak, and what
    it dispatches on its device profile (FLOPs, launches, transfers, estimated time).

    Fast mode with the sampled-tile estimator is planned pass by pass (`Plan.passes`): decode's exact
    latent-resolution head, the low pass, the sampled tiles (run together), the other tiles, and
    encode's exact latent-resolution tail. `band_bytes`: row bands of exact segments (default: the
    profile's; a CPU plan's BAND_BYTES). `untiled`: an exact plan whose one tile covers the latent is the
    plain untiled run (what `decode` / `encode` do; streaming to a sink runs the tile program).
    staging "device+host" (GPU plans): the values in `on_device` staged on the device, the others in
    pinned host memory (`settle.place`). A GPU plan in fast mode whose one tile covers the latent is
    the untiled run too (exact, and less work than fast mode's passes on that one tile).
    `attention` = (kv_chunk, query_rows): exact global attention with its keys and values in host
    memory, streamed kv_chunk tokens at a time, and its queries in row bands of query_rows rows
    (`vae.attention`; (0, 0): keys and values on the device, queries in the tiles). `read_ahead`: a GPU
    plan's host staging reads the next tile's inputs while a tile runs (one tile's reads more on the
    device; `copies`). `cuts`: fast mode's estimated part run in pieces cut there (`fast.piece_cuts`;
    None: a GPU plan's choice, `plan_fast.fast_passes`).
    """
    import torch

    prof = device_profile(tv)
    tile = tile_size or tv.tile_size
    st = staging or (tv.staging if tv.staging != "auto" else "device")
    bands = prof.band_bytes if band_bytes is _PROFILE else band_bytes
    p = tv.program(kind)
    shape = tuple(int(d) for d in shape)
    ref = p.input if kind == "decode" else p.output
    shapes = p.shapes(shape[-2:])
    full = conv_work(p, shapes)
    item = torch.empty((), dtype=tv.vae.dtype).element_size()
    setting = Setting(st, prof.kind != "cpu", prof.conv_workspace, bands if tv.mode == "exact" else None,
                      prof.stats_chunk, item, shape[0], tv.query_chunk, tv.attention == "global",
                      frozenset(on_device), *attention, read_ahead)
    k = fast_split(tv, p, kind)
    low_tile = 0
    # (a GPU plan in fast mode too: with one tile its estimation passes only add work, launches and bytes)
    one = untiled and (tv.mode == "exact" or prof.kind != "cpu") and max(shapes[ref]) <= tile
    if one:
        passes = [untiled_pass(tv, p, shape, tile, setting)]
    elif k is not None:
        passes, cuts, low_tile = fast_passes(tv, kind, p, k, shape, tile, setting, full, cuts)
    else:
        fixed = fixed_ops(tv, p, kind) if tv.mode == "fast" else set()
        passes = [pass_plan(tv, "tiled", p, shape, tile, setting, ref, fixed, full,
                            banded=tv.mode == "exact")]
    last = passes[-1]
    plan = Plan(kind, shape, last.output_shape, tile, last.grid, tv.mode, tv.attention, st,
                sum(q.segments for q in passes), sum(q.work for q in passes) - 1.0,
                [s for q in passes for s in q.stages], max(q.staged_peak for q in passes),
                max(q.working for q in passes), max(q.attention_bytes for q in passes),
                last.output_bytes, max(q.peak for q in passes))
    plan.passes = passes if k is not None and not one else []
    plan.device, plan.profile, plan.untiled = prof.kind, prof, one
    plan.band_bytes, plan.on_device = setting.band_bytes, setting.on_device
    plan.kv_chunk, plan.query_rows = attention
    plan.read_ahead = read_ahead and any(q.ahead for q in passes)
    plan.staged_estimate = any(q.name.startswith("sampled tiles, staged") for q in passes)
    plan.fast_cuts, plan.low_tile = (cuts, low_tile) if k is not None and not one else ((), 0)
    plan.segment_bytes, plan.lifetimes = last.segment_bytes, last.lifetimes
    passes[0].launches += 5  # the input's finite check (vae.checks.check_finite): a sum, isfinite's four,
    passes[0].syncs += 1  # and one read back to the host
    for name in ("flops", "launches", "syncs", "h2d", "d2h"):
        setattr(plan, name, sum(getattr(q, name) for q in passes))
    for q in passes:
        q.seconds = pass_seconds(prof, q, item < 4)
    plan.seconds = sum(q.seconds for q in passes)
    plan.untiled_flops = untiled_cost(p, shapes, p.channels(), setting).flops
    if st == "disk" and prof.kind == "cpu":  # freed heap the trims leave resident
        room = TRIM_FREE if tv.memory_budget is None else tv.memory_budget - plan.peak
        plan.heap_slack = max(0, min(TRIM_FREE, room))
        plan.peak = max(q.peak + _pass_slack(q, plan.heap_slack) for q in passes)
    return plan


def _pass_slack(q: Pass, slack: int) -> int:
    """Freed heap a pass keeps with disk staging: fast mode's other tiles (run whole) at most
    WHOLE_TILE_SLACK, every other pass the plan's slack."""
    return min(slack, WHOLE_TILE_SLACK) if q.name.startswith("other tiles") else slack
