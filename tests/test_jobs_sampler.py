"""BucketBatchSampler (issue #32): batches of one bucket; each epoch covers every index once over all ranks
(nothing dropped or repeated unless asked), seeded by seed and epoch, as DistributedSampler shares."""

from collections import Counter

import pytest
from jobs_support import make_images, write_folder

from tilewise.jobs import BucketBatchSampler, bucket_dataset


@pytest.fixture(scope="module")
def manifest(tmp_path_factory):
    folder = write_folder(tmp_path_factory.mktemp("photos"), make_images(200), corrupt=False)
    return bucket_dataset(folder, None, area=64 * 64, step=16, progress=False).manifest


def _epoch(manifest, world, epoch=0, **kw):
    out = []
    for rank in range(world):
        s = BucketBatchSampler(manifest, 8, seed=3, num_replicas=world, rank=rank, **kw)
        s.set_epoch(epoch)
        batches = list(s)
        assert len(batches) == len(s)
        out.append(batches)
    return out


@pytest.mark.parametrize("world", [1, 2, 3])
def test_every_index_once_per_epoch_over_the_ranks(manifest, world):
    buckets = [r.bucket for r in manifest.rows]
    per_rank = _epoch(manifest, world)
    seen = Counter(i for batches in per_rank for b in batches for i in b)
    assert seen == Counter(range(len(manifest.rows)))  # nothing dropped, nothing repeated
    for batches in per_rank:
        for b in batches:
            assert len({buckets[i] for i in b}) == 1 and 1 <= len(b) <= 8
    # each bucket has at most one short batch, and the ranks' shares differ by at most one batch
    shorts = Counter(buckets[b[0]] for bs in per_rank for b in bs if len(b) < 8)
    assert max(shorts.values(), default=1) == 1
    sizes = [len(b) for b in per_rank]
    assert max(sizes) - min(sizes) <= 1


def test_epochs_and_seeds_shuffle_within_and_across_buckets(manifest):
    e0, e0_again, e1 = _epoch(manifest, 1, 0)[0], _epoch(manifest, 1, 0)[0], _epoch(manifest, 1, 1)[0]
    assert e0 == e0_again and e0 != e1
    assert [b[0] for b in e0] != sorted(b[0] for b in e0)  # across buckets: batch order is not index order
    buckets = [manifest.rows[b[0]].bucket for b in e0]
    assert buckets != sorted(buckets)  # buckets are interleaved, not one after another
    assert any(b != sorted(b) for b in e0)  # within a bucket: indices are shuffled
    other = BucketBatchSampler(manifest, 8, seed=4, num_replicas=1, rank=0)
    assert list(other) != e0
    plain = list(BucketBatchSampler(manifest, 8, shuffle=False, num_replicas=1, rank=0))
    assert [i for b in plain for i in b] == sorted(range(len(manifest.rows)), key=lambda i: (
        manifest.rows[i].bucket, i))


def test_drop_last_and_pad_give_every_rank_the_same_count(manifest):
    dropped = _epoch(manifest, 3, drop_last=True)
    assert len({len(b) for b in dropped}) == 1
    assert all(len(b) == 8 for bs in dropped for b in bs)
    padded = _epoch(manifest, 3, pad=True)
    assert len({len(b) for b in padded}) == 1
    seen = Counter(i for bs in padded for b in bs for i in b)
    assert set(seen) == set(range(len(manifest.rows)))  # all covered, a few repeated (asked for)


def test_bad_arguments_are_refused_naming_them(manifest):
    with pytest.raises(ValueError, match="batch_size"):
        BucketBatchSampler(manifest, 0)
    with pytest.raises(ValueError, match=r"rank must be in \[0, 1\]"):
        BucketBatchSampler(manifest, 4, num_replicas=2, rank=2)
    with pytest.raises(ValueError, match="not both"):
        BucketBatchSampler(manifest, 4, drop_last=True, pad=True)
    with pytest.raises(TypeError, match="manifest must be"):
        BucketBatchSampler(42, 4)


def test_a_dataloader_over_the_manifest_gives_bucket_sized_images(manifest):
    from torch.utils.data import DataLoader

    from tilewise.jobs import ManifestDataset

    ds = ManifestDataset(manifest)
    loader = DataLoader(ds, batch_sampler=BucketBatchSampler(ds, 4, seed=0, num_replicas=8, rank=5))
    for batch in loader:
        row = next(r for r in manifest.rows if r.key == batch["key"][0])
        w, h = row.bucket
        assert batch["pixels"].shape[1:] == (3, h, w) and batch["mask"].shape[1:] == (h // 8, w // 8)
        assert batch["pixels"].min() >= -1 and batch["pixels"].max() <= 1
        assert batch["target_size"][0].tolist() == list(row.micro_conditioning["target_size"])
