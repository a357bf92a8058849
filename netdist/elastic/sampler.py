"""PURE: a sampler that accounts for every sample across membership changes.

Each data epoch is a seeded permutation of the sample ids. A training step takes the
next ``global_batch`` ids of it and splits them among the step's members (contiguous,
``numpy.array_split`` order); the position (data epoch, cursor) advances only when the
step commits. So:

- a step that is discarded (a member was lost before it committed) hands its ids, the
  lost member's included, to the next attempt, split among whoever is a member then;
- a step that commits used every id of its global batch exactly once, whichever members
  took part; a step that commits *without* a lost member's share (the survivors
  finished the step's all-reduce without it, ``ElasticJob``'s resumed step) hands that
  share back (``advance(skipped=...)``): those ids come first in the next step, within
  the same data epoch;
- a joiner receives the position with the rest of the training state.

Every id is therefore used exactly once per data epoch however the membership changed,
and the global batch (hence the learning dynamics) does not depend on the group size.
The position (data epoch, cursor and the handed-back ids) is carried as ``state_array()``
in the elastic state.
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
    deferred: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    """Ids handed back by a step that committed without them; served first."""
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
        """The ids of the next step, all members together (shorter at an epoch's end):
        handed-back ids first, then the permutation from the cursor."""
        fresh = self.permutation()[self.cursor:
                                   self.cursor + self.global_batch - len(self.deferred)]
        return np.concatenate([self.deferred, fresh]).astype(np.int64, copy=False)

    def batch(self, rank: int, world_size: int) -> np.ndarray:
        """This member's ids of the next step (may be empty when members outnumber ids)."""
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside 0..{world_size - 1}")
        return np.array_split(self.global_ids(), world_size)[rank]

    def advance(self, skipped: np.ndarray | None = None) -> None:
        """The step committed: move past its ids (into the next data epoch at the end).

        ``skipped`` are ids of this step that no member used (a lost member's share);
        they are handed back and served first by the next step.
        """
        ids = self.global_ids()
        taken = len(ids) - len(self.deferred)
        self.cursor += taken
        back = np.zeros(0, dtype=np.int64) if skipped is None else np.asarray(skipped, np.int64)
        if not np.isin(back, ids).all():
            raise ValueError("skipped ids must belong to the step")
        self.deferred = back.copy()
        if self.cursor >= self.num_samples and not len(self.deferred):
            self.data_epoch += 1
            self.cursor = 0

    def state_array(self) -> np.ndarray:
        """The position as ``int64[3 + global_batch]``: data epoch, cursor, the number of
        handed-back ids and the ids (padded), to carry in the state."""
        out = np.zeros(3 + self.global_batch, dtype=np.int64)
        out[:3] = self.data_epoch, self.cursor, len(self.deferred)
        out[3:3 + len(self.deferred)] = self.deferred
        return out

    def load_state_array(self, array: np.ndarray) -> None:
        """Take the position from ``state_array()``'s layout."""
        values = np.asarray(array, dtype=np.int64).reshape(-1)
        self.data_epoch, self.cursor, count = (int(v) for v in values[:3])
        self.deferred = values[3:3 + count].copy()
