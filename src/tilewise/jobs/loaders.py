"""torch datasets over a bucket manifest (images, transformed) or over the latent cache (latents read back).

Both index rows as their manifest does, so `BucketBatchSampler(ds.manifest, ...)` as a DataLoader's
`batch_sampler` gives batches of one bucket that the default collate stacks. An item is a dict:
`pixels` (3, H, W) in [-1, 1] or `latents` (C, H/f, W/f); `mask` (H/f, W/f), the padding fraction per
latent cell; SDXL's `original_size`, `crops_coords_top_left`, `target_size` as int64 pairs; `key`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from ..errors import BadInputFile
from .cache import CACHE_MANIFEST, sha256, to_tensor
from .manifest import Manifest, ManifestRow, read_manifest
from .readers import ImageDataset, open_dataset


def _conditioning(row: ManifestRow) -> dict[str, Any]:
    return {k: torch.tensor(v, dtype=torch.int64) for k, v in row.micro_conditioning.items()}


class ManifestDataset(Dataset):
    """The manifest's images, each decoded and brought to its bucket as the manifest says."""

    def __init__(self, manifest: str | os.PathLike | Manifest, dataset: str | os.PathLike | ImageDataset |
                 None = None):
        self.manifest = manifest if isinstance(manifest, Manifest) else read_manifest(manifest)
        head = self.manifest.header
        self.data = dataset if isinstance(dataset, ImageDataset) else open_dataset(
            dataset or head["dataset"], None if dataset else head["kind"])

    def __len__(self) -> int:
        return len(self.manifest.rows)

    def __getitem__(self, i: int) -> dict[str, Any]:
        row = self.manifest.rows[i]
        pixels = to_tensor(row.transform(self.data.pixels(row.key)))
        return {"pixels": pixels, "mask": torch.from_numpy(row.assignment.mask), "key": row.key,
                **_conditioning(row)}


class LatentDataset(Dataset):
    """The latent cache `DIR` (tilewise encode): each row's latents read from its shard (memory-mapped),
    checked against the manifest's sha256 when `verify`."""

    def __init__(self, cache_dir: str | os.PathLike, verify: bool = True):
        self.root = Path(cache_dir)
        path = self.root / CACHE_MANIFEST
        if not path.is_file():
            raise BadInputFile(f"{os.fspath(cache_dir)!r} is not a latent cache (no {CACHE_MANIFEST}); "
                               "make one with `tilewise encode DATASET --buckets MANIFEST --out DIR`")
        self.manifest = read_manifest(path)
        self.verify = verify
        self._open: dict[str, Any] = {}

    def __len__(self) -> int:
        return len(self.manifest.rows)

    def _shard(self, name: str) -> Any:
        from safetensors import safe_open

        if name not in self._open:
            self._open[name] = safe_open(str(self.root / name), "pt")
        return self._open[name]

    def __getitem__(self, i: int) -> dict[str, Any]:
        row = self.manifest.rows[i]
        f, k = self._shard(row.extra["shard"]), row.extra["offset"]
        z = f.get_slice("latents")[k:k + 1][0]
        if self.verify and sha256(z) != row.extra["sha256"]:
            raise BadInputFile(f"latent cache {str(self.root)!r}: row {row.key!r} in {row.extra['shard']} "
                               "does not match its sha256 (the shard changed after it was written)")
        mask = f.get_slice("masks")[k:k + 1][0]
        return {"latents": z, "mask": mask, "key": row.key, **_conditioning(row)}

    def __getstate__(self) -> dict[str, Any]:  # DataLoader workers open their own shard handles
        return {**self.__dict__, "_open": {}}

    def shard_keys(self, name: str) -> list[str]:
        """The keys a shard file holds, from its metadata."""
        return json.loads(self._shard(name).metadata()["keys"])
