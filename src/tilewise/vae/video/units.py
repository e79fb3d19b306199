"""How a video program is cut and laid over tiles: the run orders, its segments (cut at its sync ops but
the GroupNorms whose statistics are given), each (segment, tile)'s cores and boxes, and the check that a
program of several causal steps holds no reduction over a step's frames. The executor (`executor`) and
the plans (`plan`, `backward`) read them alike."""

from __future__ import annotations

from ...locality.boxes import box_empty, map_box
from ...locality.ops import OpKind
from ...locality.ops3d_sync import ColumnAttention, ColumnSDPA, StepAttention, VideoGroupNorm
from ...locality.program import Segment, back_propagate, split_segments
from ...locality.program3d import VideoProgram
from ...vocabulary import Vocabulary
from ..settings import Attention, Place


class Order(Vocabulary):
    """frames: step by step, the model's own order (any sink); tiles: tile by tile through every step
    (one tile's caches at a time; random-access sinks)."""

    FRAMES = "frames"
    TILES = "tiles"


ORDERS = Order.words()
VIDEO_STAGINGS = ("device", "host", "disk")
IN_MEMORY = (Place.DEVICE, Place.HOST)  # the stagings "auto" tries first (disk only where none fits)


def video_segments(program: VideoProgram, attention: Attention, fixed=frozenset()) -> list[Segment]:
    """The program cut at its barriers: attention when global, GroupNorms of video values (statistics
    over the step's frames) but those in `fixed` (ids of GroupNorms whose statistics are given, pointwise
    then), and any other sync op."""
    def barrier(op):
        if op.kind is OpKind.ATTENTION:
            return attention is Attention.GLOBAL
        return op.sync and id(op) not in fixed

    return split_segments(program, barrier)


def layout(segs, shapes, grid, ref: str) -> dict[tuple[int, int], tuple[dict, dict]]:
    """(segment, tile) -> (cores of the segment's outputs in the tile, boxes every value needs)."""
    out = {}
    for i, seg in enumerate(segs):
        for tile in grid:
            cores = {v: map_box(tile.core, shapes[ref], shapes[v]) for v in seg.outputs}
            cores = {v: b for v, b in cores.items() if not box_empty(b)}
            if cores:
                out[i, tile.index] = cores, back_propagate(seg.ops, cores, shapes)
    return out


def step_syncs(program: VideoProgram) -> list:
    """The ops of `program` that reduce over every frame of a causal step (`ops3d_sync`; a GroupNorm of
    each frame reduces over its own frame only)."""
    return [op for op in program.ops if isinstance(op, StepAttention | ColumnAttention | ColumnSDPA)
            or isinstance(op, VideoGroupNorm) and not op.per_frame]


def check_steps(program: VideoProgram) -> None:
    """ValueError where a GroupNorm or attention over a step's frames is in a program of several causal
    steps: the model's would reduce over frames the step does not hold."""
    syncs = step_syncs(program)
    if syncs and program.every and not program.chunked:  # (a chunked loop's steps are the model's calls)
        raise ValueError(f"{program.name}: {syncs[0].name} ({syncs[0].describe()}) reduces over the frames "
                         f"of a causal step, but the program runs {program.first} + {program.every} k "
                         "frames a step: the model's reduces over frames the step does not hold; only "
                         "one-step programs (every frame in one step) run it")
