"""Demo data (scikit-learn's bundled 8x8 digits) and seeded per-rank sharding.

``shard_indices`` gives every rank a disjoint shard of one global permutation that all
ranks compute identically from ``(seed, epoch)``. Rank ``r`` of ``n`` takes positions
``r, r + n, r + 2n, ...`` of the permutation (torch's ``DistributedSampler`` layout), so
the union of the ranks' ``i``-th batches of size ``b`` is exactly the ``i``-th batch of
size ``n * b`` of a single process walking the same permutation. That is what makes
data-parallel training reproduce single-process training with the larger batch.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from netdist.errors import ConfigError

__all__ = [
    "Dataset",
    "load_digits_dataset",
    "epoch_permutation",
    "shard_indices",
    "iterate_batches",
]


@dataclass(frozen=True, slots=True)
class Dataset:
    """A train/test split: features ``(n, d)`` and integer labels ``(n,)``."""

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    num_classes: int

    @property
    def num_features(self) -> int:
        return int(self.x_train.shape[1])


def load_digits_dataset(*, seed: int = 0, test_fraction: float = 0.2,
                        dtype: Any = np.float64) -> Dataset:
    """Load the 1797 8x8 digit images that ship inside scikit-learn (no download).

    The split is a seeded permutation (the same on every rank for the same ``seed``).
    Pixels are standardised with the training set's per-pixel mean and standard
    deviation (pixels that are constant on the training set are only centred).
    """
    try:
        from sklearn.datasets import load_digits
    except ImportError as exc:  # pragma: no cover - scikit-learn is in the test extra
        raise ConfigError("the digits demo needs scikit-learn: pip install 'netdist[demo]'") from exc
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    digits = load_digits()
    x = np.asarray(digits.data, dtype=np.float64)
    y = np.asarray(digits.target, dtype=np.int64)
    order = np.random.default_rng(seed).permutation(len(x))
    n_test = int(round(len(x) * test_fraction))
    test, train = order[:n_test], order[n_test:]
    mean = x[train].mean(axis=0)
    std = x[train].std(axis=0)
    std[std == 0] = 1.0
    x = (x - mean) / std
    dt = np.dtype(dtype)
    return Dataset(
        x_train=np.ascontiguousarray(x[train], dtype=dt), y_train=y[train],
        x_test=np.ascontiguousarray(x[test], dtype=dt), y_test=y[test],
        num_classes=int(y.max()) + 1,
    )


def epoch_permutation(num_samples: int, epoch: int, seed: int) -> np.ndarray:
    """The global sample order of ``epoch``: identical on every rank for one ``seed``."""
    if num_samples < 0:
        raise ValueError(f"num_samples must be >= 0, got {num_samples}")
    if epoch < 0 or seed < 0:
        raise ValueError(f"epoch and seed must be >= 0, got epoch={epoch}, seed={seed}")
    return np.random.default_rng([seed, epoch]).permutation(num_samples)


def shard_indices(num_samples: int, rank: int, world_size: int, epoch: int,
                  seed: int) -> np.ndarray:
    """Sample indices rank ``rank`` trains on in ``epoch``: a disjoint, seeded shard.

    All ranks draw the same permutation of ``range(num_samples)`` from ``(seed, epoch)``,
    drop its last ``num_samples % world_size`` entries so that every rank gets the same
    number of samples (and so takes the same number of steps), and rank ``r`` keeps
    every ``world_size``-th entry starting at ``r``. The dropped samples change from
    epoch to epoch.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    perm = epoch_permutation(num_samples, epoch, seed)
    usable = num_samples - num_samples % world_size
    return perm[rank:usable:world_size]


def iterate_batches(indices: np.ndarray, batch_size: int, *,
                    drop_last: bool = False) -> Iterator[np.ndarray]:
    """Consecutive slices of ``indices`` of ``batch_size`` (the last may be shorter)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    stop = len(indices) - len(indices) % batch_size if drop_last else len(indices)
    for start in range(0, stop, batch_size):
        yield indices[start:start + batch_size]
