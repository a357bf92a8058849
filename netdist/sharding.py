"""PURE shard arithmetic shared by collectives, FSDP, the parameter server and checkpoints.

One rule everywhere: splitting ``total`` items over ``n`` owners gives the first
``total % n`` owners one extra item. Keeping a single definition means a reduce-scatter
shard, an FSDP flat-parameter shard and a checkpoint shard of the same tensor agree.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = [
    "chunk_sizes",
    "chunk_bounds",
    "padded_size",
    "shard_tensor",
    "gather_shards",
]


def chunk_sizes(total: int, n: int) -> list[int]:
    """Sizes of ``n`` contiguous chunks of ``total`` items, the first ``total % n`` larger."""
    if n < 1:
        raise ValueError(f"number of chunks must be >= 1, got {n}")
    if total < 0:
        raise ValueError(f"total must be >= 0, got {total}")
    base, extra = divmod(total, n)
    return [base + 1 if i < extra else base for i in range(n)]


def chunk_bounds(total: int, n: int) -> list[tuple[int, int]]:
    """``(start, stop)`` of each of ``n`` contiguous chunks of ``total`` items."""
    bounds = []
    start = 0
    for size in chunk_sizes(total, n):
        bounds.append((start, start + size))
        start += size
    return bounds


def padded_size(total: int, multiple: int) -> int:
    """Smallest size >= ``total`` that ``multiple`` divides (for flat-parameter padding)."""
    if multiple < 1:
        raise ValueError(f"multiple must be >= 1, got {multiple}")
    if total < 0:
        raise ValueError(f"total must be >= 0, got {total}")
    return -(-total // multiple) * multiple


def shard_tensor(array: np.ndarray, num_shards: int) -> list[np.ndarray]:
    """Split ``array`` along dim 0 into ``num_shards`` views, earlier shards one row longer.

    A 0-d array cannot be split: with ``num_shards == 1`` it is returned as the only
    shard, anything else is a ``ValueError``.
    """
    if not isinstance(num_shards, (int, np.integer)) or isinstance(num_shards, bool):
        raise TypeError(f"num_shards must be an int, got {type(num_shards).__name__}")
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    array = np.asarray(array)
    if array.ndim == 0:
        if num_shards != 1:
            raise ValueError(f"a 0-d array cannot be split into {num_shards} shards")
        return [array]
    rows = array.shape[0]
    if num_shards > max(rows, 1):
        raise ValueError(f"cannot split {rows} rows into {num_shards} non-empty shards")
    return [array[start:stop] for start, stop in chunk_bounds(rows, num_shards)]


def gather_shards(shards: Sequence[np.ndarray]) -> np.ndarray:
    """Concatenate shards along dim 0 (the inverse of ``shard_tensor``)."""
    if len(shards) == 0:
        raise ValueError("gather_shards needs at least one shard")
    arrays = [np.asarray(s) for s in shards]
    if len(arrays) == 1 and arrays[0].ndim == 0:
        return arrays[0].copy()
    trailing = arrays[0].shape[1:]
    for index, shard in enumerate(arrays):
        if shard.ndim == 0:
            raise ValueError(f"shard {index} is 0-d; only a single 0-d shard can be gathered")
        if shard.shape[1:] != trailing:
            raise ValueError(
                f"shard {index} has trailing shape {shard.shape[1:]}, expected {trailing}")
    return np.concatenate(arrays, axis=0)
