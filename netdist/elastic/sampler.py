"""PURE: a sampler that accounts for every sample across membership changes.

Each data epoch is a seeded permutation of the sample ids. A training step takes the
next ``global_batch`` ids of it and splits them among the step's members (contiguous,
``numpy.array_split`` order); the position (data epoch, cursor) advances only when the
step commits. So:

- a step that is discarded (a member was lost before it committed) hands its ids, the
  lost member's included, to the next attempt, split among whoever is a member then;
- a step that commits used every id of its global batch exactly once, whichever members
  took part;
- a joiner receives the position with the rest of the training state.

Every id is therefore used exactly once per data epoch however the membership changed,
and the global batch (hence the learning dynamics) does not depend on the group size.
The position is two integers, carried as ``state_array()`` in the elastic state.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

__all__ = ["ElasticSampler"]


@dataclass
class ElasticSampler:
    """Per-step sample ids for each member; see the module docstring."""

    num_samples: int
    global_batch: int
    seed: int = 0
    data_epoch: int = 0
    cursor: int = 0
    _perm: tuple[int, np.ndarray] | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.num_samples < 1:
            raise ValueError(f"num_samples must be >= 1, got {self.num_samples}")
        if not 1 <= self.global_batch <= self.num_samples:
            raise ValueError(f"global_batch must be in 1..{self.num_samples}, got "
                             f"{self.global_batch}")

    def permutation(self) -> np.ndarray:
        """The order of the ids in the current data epoch (the same on every member)."""
        if self._perm is None or self._perm[0] != self.data_epoch:
            rng = np.random.default_rng([self.seed, self.data_epoch])
            self._perm = (self.data_epoch, rng.permutation(self.num_samples))
        return self._perm[1]

    def global_ids(self) -> np.ndarray:
        """The ids of the next step, all members together (shorter at an epoch's end)."""
        return self.permutation()[self.cursor:self.cursor + self.global_batch]

    def batch(self, rank: int, world_size: int) -> np.ndarray:
        """This member's ids of the next step (may be empty when members outnumber ids)."""
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside 0..{world_size - 1}")
        return np.array_split(self.global_ids(), world_size)[rank]

    def advance(self) -> None:
        """The step committed: move past its ids (into the next data epoch at the end)."""
        self.cursor += len(self.global_ids())
        if self.cursor >= self.num_samples:
            self.data_epoch += 1
            self.cursor = 0

    def state_array(self) -> np.ndarray:
        """The position as ``int64[2]`` (data epoch, cursor), to carry in the state."""
        return np.array([self.data_epoch, self.cursor], dtype=np.int64)

    def load_state_array(self, array: np.ndarray) -> None:
        """Take the position from ``state_array()``'s layout."""
        self.data_epoch, self.cursor = (int(v) for v in np.asarray(array).reshape(2))
