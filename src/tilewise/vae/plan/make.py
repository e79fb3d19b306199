"""The plan of a TiledVAE run, made before anything runs (`make_plan`): its passes put together.

A `Plan` lists the tile grid, the recomputation the halos cost, every staged value with its bytes and
where it lives, the per-tile working set and the estimated device peak, and what the run will dispatch
(`counts`): FLOPs, kernel launches, host<->device bytes, and the time they take on the device profile it
was made for (`devices`); each pass is planned as one Executor run (`passes`), fast mode's pass by pass
(`fast`). `make_plan` plans given choices; `settle` chooses them within a memory budget; `ranks` shows
what each rank of a multi-process run will stage.
"""

from __future__ import annotations

from ..fast.run import WHOLE_TILE_SLACK
from ..fast.split import fast_split, fixed_ops
from ..run.options import Choices, pass_options
from ..run.staging import TRIM_FREE
from ..settings import Job, Mode, Place, Settings
from .fast import fast_passes
from .memo import recall
from .op_costs import Setting, untiled_cost
from .passes import PassSpec, conv_work, pass_plan, untiled_pass
from .records import Pass, PassKind, Plan, staging_floor

INPUT_CHECK = (5, 1)  # the input's finite check (vae.checks.check_finite): a sum, isfinite's four (launches),
# and one read back to the host (syncs)


def request(settings: Settings, job: Job, tile: int | None = None, staging: Place | None = None) -> Choices:
    """The choices a plan is asked for: the tile and staging given (else the settings': "auto" is device
    staging), the profile's row bands, the pieces left to the plan."""
    return Choices(tile or settings.tile_size, staging or settings.staging or Place.DEVICE,
                   band_bytes=job.profile.band_bytes, fast_cuts=None)


def make_plan(settings: Settings, job: Job, shape: tuple[int, ...], ask: Choices,
              untiled: bool = False) -> Plan:
    """The plan for an input of `shape` (B, C, H, W) following the choices `ask`: grid, halo overhead,
    staged bytes, peak, and what it dispatches on the job's device profile (FLOPs, launches, transfers,
    estimated time).

    Fast mode with the sampled-tile estimator is planned pass by pass (`Plan.passes`): decode's exact
    latent-resolution head, the low pass, the sampled tiles (run together), the other tiles, and
    encode's exact latent-resolution tail. `ask.band_bytes`: row bands of exact segments. `untiled`: an
    exact plan whose one tile covers the latent is the plain untiled run (what `decode` / `encode` do;
    streaming to a sink runs the tile program); so is a GPU plan's in fast mode (exact, and less work than
    fast mode's passes on that one tile). `ask.staging` MIXED (GPU plans): the values in `ask.on_device`
    staged on the device, the others in pinned host memory (`settle.place`). `ask.kv_chunk`,
    `ask.query_rows`: exact global attention with its keys and values in host memory, streamed kv_chunk
    tokens at a time, its queries in row bands of query_rows rows (`run.attention`; 0, 0: keys and values
    on the device, queries in the tiles). `ask.read_ahead`: a GPU plan's host staging reads the next
    tile's inputs while a tile runs (one tile's reads more on the device; `run.copies`). `ask.fast_cuts`:
    fast mode's estimated part run in pieces cut there (`fast.split.piece_cuts`; None: a GPU plan's
    choice, `fast.fast_passes`).
    """
    shape = tuple(int(d) for d in shape)
    p, tile = job.program, ask.tile_size
    shapes = p.shapes(shape[-2:])
    full = conv_work(p, shapes)
    exact = settings.mode is Mode.EXACT
    run = pass_options(settings, job.profile, ask, band_bytes=ask.band_bytes if exact else None)
    s = Setting(run, job.gpu, job.item, shape[0])
    k = fast_split(p, job.kind, settings.mode, settings.fast)
    # (a GPU plan in fast mode too: with one tile its estimation passes only add work, launches and bytes)
    one = untiled and (exact or job.gpu) and max(shapes[job.ref]) <= tile
    made = dict(fast_cuts=(), low_tile=0, fast_most=0, head_tile=0)
    if one:
        passes = [untiled_pass(p, shape, s)]
    elif k is not None:
        passes, made = fast_passes(job, settings, k, shape, tile, s, full, ask)
    else:
        fixed = frozenset(fixed_ops(p, job.kind, settings.fast.color_fix)) if not exact else frozenset()
        spec = PassSpec(PassKind.TILED, p, shape, tile, job.ref, fixed, banded=exact)
        passes = [pass_plan(spec, s, job.profile, full)]
    first = passes[0]
    passes[0] = first.replace(launches=first.launches + INPUT_CHECK[0], syncs=first.syncs + INPUT_CHECK[1])
    passes = [q.timed(job.profile, s.item < 4) for q in passes]
    chosen = ask.replace(band_bytes=run.band_bytes, **made,
                         read_ahead=ask.read_ahead and any(q.ahead for q in passes),
                         staged_estimate=any(q.kind is PassKind.SAMPLED_STAGED for q in passes))
    return _assemble(settings, job, shape, chosen, passes, fast=k is not None and not one, untiled=one,
                     untiled_flops=_untiled_flops(p, shapes, s))


def _untiled_flops(p, shapes, s: Setting) -> int:
    """FLOPs of the plain untiled run (`op_costs.untiled_cost`), once per program, shapes, batch and
    attention inside `memo.remembered()` (they read nothing else of a plan's choices)."""
    key = ("untiled flops", id(p), tuple(shapes.items()), s.batch, s.run.attention)
    return recall(key, lambda: untiled_cost(p, shapes, p.channels(), s).flops, p)


def _assemble(settings: Settings, job: Job, shape, choices: Choices, passes: list[Pass], fast: bool,
              untiled: bool, untiled_flops: int) -> Plan:
    """The plan of `passes`: their figures summed (or the largest), the disk staging's heap slack."""
    last = passes[-1]
    peak, slack = max(q.peak for q in passes), 0
    if choices.staging is Place.DISK and not job.gpu:  # freed heap the trims leave resident
        budget = settings.memory_budget
        slack = max(0, min(TRIM_FREE, TRIM_FREE if budget is None else budget - peak))
        peak = max(q.peak + _pass_slack(q, slack) for q in passes)
    floor = None
    budgeted = settings.memory_budget is not None
    if job.gpu and budgeted and settings.mode is Mode.EXACT and not (untiled or fast):
        floor = staging_floor(settings.memory_budget, last.segment_bytes, last.lifetimes,
                              {s.value: s.bytes for s in last.stages}, last.readers)
    return Plan(job.kind, shape, last.output_shape, settings.mode, settings.attention, choices, job.profile,
                last.grid, sum(q.segments for q in passes), sum(q.work for q in passes) - 1.0,
                stages=[s for q in passes for s in q.stages],
                staged_peak=max(q.staged_peak for q in passes), working=max(q.working for q in passes),
                attention_bytes=max(q.attention_bytes for q in passes),
                output_bytes=last.output_bytes, peak=peak, passes=passes if fast else [], heap_slack=slack,
                untiled=untiled, flops=sum(q.flops for q in passes), launches=sum(q.launches for q in passes),
                syncs=sum(q.syncs for q in passes), h2d=sum(q.h2d for q in passes),
                d2h=sum(q.d2h for q in passes), seconds=sum(q.seconds for q in passes),
                untiled_flops=untiled_flops, segment_bytes=last.segment_bytes, lifetimes=last.lifetimes,
                readers=last.readers, staging_floor=floor)


def _pass_slack(q: Pass, slack: int) -> int:
    """Freed heap a pass keeps with disk staging: fast mode's other tiles (run whole) at most
    WHOLE_TILE_SLACK, every other pass the plan's slack."""
    return min(slack, WHOLE_TILE_SLACK) if q.kind is PassKind.OTHER else slack
