"""Bucket a dataset: each image's size from its header, its bucket by a policy, one manifest row each."""

from __future__ import annotations

import logging
import os
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

from ..atomic import atomic_path
from ..buckets import BucketPlanner
from .manifest import Manifest, ManifestRow, header, make_row, manifest_lines
from .readers import ImageDataset, iter_sizes, open_dataset

logger = logging.getLogger(__name__)


@dataclass
class BucketResult:
    """A bucketed dataset: the manifest (header, rows, skipped items) and how long the scan took."""

    manifest: Manifest
    seconds: float

    def summary(self) -> str:
        """Images kept and skipped, rows per bucket, padding and cut fractions, distinct shapes."""
        rows, m = self.manifest.rows, self.manifest
        per = Counter(r.bucket for r in rows)
        pixels = sum(r.bucket[0] * r.bucket[1] for r in rows) or 1
        padded = sum(r.assignment.padded_pixels for r in rows)
        cut = sum(r.assignment.cut_fraction * r.scaled[0] * r.scaled[1] for r in rows)
        asked = sum(r.scaled[0] * r.scaled[1] for r in rows) or 1
        lines = [f"{len(rows)} images in {len(per)} buckets, {len(m.skipped)} skipped, "
                 f"{len(rows) / max(self.seconds, 1e-9):.0f} images/s; padding {padded / pixels:.1%} of "
                 f"bucket pixels, {cut / asked:.1%} of requested pixels cut (policy {m.header['policy']})"]
        lines += [f"  {w}x{h}: {n}" for (w, h), n in sorted(per.items(), key=lambda kv: -kv[1])]
        lines += [f"  skipped {key}: {reason}" for key, reason in m.skipped[:20]]
        if len(m.skipped) > 20:
            lines.append(f"  ... {len(m.skipped) - 20} more skipped (each with its reason in the manifest)")
        return "\n".join(lines)


def bucket_dataset(
    dataset: str | os.PathLike | ImageDataset,
    out: str | os.PathLike | None = None,
    *,
    area: int = 256 * 256,
    step: int = 32,
    max_aspect: float = 4.0,
    policy: str = "pad",
    latent_factor: int = 8,
    planner: BucketPlanner | None = None,
    replace: bool = True,
    progress: bool = True,
) -> BucketResult:
    """Bucket every image of `dataset` (a folder, a save_to_disk folder, webdataset shards) into a manifest.

    Sizes come from headers (nothing decoded). A file that cannot be read, or that no bucket takes by
    `policy`, is listed in the manifest's `skipped` with the reason (and logged), never dropped silently.
    `planner` overrides area / step / max_aspect / latent_factor. With `out`, the manifest is written as
    JSON lines (see `tilewise.jobs.manifest`) under a temporary name, renamed when complete.
    """
    from tqdm.auto import tqdm

    data = dataset if isinstance(dataset, ImageDataset) else open_dataset(dataset)
    if planner is None:
        planner = BucketPlanner(area=area, step=step, max_aspect=max_aspect, latent_factor=latent_factor)
    else:  # an explicit planner: its largest bucket is the budget a file is scaled to
        area = max(b[0] * b[1] for b in planner.buckets)
    head = header(planner, policy, area, os.fspath(data.root), data.kind)
    rows: list[ManifestRow] = []
    skipped: list[tuple[str, str]] = []
    t0 = time.perf_counter()
    for key, size, reason in tqdm(iter_sizes(data), total=len(data), desc="buckets", unit="image",
                                  disable=not progress):
        if size is not None:
            try:
                rows.append(make_row(planner, policy, len(rows), key, size[0], size[1], area))
                continue
            except ValueError as e:  # no bucket takes it by this policy
                reason = f"{size[0]}x{size[1]}: {e}"
        logger.warning("skipped %s: %s", key, reason)
        skipped.append((key, str(reason)))
    result = BucketResult(Manifest(head, rows, skipped), time.perf_counter() - t0)
    if out is not None:
        write_manifest(out, result.manifest, replace=replace)
    return result


def write_manifest(path: str | os.PathLike, manifest: Manifest, replace: bool = True) -> None:
    """The manifest as JSON lines, under a temporary name renamed when complete."""
    with atomic_path(path, replace=replace) as tmp, open(tmp, "w", encoding="utf-8") as f:
        for line in manifest_lines(manifest.header, manifest.rows, manifest.skipped):
            f.write(line + "\n")


def transformed(data: ImageDataset, row: ManifestRow) -> Any:
    """The bucket-sized (H, W, 3) samples of a manifest row's image (decoded, scaled, assigned)."""
    return row.transform(data.pixels(row.key))
