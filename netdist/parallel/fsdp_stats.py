"""PURE accounting for FSDP: the bytes it holds, the bytes a strategy would hold, and time.

``MemoryTracker`` allocates every buffer FSDP owns and counts it by category (params,
grads, optimizer state, gathered params, transient gradient buffers) with peaks;
``estimate_memory`` predicts the same categories for any ``ShardingPolicy`` from the unit
layouts; ``Timings`` adds up where the time of forward, backward and step went.
Nothing here imports ``asyncio`` or ``socket``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from netdist.parallel.flat_param import FlatParamLayout
from netdist.parallel.fsdp_strategy import ShardingPolicy, ShardingStrategy

__all__ = [
    "CATEGORIES",
    "MemoryEstimate",
    "MemoryStats",
    "FSDPTimings",
    "MemoryTracker",
    "Timings",
    "estimate_memory",
]

CATEGORIES = ("params", "grads", "optimizer", "gathered", "grad_buffers")
"""What ``MemoryTracker`` counts each buffer as."""


@dataclass(frozen=True, slots=True)
class MemoryEstimate:
    """Bytes one rank is expected to hold under ``strategy`` (from the unit layouts).

    ``params``/``grads``/``optimizer`` are held between steps; ``peak_gathered`` is the
    most gathered parameter memory alive at once (``prefetch_depth + 1`` units under
    FULL_SHARD/HYBRID_SHARD); ``peak_grad_buffers`` bounds the transient full-size
    gradient buffers of backward (the computing unit plus reductions in flight).
    """

    strategy: ShardingStrategy
    params: int
    grads: int
    optimizer: int
    peak_gathered: int
    peak_grad_buffers: int

    @property
    def persistent(self) -> int:
        """``params + grads + optimizer``."""
        return self.params + self.grads + self.optimizer

    @property
    def peak(self) -> int:
        """Upper bound on everything at once."""
        return self.persistent + self.peak_gathered + self.peak_grad_buffers


@dataclass(frozen=True, slots=True)
class MemoryStats:
    """Bytes FSDP actually holds on this rank now, and the peaks since the last reset."""

    params: int
    grads: int
    optimizer: int
    gathered: int
    grad_buffers: int
    peak_gathered: int
    peak_grad_buffers: int
    peak_total: int

    @property
    def persistent(self) -> int:
        """``params + grads + optimizer`` currently held."""
        return self.params + self.grads + self.optimizer

    @property
    def total(self) -> int:
        return self.persistent + self.gathered + self.grad_buffers


@dataclass(frozen=True, slots=True)
class FSDPTimings:
    """Where time went since the last ``reset_timings()`` (seconds, this rank).

    ``allgather_wait`` is time the caller was blocked waiting for parameter all-gathers
    (the part prefetch did *not* hide); ``reduce_wait`` the same for gradient
    reductions; ``step_allgather_wait`` for the post-step all-gathers of SHARD_GRAD_OP.
    """

    forward: float
    backward: float
    step: float
    compute: float
    allgather_wait: float
    reduce_wait: float
    step_allgather_wait: float
    allgathers: int
    allgather_bytes: int


@dataclass(slots=True)
class Timings:
    """The running sums behind ``FSDPTimings``."""

    forward: float = 0.0
    backward: float = 0.0
    step: float = 0.0
    compute: float = 0.0
    allgather_wait: float = 0.0
    reduce_wait: float = 0.0
    step_allgather_wait: float = 0.0
    allgathers: int = 0
    allgather_bytes: int = 0

    def snapshot(self) -> FSDPTimings:
        return FSDPTimings(self.forward, self.backward, self.step, self.compute,
                           self.allgather_wait, self.reduce_wait, self.step_allgather_wait,
                           self.allgathers, self.allgather_bytes)


class MemoryTracker:
    """Counts the bytes of every buffer FSDP allocates, by category, with peaks."""

    __slots__ = ("current", "peak", "peak_total", "_live")

    def __init__(self) -> None:
        self.current = dict.fromkeys(CATEGORIES, 0)
        self.peak = dict.fromkeys(CATEGORIES, 0)
        self.peak_total = 0
        self._live: dict[int, tuple[str, int]] = {}

    def alloc(self, category: str, numel: int, dtype: Any, *, zero: bool = True) -> np.ndarray:
        """A new 1-D buffer of ``numel`` elements, counted under ``category``."""
        array = np.zeros(numel, dtype) if zero else np.empty(numel, dtype)
        self._live[id(array)] = (category, array.nbytes)
        self.current[category] += array.nbytes
        self.peak[category] = max(self.peak[category], self.current[category])
        self.peak_total = max(self.peak_total, sum(self.current.values()))
        return array

    def free(self, array: np.ndarray | None) -> None:
        """Stop counting ``array`` (None, or a buffer not from ``alloc``: nothing)."""
        if array is None:
            return
        entry = self._live.pop(id(array), None)
        if entry is not None:
            self.current[entry[0]] -= entry[1]

    def free_category(self, category: str) -> None:
        """Forget every live buffer of ``category`` (after an aborted step)."""
        self._live = {k: v for k, v in self._live.items() if v[0] != category}
        self.current[category] = 0

    def reset_peaks(self) -> None:
        self.peak = dict(self.current)
        self.peak_total = sum(self.current.values())

    def stats(self) -> MemoryStats:
        cur, peak = self.current, self.peak
        return MemoryStats(cur["params"], cur["grads"], cur["optimizer"], cur["gathered"],
                           cur["grad_buffers"], peak["gathered"], peak["grad_buffers"],
                           self.peak_total)


def estimate_memory(policy: ShardingPolicy, layouts: Sequence[FlatParamLayout],
                    optimizer_states: int, prefetch_depth: int) -> MemoryEstimate:
    """Bytes one rank holds under ``policy`` for units of ``layouts`` (rebuilt for the
    policy's shard count), ``optimizer_states`` shard-sized state arrays per unit and
    ``prefetch_depth`` units gathered ahead."""
    shards, index = policy.num_shards, policy.shard_index
    params = grads = optim = 0
    padded, buffers = [], []
    for unit in layouts:
        layout = FlatParamLayout.build([s.name for s in unit.slots], [s.shape for s in unit.slots],
                                       unit.dtype, shards)
        item = layout.itemsize
        whole = layout.padded_numel * item
        shard = layout.shard_numel * item
        params += shard if policy.shards_parameters else whole
        grads += shard if policy.shards_gradients else whole
        optim += optimizer_states * layout.valid_numel(index) * item
        padded.append(whole)
        buffers.append(whole + (shard if shards > 1 else 0))
    gathered = 0
    if policy.shards_parameters and padded:
        window = min(prefetch_depth + 1, len(padded))
        gathered = max(sum(padded[i:i + window]) for i in range(len(padded) - window + 1))
    grad_buffers = 0
    if policy.shards_gradients and buffers:
        in_flight = 2 if prefetch_depth > 0 else 1
        grad_buffers = in_flight * max(buffers) * (2 if policy.num_replicas > 1 else 1)
    return MemoryEstimate(policy.strategy, params, grads, optim, gathered, grad_buffers)
