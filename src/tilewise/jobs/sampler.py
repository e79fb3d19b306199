"""Batches of one bucket for a training loop: a torch `Sampler` of index batches, seeded, distributed-aware.

Per epoch (`set_epoch`, as DistributedSampler): each bucket's indices are shuffled by a generator seeded
with seed + epoch, cut into batches of `batch_size` (the last one of a bucket short, kept unless
drop_last), and the batches of every bucket shuffled together; rank r of R takes batches r, r + R, ...
Nothing is dropped or repeated unless asked: drop_last drops each bucket's short batch and the last
batches that would leave the ranks uneven; `pad=True` instead repeats the first batches until every rank
has as many (DistributedSampler's default, which DDP needs when a rank must not wait on another).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, Sequence
from typing import Any

from torch.utils.data import Sampler

from .manifest import Manifest, read_manifest


def _buckets_of(manifest: Any) -> list[tuple[int, int]]:
    """The bucket of each index: from a Manifest, a manifest path, a dataset with `.manifest`, or a list."""
    if isinstance(manifest, str | os.PathLike):
        manifest = read_manifest(manifest)
    manifest = getattr(manifest, "manifest", manifest)
    if isinstance(manifest, Manifest):
        return [r.bucket for r in manifest.rows]
    if isinstance(manifest, Sequence):
        return [tuple(getattr(r, "bucket", r)) for r in manifest]
    raise TypeError(f"manifest must be a Manifest, a manifest path, a dataset with .manifest or a sequence "
                    f"of buckets, got {type(manifest).__name__}")


def _count(name: str, value: Any, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    return value


class BucketBatchSampler(Sampler[list[int]]):
    """Index batches, each of one bucket, shuffled within and across buckets by seed and epoch."""

    def __init__(self, manifest: Any, batch_size: int, seed: int = 0, num_replicas: int | None = None,
                 rank: int | None = None, drop_last: bool = False, *, shuffle: bool = True,
                 pad: bool = False):
        self.buckets = _buckets_of(manifest)
        self.batch_size = _count("batch_size", batch_size, 1)
        self.seed = _count("seed", seed, 0)
        if num_replicas is None or rank is None:
            world, me = _world()
            num_replicas = world if num_replicas is None else num_replicas
            rank = me if rank is None else rank
        self.num_replicas = _count("num_replicas", num_replicas, 1)
        self.rank = _count("rank", rank, 0)
        if self.rank >= self.num_replicas:
            raise ValueError(f"rank must be in [0, {self.num_replicas - 1}] for num_replicas="
                             f"{self.num_replicas}, got {rank}")
        if drop_last and pad:
            raise ValueError("give drop_last=True (drop the uneven tail) or pad=True (repeat batches), not "
                             "both")
        self.drop_last, self.shuffle, self.pad = bool(drop_last), bool(shuffle), bool(pad)
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """The epoch whose order the next iteration gives (seeded with seed + epoch)."""
        self.epoch = _count("epoch", epoch, 0)

    def all_batches(self) -> list[list[int]]:
        """Every rank's batches of this epoch, in order, before they are dealt out."""
        import torch

        g = torch.Generator().manual_seed(self.seed + self.epoch)
        groups: dict[tuple[int, int], list[int]] = {}
        for i, b in enumerate(self.buckets):
            groups.setdefault(b, []).append(i)
        batches = []
        for b in sorted(groups):
            idx = groups[b]
            if self.shuffle:
                idx = [idx[j] for j in torch.randperm(len(idx), generator=g).tolist()]
            for k in range(0, len(idx), self.batch_size):
                batch = idx[k:k + self.batch_size]
                if len(batch) == self.batch_size or not self.drop_last:
                    batches.append(batch)
        if self.shuffle:
            batches = [batches[j] for j in torch.randperm(len(batches), generator=g).tolist()]
        return batches

    def _dealt(self) -> list[list[int]]:
        batches, r = self.all_batches(), self.num_replicas
        if self.drop_last:
            batches = batches[: len(batches) // r * r]
        elif self.pad and batches:
            extra = math.ceil(len(batches) / r) * r - len(batches)
            batches = batches + (batches * math.ceil(extra / len(batches)))[:extra]
        return batches[self.rank::r]

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self._dealt())

    def __len__(self) -> int:
        return len(self._dealt())


def _world() -> tuple[int, int]:
    """(world size, rank) of the default process group, (1, 0) without one."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0
