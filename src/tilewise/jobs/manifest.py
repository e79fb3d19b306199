"""A dataset's bucket manifest: one row per image (its bucket, what the policy did, its SDXL conditioning).

Format: JSON lines. The first line is a header (the planner's settings, the policy, the dataset); then
one line per image, in the dataset's order: a kept image's row, or a skipped one's key and reason.
JSON lines rather than Parquet because: the stdlib reads and writes it (Parquet needs pyarrow, which the
base install does not have); a row is one line, written and read as a stream with no schema or footer,
so `head`, `grep` and `jq` read it and a later step (the latent cache) adds fields to a row without a
new schema; each row nests lists and dicts (boxes, conditioning) that Parquet would flatten into
columns of its own. At a million images it is about a gigabyte uncompressed (the explanation is most
of it); Parquet would be smaller, and is the better choice past that.

How a file becomes a bucket image (`ManifestRow.transform`): when no bucket takes it as it is, it is
first scaled down (aspect kept, `scaled_request`) to `scaled`, the request the planner assigns; then
the assignment's `apply` (pad / resize / crop). `micro_conditioning` is the
SDXL one of that: original_size is the file's own (h, w), crop and target those the assignment applied.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..buckets import Assignment, BucketPlanner
from ..errors import BadInputFile

FORMAT = "tilewise-buckets"
VERSION = 1


def scaled_request(planner: BucketPlanner, policy: str, width: int, height: int) -> tuple[int, int]:
    """The request a (width, height) file makes of the planner, aspect kept:

    - pad / auto: itself when some bucket is at least as large, else scaled down by the largest factor
      that fits it inside a bucket (max over buckets of min(bw / w, bh / h); sides floored);
    - crop: itself when no bucket fits inside it at a smaller scale, else scaled down by the smallest
      factor at which it still covers a bucket (min over buckets of max(bw / w, bh / h); sides rounded
      up), so the crop cuts the least; a crop never scales up;
    - resize: itself (the assignment's resize scales it)."""
    if policy == "resize":
        return width, height
    if policy == "crop":
        s = min(max(bw / width, bh / height) for bw, bh in planner.buckets)
        if s >= 1.0:
            return width, height
        return math.ceil(width * s - 1e-9), math.ceil(height * s - 1e-9)
    if any(bw >= width and bh >= height for bw, bh in planner.buckets):
        return width, height
    s = max(min(bw / width, bh / height) for bw, bh in planner.buckets)
    return max(1, math.floor(width * s + 1e-9)), max(1, math.floor(height * s + 1e-9))


@dataclass(frozen=True)
class ManifestRow:
    """One image of the manifest: where it is, its size, the request it makes and its assignment."""

    index: int  # position among the kept rows (what a sampler's indices mean)
    key: str
    width: int
    height: int
    scaled: tuple[int, int]
    assignment: Assignment
    explanation: str
    extra: dict = field(default_factory=dict)  # what a later step adds (the latent cache: shard, sha256)

    @property
    def bucket(self) -> tuple[int, int]:
        return self.assignment.bucket

    @property
    def micro_conditioning(self) -> dict[str, tuple[int, int]]:
        """SDXL's original_size (the file's h, w), crops_coords_top_left, target_size (the assignment's)."""
        mc = dict(self.assignment.micro_conditioning)
        mc["original_size"] = (self.height, self.width)
        return mc

    def transform(self, pixels: Any) -> Any:
        """A (H, W, C) array of the file -> the bucket-sized array (scaled, then the assignment applied)."""
        from ..buckets import imageops

        if self.scaled != (self.width, self.height):
            pixels = imageops.resize(pixels, (self.scaled[1], self.scaled[0]), self.assignment.resample)
        return self.assignment.apply(pixels)

    def to_json(self) -> dict[str, Any]:
        a = self.assignment
        row = {
            "key": self.key, "width": self.width, "height": self.height, "scaled": list(self.scaled),
            "bucket": list(a.bucket), "policy": a.policy, "fit": a.fit, "scale": self.scale,
            "resized": list(a.resized), "crop_top_left": list(a.crop_top_left), "pad": list(a.pad),
            "box": list(a.content_box), "mask_box": self.mask_box, "pad_fraction": round(a.pad_fraction, 6),
            "cut_fraction": round(a.cut_fraction, 6),
            "micro_conditioning": {k: list(v) for k, v in self.micro_conditioning.items()},
            "explanation": self.explanation,
        }
        return {**row, **self.extra}

    @property
    def mask_box(self) -> list[int]:
        """The latent cells (y0, y1, x0, x1, half-open) that hold any content: `assignment.mask` is 1 outside
        them and the padding fraction of a cell on their edge (0 inside)."""
        f = self.assignment.latent_factor
        y0, y1, x0, x1 = self.assignment.content_box
        return [y0 // f, -(-y1 // f), x0 // f, -(-x1 // f)]

    @property
    def scale(self) -> list[float]:
        """(s_y, s_x): bucket content pixels per file pixel along each axis."""
        a = self.assignment
        return [round(a.resized[1] / self.height, 6), round(a.resized[0] / self.width, 6)]


def make_row(planner: BucketPlanner, policy: str, index: int, key: str, width: int, height: int,
             area: int) -> ManifestRow:
    """The row of one file: its scaled request assigned by `policy`, with the explanation."""
    scaled = scaled_request(planner, policy, width, height)
    a = planner.assign(*scaled, policy=policy)
    if scaled != (width, height):
        first = (f"File {width}x{height} (w x h) is first scaled to {scaled[0]}x{scaled[1]} (aspect kept, "
                 f"{'to cover a bucket' if policy == 'crop' else 'to fit a bucket'}), "
                 "the request below.")
    else:
        first = f"File {width}x{height} (w x h) is the request as it is."
    note = (f"In the manifest original_size is the file's own size {(height, width)} (h, w), as SDXL was "
            "trained; crop and target are those above.")
    return ManifestRow(index, key, width, height, scaled, a, " ".join([first, a.explain(), note]))


@dataclass
class Manifest:
    """A manifest read back: its header, the kept rows (in order) and the skipped items with reasons."""

    header: dict[str, Any]
    rows: list[ManifestRow]
    skipped: list[tuple[str, str]]

    def __len__(self) -> int:
        return len(self.rows)

    def planner(self) -> BucketPlanner:
        """The BucketPlanner the header describes (the one the rows were assigned by)."""
        p = self.header["planner"]
        return BucketPlanner(buckets=[tuple(b) for b in p["buckets"]], step=p["step"],
                             max_aspect=p["max_aspect"], latent_factor=p["latent_factor"])

    def buckets(self) -> dict[tuple[int, int], list[int]]:
        """bucket -> indices of its rows, in manifest order."""
        out: dict[tuple[int, int], list[int]] = {}
        for r in self.rows:
            out.setdefault(r.bucket, []).append(r.index)
        return out


def header(planner: BucketPlanner, policy: str, area: int, dataset: str, kind: str) -> dict[str, Any]:
    """The manifest's first line: what it is, the planner's settings and buckets, the dataset."""
    return {"format": FORMAT, "version": VERSION, "dataset": dataset, "kind": kind, "policy": policy,
            "planner": {"area": area, "step": planner.step, "max_aspect": planner.max_aspect,
                        "latent_factor": planner.latent_factor, "resample": planner.resample,
                        "buckets": [list(b) for b in planner.buckets]}}


def row_from_json(index: int, d: dict[str, Any], planner_header: dict[str, Any]) -> ManifestRow:
    """A kept row back from its JSON (the Assignment rebuilt from the fields it was written from)."""
    a = Assignment(tuple(d["scaled"]), tuple(d["bucket"]), d["policy"], d["fit"], tuple(d["resized"]),
                   tuple(d["crop_top_left"]), tuple(d["pad"]), planner_header["latent_factor"],
                   planner_header.get("resample", "bicubic"), 0)
    known = {"key", "width", "height", "scaled", "bucket", "policy", "fit", "scale", "resized",
             "crop_top_left", "pad", "box", "mask_box", "pad_fraction", "cut_fraction", "micro_conditioning",
             "explanation"}
    extra = {k: v for k, v in d.items() if k not in known}
    return ManifestRow(index, d["key"], d["width"], d["height"], tuple(d["scaled"]), a, d["explanation"],
                       extra)


def manifest_lines(head: dict[str, Any], rows: Sequence[ManifestRow],
                   skipped: Sequence[tuple[str, str]]) -> Iterator[str]:
    """The JSON lines of a manifest: the header, then rows and skipped items (rows first)."""
    yield json.dumps(head)
    for r in rows:
        yield json.dumps(r.to_json())
    for key, reason in skipped:
        yield json.dumps({"key": key, "skipped": reason})


def read_manifest(path: str | os.PathLike) -> Manifest:
    """A manifest file (JSON lines, see the module docstring) read back; BadInputFile when it is not one."""
    shown = os.fspath(path)
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise BadInputFile(f"manifest {shown!r} cannot be read: {e}") from e
    try:
        head = json.loads(lines[0]) if lines else {}
    except json.JSONDecodeError as e:
        raise BadInputFile(f"manifest {shown!r}: its first line is not JSON ({e})") from e
    if head.get("format") != FORMAT:
        raise BadInputFile(f"{shown!r} is not a tilewise bucket manifest (its first line has no "
                           f"\"format\": \"{FORMAT}\"); make one with `tilewise buckets DATASET --out ...`")
    rows, skipped = [], []
    for n, line in enumerate(lines[1:], start=2):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
            if "skipped" in d:
                skipped.append((d["key"], d["skipped"]))
            else:
                rows.append(row_from_json(len(rows), d, head["planner"]))
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise BadInputFile(f"manifest {shown!r} line {n} is not a manifest row: {e!r}") from e
    return Manifest(head, rows, skipped)
