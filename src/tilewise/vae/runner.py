"""One call of a 2-D TiledVAE, run: its plan settled and checked against the memory there is, then the
exact executor, fast mode's passes or the crop estimator's run, with the planned retries.

- out of memory, with `retry_on_oom`: again at half the tile (fast mode in one piece), said in the log;
- a half-precision overflow (NaN / inf): again in float32, as diffusers' force_upcast does, said in the
  log; raised as it is in float32, or once a sink has received rows.
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from ..distributed import resolve_group
from .checks import check_fits
from .fast.run import crop_stats, run_fast
from .fast.split import fast_split
from .plan.make import make_plan, request
from .plan.settle import settle
from .run.executor import Executor
from .run.finite import NonFiniteError, check_output
from .run.options import Choices, pass_options
from .run.staging import TRIM_FREE
from .settings import Job, Mode, Place, Settings

logger = logging.getLogger(__name__)


def run(settings: Settings, job: Job, t, emit, vae) -> tuple:
    """(output, most staged bytes; None for the untiled run) of the job on t as its settled plan says;
    emit(box, value) receives the output's tile cores when given (then the output is None). `vae`: the
    wrapped module, cast to float32 and back for an overflow's retry."""
    plan = settle(settings, job, tuple(t.shape), streamed=emit is not None)
    check_fits(job, tuple(t.shape), plan, emit is not None, settings.stage_dir)
    choices = plan.choices
    while True:
        try:
            with torch.no_grad():
                return run_once(settings, job, t, choices, emit)
        except NonFiniteError as err:
            return _upcast(settings, job, t, choices, emit, vae, err)
        except torch.OutOfMemoryError:
            tile = choices.tile_size
            if not settings.retry_on_oom or tile <= 1:
                raise
            logger.warning("TiledVAE %s: out of memory at tile_size %d, retrying with %d%s", job.kind, tile,
                           tile // 2, " (fast mode in one piece, its low pass in those tiles)"
                           if choices.fast_cuts or choices.low_tile else "")
            choices = choices.replace(tile_size=tile // 2, fast_cuts=(), low_tile=0, head_tile=0)
            torch.cuda.empty_cache() if torch.cuda.is_available() else None


def _upcast(settings: Settings, job: Job, t, choices: Choices, emit, vae, err: NonFiniteError) -> tuple:
    """Run again with the VAE in float32 after a half-precision overflow (diffusers' force_upcast: the
    SDXL VAE's float16 activations overflow), said in the log; the result in t's dtype. Raised as it is
    in float32, or once a sink has received rows."""
    dtype = job.dtype
    if t.dtype not in (torch.float16, torch.bfloat16) or getattr(emit, "sent", False):
        raise err
    logger.warning("TiledVAE %s: %s overflow (NaN or inf in the output of %r); running it again with "
                   "the VAE in float32, as diffusers' force_upcast does", job.kind, err.dtype, err.producer)
    vae.to(torch.float32)
    try:
        with torch.no_grad():
            out, peak = run_once(settings, dataclasses.replace(job, dtype=torch.float32), t.float(), choices,
                                 emit)
    finally:
        vae.to(dtype)
    return (None if out is None else out.to(t.dtype)), peak


def run_once(settings: Settings, job: Job, t, choices: Choices, emit) -> tuple:
    """One run following `choices` (the plan's: row bands of exact segments, values staged on the device
    with "device+host", fast mode's staged estimate and pieces, streamed attention, reads ahead)."""
    p = job.program
    shapes = p.shapes(tuple(t.shape[-2:]))
    if max(shapes[job.ref]) <= choices.tile_size and emit is None:  # fits one tile: the plain untiled path
        if settings.mode is Mode.EXACT:
            return check_output(p.run(t), p), None
        if job.gpu:  # (fast mode's passes on one tile only add work)
            logger.info("TiledVAE %s: one tile covers the input; fast mode runs it untiled (exact)", job.kind)
            return check_output(p.run(t), p), None
    slack = _heap_slack(settings, job, t, choices)
    group = resolve_group(settings.process_group)
    split = fast_split(p, job.kind, settings.mode, settings.fast)
    if split is not None:  # (fast mode's passes run in whole tiles, reading ahead where they can)
        options = pass_options(settings, job.profile, choices, band_bytes=job.profile.band_bytes,
                               heap_slack=slack, on_device=frozenset(), kv_chunk=0, query_rows=0,
                               read_ahead=True, recompute=())  # (recomputed: each pass its own)
        return run_fast(job, settings.fast, split, t, choices, options, emit, group)
    fast = settings.mode is Mode.FAST  # (the crop estimator: its statistics fixed, every tile end to end)
    fixed = crop_stats(job, settings.fast, t, choices.tile_size, group) if fast else {}
    options = pass_options(settings, job.profile, choices, band_bytes=None if fast else choices.band_bytes,
                           heap_slack=slack)
    res = Executor(p, choices.tile_size, job.ref, options, t.device, group, fixed).run(t, emit=emit)
    return res.output, res.staged_peak


def _heap_slack(settings: Settings, job: Job, t, choices: Choices) -> int:
    """Freed heap disk staging keeps: budgeted only where the budget is host memory (the plan's, at this
    tile), else TRIM_FREE."""
    if settings.memory_budget is not None and choices.staging is Place.DISK and t.device.type == "cpu":
        ask = request(settings, job, choices.tile_size, choices.staging)
        return make_plan(settings, job, tuple(t.shape), ask).heap_slack
    return TRIM_FREE
