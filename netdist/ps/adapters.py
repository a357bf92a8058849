"""Plugging the parameter-server modes into a training loop's aggregator slot.

Two shapes of update exist:

- the sync rank-0 ``ParameterServer`` *is* a ``GradientAggregator``: ``aggregate(grads)``
  returns averaged gradients and the training loop runs its own optimizer;
- with dedicated or co-located servers the optimizer runs on the servers, so the
  adapter ``ServerOptimizerAggregator.aggregate(grads)`` returns the *new parameters*
  (``returns_parameters = True``); the loop's apply step copies them into the model
  (nothing to copy when the adapter was built with ``out=`` the model's own arrays or
  tensors, or ``init``-ed with them).

The ``netdist demo`` job's update paths over these (``--aggregator ps | ps-sharded |
ps-async``) are composed in ``netdist.train.ps_paths``: ``netdist.ps`` stays below
``netdist.train`` in the layering.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from netdist.optim import AdamConfig, OptimizerConfig, SGDConfig
from netdist.ps.placement import DEFAULT_BIGARRAY_BOUND
from netdist.tensors import as_array, stage_out

__all__ = ["ServerOptimizerAggregator"]


class _Stepper(Protocol):
    @property
    def bytes_sent(self) -> int: ...

    async def init(self, params: Any, *, optimizer: OptimizerConfig,
                   max_staleness: int | None = 0,
                   bigarray_bound: int = DEFAULT_BIGARRAY_BOUND) -> list[Any]: ...

    async def pull(self, *, out: Sequence[Any] | None = None) -> list[Any]: ...

    async def step(self, grads: Sequence[Any], *,
                   out: Sequence[Any] | None = None) -> list[Any]: ...


class ServerOptimizerAggregator:
    """``GradientAggregator``-shaped adapter whose ``aggregate`` returns new parameters.

    Wraps a ``PSClient`` or ``ColocatedPS``: ``aggregate(grads)`` is ``step(grads)``.
    With ``out`` (the model's parameter arrays or CPU torch tensors) the parameters are
    written in place and ``out`` is returned, so the apply step has nothing left to do.

    Two ways to start: initialise the client yourself and pass ``out=``; or pass
    ``optimizer=`` (and ``max_staleness``, ``bigarray_bound``, as for ``PSClient.init``)
    and call ``init(params)``, which registers ``params`` with the servers, writes the
    initial parameters (the first worker's values) into them and makes them ``out``.
    ``netdist.torch.gradient_sync.GradientSync`` calls ``init`` with the model's parameters.
    """

    returns_parameters = True

    def __init__(self, client: _Stepper, *, out: Sequence[Any] | None = None,
                 optimizer: OptimizerConfig | None = None, max_staleness: int | None = 0,
                 bigarray_bound: int = DEFAULT_BIGARRAY_BOUND) -> None:
        if optimizer is not None and not isinstance(optimizer, (SGDConfig, AdamConfig)):
            raise TypeError("optimizer must be an SGDConfig or AdamConfig, got "
                            f"{type(optimizer).__name__}")
        self.client = client
        self.out = None if out is None else list(out)
        self.optimizer = optimizer
        self.max_staleness = max_staleness
        self.bigarray_bound = bigarray_bound
        self._registered = False
        """``init`` has registered the model with the servers (a second ``init`` pulls)."""

    @property
    def bytes_sent(self) -> int:
        return int(self.client.bytes_sent)

    async def init(self, params: Sequence[Any]) -> list[Any]:
        """Make ``params`` (arrays or CPU tensors, written in place) the servers' model.

        With ``optimizer=`` given at construction: ``client.init(params, ...)`` (every
        worker calls it; the first worker's values become the initial parameters) and
        the initial parameters are copied into ``params``. Without it, or on a second
        call, the client must already be initialised, and ``params`` get the servers'
        current values (a pull).
        Either way ``params`` become ``out``, so every ``aggregate`` writes into them.
        Returns ``params``.
        """
        params = list(params)
        if self.optimizer is None or self._registered:
            await self.client.pull(out=params)
        else:
            initial = await self.client.init(params, optimizer=self.optimizer,
                                             max_staleness=self.max_staleness,
                                             bigarray_bound=self.bigarray_bound)
            self._registered = True
            for index, (target, value) in enumerate(zip(params, initial)):
                _copy_into(target, value, f"ServerOptimizerAggregator.init: parameter {index}")
        self.out = params
        return params

    async def aggregate(self, grads: list[Any]) -> list[Any]:
        """Push ``grads``, return the servers' updated parameters."""
        return await self.client.step(grads, out=self.out)

    async def step(self, grads: list[Any]) -> list[Any]:
        return await self.aggregate(grads)


def _copy_into(target: Any, value: Any, what: str) -> None:
    """``target[...] = value`` for arrays and CPU tensors (through ``netdist.tensors``; a
    non-contiguous target tensor through a contiguous copy that is copied back)."""
    source = value if isinstance(value, np.ndarray) else as_array(value, what)
    if isinstance(target, np.ndarray):
        np.copyto(target, source)
        return
    staged = stage_out(target, what)
    np.copyto(staged.array, source)
    staged.finish()
