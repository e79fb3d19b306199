"""The plans of `TiledVAE.plan` and `TiledVAE.preflight`: which planner a call's job goes to (a video
program's, a backward's, one settled within the memory budget, or the tile and staging asked for), and
the check that a preflight's plan fits the memory and disk there are.
"""

from __future__ import annotations

from . import frames, gradient
from .checks import check_fits, check_video_fits
from .families import family_of
from .plan.make import make_plan, request
from .plan.records import Plan
from .plan.settle import settle
from .settings import Job, Place, Settings
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
