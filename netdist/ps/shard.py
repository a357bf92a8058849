"""PURE state of one parameter server: its flat shard, master parameters and optimizer.

``ServerShard`` is what a server holds: the master parameters, the optimizer
(``netdist.optim.ShardOptimizer``) and the values workers pull. bfloat16 parameters keep
a float32 master copy and float32 optimizer state (mixed-precision training's master
weights; ``master_dtype``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from netdist.optim import OptimizerConfig, ShardOptimizer
from netdist.ps.placement import is_floating
from netdist.bfloat16 import bfloat16_to_float32, float32_to_bfloat16
from netdist.types import dtype_from_wire, is_bfloat16

__all__ = ["master_dtype", "ServerShard"]


def master_dtype(wire_dtype: str) -> np.dtype[Any]:
    """The dtype a server keeps parameters of wire dtype ``wire_dtype`` in.

    float32 for bfloat16 (as mixed-precision training keeps float32 master weights: an
    update smaller than half a bfloat16 ulp of the weight would otherwise be lost, and
    NumPy has no bfloat16 arithmetic without ``ml_dtypes``); the dtype itself otherwise.
    """
    dtype = dtype_from_wire(wire_dtype)
    return np.dtype(np.float32) if is_bfloat16(dtype) else dtype


class ServerShard:
    """One server's flat shard: master parameters, optimizer, and what workers pull.

    ``initial`` holds the shard's initial values in the wire dtype. ``apply(grads,
    divisor)`` sums the given gradients (wire dtype) in the order given, divides by
    ``divisor`` and runs the optimizer on the master parameters; ``wire`` then holds the
    values workers pull.

    For float16/32/64 the master *is* the wire buffer and the arithmetic is exactly
    ``netdist.train.optimizers``'s in that dtype, as before. For bfloat16 the server keeps
    float32 master parameters and float32 optimizer state (``master_dtype``): each
    gradient is widened to float32 (exact), they are summed in float32 in the given
    order and divided once, the float32 optimizer step updates the master, and ``wire``
    is the master rounded to bfloat16 to nearest even, as ``tensor.to(torch.bfloat16)``
    rounds. So a bfloat16 model trained through the servers follows float32 training
    of its master weights, and workers get bfloat16 back.
    """

    def __init__(self, config: OptimizerConfig, initial: np.ndarray) -> None:
        if initial.ndim != 1:
            raise ValueError(f"a server shard is flat, got shape {initial.shape}")
        if not is_floating(initial.dtype):
            raise TypeError(f"parameters must be floating point, got {initial.dtype}")
        self.wire = initial
        """The shard as workers pull it (wire dtype)."""
        self.mixed = is_bfloat16(initial.dtype)
        """True when ``master`` is a float32 copy of bfloat16 parameters."""
        self.master = bfloat16_to_float32(initial) if self.mixed else initial
        """The parameters the optimizer updates (``wire`` itself unless ``mixed``)."""
        size = int(initial.size)
        self.optimizer = ShardOptimizer(config, size, self.master.dtype)
        self._acc = np.empty(size, self.master.dtype)
        self._wide = np.empty(size, np.float32) if self.mixed else None

    @property
    def size(self) -> int:
        return int(self.wire.size)

    def apply(self, grads: Sequence[np.ndarray], divisor: int) -> None:
        """One update from ``grads`` (flat, wire dtype), summed in order, divided once."""
        if not grads:
            raise ValueError("an update needs at least one gradient")
        acc = self._acc
        if self._wide is None:
            if len(grads) == 1:
                np.copyto(acc, grads[0])
            else:  # same bits as copy-then-add, one pass fewer
                np.add(grads[0], grads[1], out=acc)
            for g in grads[2:]:
                np.add(acc, g, out=acc)
        else:
            bfloat16_to_float32(grads[0], out=acc)
            for g in grads[1:]:
                np.add(acc, bfloat16_to_float32(g, out=self._wide), out=acc)
        np.divide(acc, divisor, out=acc)
        self.optimizer.step(self.master, acc)
        if self.mixed:
            float32_to_bfloat16(self.master, out=self.wire)
