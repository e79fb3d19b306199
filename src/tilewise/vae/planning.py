"""The plans of `TiledVAE.plan` and `TiledVAE.preflight`: which planner a call's job goes to (a video
program's, a backward's, one settled within the memory budget, or the tile and staging asked for), and
the check that a preflight's plan fits the memory and disk there are; `plan_ranks`, the per-rank plans of
an exact run across processes.
"""

from __future__ import annotations

import torch

from . import frames, gradient
from .checks import check_fits, check_video_fits
from .families import family_of
from .plan.make import make_plan, request
from .plan.ranks import RankPlan, rank_plans
from .plan.records import Plan
from .plan.settle import settle
from .settings import Job, Mode, Place, Settings
from .video import backward as video_backward
from .video.plan import make_video_plan


def plan(settings: Settings, job: Job, vae, shape: tuple[int, ...], video: bool, tile_size: int | None,
         staging: str | None, *, streamed: bool, sequential: bool, backward: bool) -> Plan:
    """The plan of `job` for an input of `shape` (`TiledVAE.plan`; `video`: the job runs a video
    program)."""
    if video:
        _video_shape(shape)
        if backward:
            return video_backward.plan(settings, job, shape, vae, tile_size, staging)
        return make_video_plan(settings, job, shape, tile_size, staging, to_sink=streamed,
                               sequential=sequential)
    if family_of(vae).frame:
        shape = frames.image_shape(shape)
    if backward:
        return gradient.plan(settings, job, shape, tile_size, staging)
    if tile_size is None and staging is None and settings.memory_budget is not None:
        return settle(settings, job, shape, streamed=streamed)
    place = None if staging is None else Place.parse(staging, "staging")
    return make_plan(settings, job, shape, request(settings, job, tile_size, place))


def preflight(settings: Settings, job: Job, vae, shape: tuple[int, ...], video: bool, streamed: bool,
              stage_dir) -> Plan:
    """The plan a run of `job` on `shape` will follow, checked against the memory and disk there are
    (`TiledVAE.preflight`; WontFit otherwise)."""
    if video:
        _video_shape(shape)
        p = make_video_plan(settings, job, shape, to_sink=streamed)
        check_video_fits(job, p, stage_dir)
        return p
    shape = frames.image_shape(shape) if family_of(vae).frame else shape
    p = settle(settings, job, shape, streamed=streamed)
    check_fits(job, shape, p, streamed, stage_dir)
    return p


def _video_shape(shape: tuple[int, ...]) -> None:
    """A video program's input is (B, C, T, H, W)."""
    if len(shape) != 5:
        raise ValueError(f"a 3-D VAE (SVD's decode: the video of one call) plans (B, C, T, H, W) shapes, got "
                         f"{tuple(shape)}")


def plan_ranks(tv, shape: tuple[int, ...], world: int, kind: str = "decode",
               tile_size: int | None = None, dtype=None) -> list[RankPlan]:
    """Per-rank plan of an exact TiledVAE run on `world` ranks (what `Executor(group=...)` will stage)."""
    if not isinstance(world, int) or world < 1:
        raise ValueError(f"world must be a positive int (ranks), got {world!r}")
    if tv.mode is not Mode.EXACT:
        raise ValueError(f"per-rank plans cover exact mode; this TiledVAE has mode={tv.mode.value!r}")
    job = tv.job(kind, int(shape[2]) if len(shape) == 5 else None)
    item = torch.empty((), dtype=dtype or job.dtype).element_size()
    return rank_plans(job.program, job.ref, tv.attention, shape, world, tile_size or tv.tile_size, item)
