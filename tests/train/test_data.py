"""Digits loading and seeded per-rank sharding."""

from __future__ import annotations

import numpy as np
import pytest

from netdist.train.data import (
    epoch_permutation,
    iterate_batches,
    load_digits_dataset,
    shard_indices,
)


def test_digits_split_is_seeded_and_standardised():
    a = load_digits_dataset(seed=3)
    b = load_digits_dataset(seed=3)
    c = load_digits_dataset(seed=4)
    assert a.x_train.shape == (1438, 64) and a.x_test.shape == (359, 64)
    assert a.num_classes == 10 and a.num_features == 64
    np.testing.assert_array_equal(a.x_train, b.x_train)
    np.testing.assert_array_equal(a.y_test, b.y_test)
    assert not np.array_equal(a.y_test, c.y_test)
    np.testing.assert_allclose(a.x_train.mean(axis=0), 0.0, atol=1e-12)
    assert set(np.unique(a.y_train)) == set(range(10))
    assert load_digits_dataset(dtype=np.float32).x_train.dtype == np.float32


@pytest.mark.parametrize("num_samples,world_size", [(100, 1), (100, 3), (1438, 4), (7, 7)])
def test_shards_are_disjoint_equal_and_cover_all_but_the_remainder(num_samples, world_size):
    shards = [shard_indices(num_samples, r, world_size, epoch=2, seed=5)
              for r in range(world_size)]
    sizes = {len(s) for s in shards}
    assert sizes == {num_samples // world_size}
    union = np.concatenate(shards)
    assert len(np.unique(union)) == len(union) == num_samples - num_samples % world_size
    assert union.min() >= 0 and union.max() < num_samples


def test_shards_change_per_epoch_and_seed_but_not_per_call():
    a = shard_indices(50, 1, 2, epoch=0, seed=0)
    np.testing.assert_array_equal(a, shard_indices(50, 1, 2, epoch=0, seed=0))
    assert not np.array_equal(a, shard_indices(50, 1, 2, epoch=1, seed=0))
    assert not np.array_equal(a, shard_indices(50, 1, 2, epoch=0, seed=1))


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_union_of_rank_batches_is_the_global_batch(world_size):
    """Batch i of every rank together == batch i of size n*b of one process."""
    b = 5
    num = 103
    perm = epoch_permutation(num, 1, 9)
    usable = num - num % world_size
    global_batches = list(iterate_batches(perm[:usable], world_size * b))
    per_rank = [list(iterate_batches(shard_indices(num, r, world_size, 1, 9), b))
                for r in range(world_size)]
    assert all(len(batches) == len(global_batches) for batches in per_rank)
    for i, gb in enumerate(global_batches):
        together = np.concatenate([per_rank[r][i] for r in range(world_size)])
        np.testing.assert_array_equal(np.sort(together), np.sort(gb))


def test_iterate_batches():
    idx = np.arange(10)
    assert [list(b) for b in iterate_batches(idx, 4)] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert len(list(iterate_batches(idx, 4, drop_last=True))) == 2
    with pytest.raises(ValueError):
        list(iterate_batches(idx, 0))


def test_shard_validation():
    with pytest.raises(ValueError):
        shard_indices(10, 2, 2, 0, 0)
    with pytest.raises(ValueError):
        shard_indices(10, 0, 0, 0, 0)
    with pytest.raises(ValueError):
        epoch_permutation(10, -1, 0)
