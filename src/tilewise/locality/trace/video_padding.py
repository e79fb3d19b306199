"""A 3-D convolution's padding as the video rules merge it from what feeds the convolution (`video._conv3d`):
its own zero padding, an `F.pad` before it (zeros; replicate: the border repeated in space, the first /
last frame in time; reflect in space), frames repeated in front and behind by a concatenation, and
frames an earlier call of a causal loop cached (`video_caches`).
"""

from __future__ import annotations


class Padding:
    """A 3-D convolution's padding as it is merged from what feeds it: space (top, bottom, left, right)
    and its mode; frames in front and behind with what they repeat ("zeros", "first", "last")."""

    def __init__(self, space, front, back, mode):
        self.space, self.front, self.back, self.mode = space, front, back, mode
        self.cached = 0  # (frames in front an earlier call cached, behind the zeros)

    def _time(self, side: list, n: int, fill: str) -> str | None:
        if n and self.cached and side is self.front:
            return "a causal cache read behind other frames padded in front of it (zeros or frames)"
        if n and side[0] and side[1] != fill:
            return f"a convolution padded in time with both {side[1]} and {fill}"
        if n:
            side[0], side[1] = side[0] + n, fill
        return None

    def merge_pad(self, src: int, pad: tuple, mode: str):
        """An F.pad (left, right, top, bottom[, front, back]) before the convolution: its source node."""
        left, right, top, bottom, *time = pad
        if mode not in ("zeros", "replicate", "reflect") or mode == "reflect" and any(time):
            return f"an F.pad of mode {mode!r} before a 3-D convolution (in time: zeros or replicate)"
        spatial = any((left, right, top, bottom))
        if spatial and mode != self.mode and any(self.space):
            return f"an F.pad of mode {mode!r} before a convolution padding itself with zeros"
        self.space = [a + b for a, b in zip(self.space, (top, bottom, left, right), strict=True)]
        if spatial:
            self.mode = mode
        front, back = time or (0, 0)
        why = self._time(self.front, front, "zeros" if mode == "zeros" else "first")
        return why or self._time(self.back, back, "zeros" if mode == "zeros" else "last") or src

    def merge_cache(self, src: int, n: int):
        """n frames an earlier call cached in front (behind the zeros merged so far): its source node."""
        if self.front[0] and self.front[1] != "zeros":
            return f"a causal cache read behind frames padded with {self.front[1]}"
        self.front[0], self.front[1], self.cached = self.front[0] + n, "zeros", self.cached + n
        return src

    def merge_frames(self, tpad: tuple):
        """The first frame repeated in front and the last behind (a concatenation): its source node."""
        src, front, back = tpad
        return self._time(self.front, front, "first") or self._time(self.back, back, "last") or src
