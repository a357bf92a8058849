"""Plugging the parameter-server modes into a ``distributed_train_step`` loop.

Two shapes of update exist:

- the sync rank-0 ``ParameterServer`` *is* a ``GradientAggregator``: ``aggregate(grads)``
  returns averaged gradients and the training loop runs its own optimizer;
- with dedicated or co-located servers the optimizer runs on the servers, so the
  adapter ``ServerOptimizerAggregator.aggregate(grads)`` returns the *new parameters*
  (``returns_parameters = True``); the loop's apply step copies them into the model
  (nothing to copy when the adapter was built with ``out=`` the model's own arrays or
  tensors, or ``init``-ed with them).

``demo_update_path(name, group, model, config)`` builds either for the ``netdist demo``
job (``--aggregator ps | ps-sharded | ps-async``). It only relies on the duck-typed
surface of the training kit -- ``model.parameters()`` yielding objects with ``.data`` and
``.grad`` arrays, ``config.lr`` / ``.momentum`` / ``.weight_decay`` / ``.timeout`` -- so
``netdist.ps`` stays below ``netdist.train`` in the layering. Server counts and the
staleness bound come from the environment:

- ``NETDIST_PS_SERVERS``: co-located servers for ``ps-sharded`` / ``ps-async``
  (default ``min(2, world size)``);
- ``NETDIST_PS_MAX_STALENESS``: the bound for ``ps-async`` (default 2; ``none`` for
  fully asynchronous).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from netdist.errors import ConfigError
from netdist.ps._link import GroupLike
from netdist.ps.colocated import ColocatedPS
from netdist.ps.state import (
    DEFAULT_BIGARRAY_BOUND,
    AdamConfig,
    OptimizerConfig,
    SGDConfig,
    ShardOptimizer,
    num_servers_from_env,
)
from netdist.ps.sync import ParameterServer
from netdist.tensors import as_array, stage_out
from netdist.transport.base import Transport

__all__ = [
    "ServerOptimizerAggregator",
    "UpdateHooks",
    "demo_update_path",
    "PS_MAX_STALENESS_ENV",
    "max_staleness_from_env",
]

PS_MAX_STALENESS_ENV = "NETDIST_PS_MAX_STALENESS"


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
    ``netdist.torch.sync.GradientSync`` calls ``init`` with the model's parameters.
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


@dataclass(frozen=True, slots=True)
class UpdateHooks:
    """What a training loop needs from one update mode (the demo's ``UpdatePath`` shape)."""

    aggregator: Any
    apply: Callable[[list[np.ndarray]], Any]
    close: Callable[[], Any] | None = None
    state: Callable[[], dict[str, Any]] | None = None


def max_staleness_from_env(environ: Mapping[str, str] | None = None, *,
                           default: int | None = 2) -> int | None:
    """Read ``NETDIST_PS_MAX_STALENESS`` (an int >= 0, or ``none``)."""
    env = os.environ if environ is None else environ
    text = env.get(PS_MAX_STALENESS_ENV, "").strip().lower()
    if not text:
        return default
    if text in ("none", "inf", "async"):
        return None
    try:
        value = int(text)
    except ValueError:
        raise ConfigError(f"{PS_MAX_STALENESS_ENV}={text!r} is not an integer or 'none'") from None
    if value < 0:
        raise ConfigError(f"{PS_MAX_STALENESS_ENV} must be >= 0, got {value}")
    return value


def _contiguous_data(model: Any) -> list[Any]:
    params = list(model.parameters())
    for p in params:
        if not (isinstance(p.data, np.ndarray) and p.data.flags.c_contiguous
                and p.data.flags.writeable):
            raise ValueError(f"parameter {getattr(p, 'name', '?')!r} must be a C-contiguous, "
                             "writable numpy array")
    return params


def _sgd_config(config: Any) -> SGDConfig:
    return SGDConfig(lr=float(config.lr), momentum=float(getattr(config, "momentum", 0.0)),
                     weight_decay=float(getattr(config, "weight_decay", 0.0)))


async def demo_update_path(name: str, group: GroupLike | Transport, model: Any,
                           config: Any) -> UpdateHooks:
    """The update path for ``--aggregator name`` (``ps``, ``ps-sharded``, ``ps-async``).

    ``ps``: rank 0 broadcasts its parameters, ``ParameterServer`` averages gradients,
    every rank applies SGD (torch's rule, as ``netdist.train.SGD``) locally.
    ``ps-sharded`` / ``ps-async``: ``ColocatedPS`` with SGD on the servers,
    ``max_staleness`` 0 or ``NETDIST_PS_MAX_STALENESS``.
    """
    params = _contiguous_data(model)
    timeout = getattr(config, "timeout", None)
    if name == "ps":
        server = ParameterServer(group, timeout=timeout)
        await server.broadcast_params([p.data for p in params])
        optimizers = [ShardOptimizer(_sgd_config(config), p.data.size, p.data.dtype)
                      for p in params]

        def apply(averaged: list[np.ndarray]) -> None:
            for p, opt, g in zip(params, optimizers, averaged):
                opt.step(p.data.reshape(-1), np.ascontiguousarray(g).reshape(-1))

        return UpdateHooks(server, apply, close=server.aclose)
    if name in ("ps-sharded", "ps-async"):
        world = len(group.ranks) if hasattr(group, "ranks") else group.world_size
        servers = num_servers_from_env(world_size=world, colocated=True)
        staleness = 0 if name == "ps-sharded" else max_staleness_from_env()
        ps = ColocatedPS(group, num_servers=min(servers, world), timeout=timeout)
        data = [p.data for p in params]
        try:
            initial = await ps.init(data, optimizer=_sgd_config(config),
                                    max_staleness=staleness)
        except BaseException as exc:
            await ps.abort(f"init failed: {exc}")
            raise
        for array, value in zip(data, initial):
            np.copyto(array, value)
        aggregator = ServerOptimizerAggregator(ps, out=data)

        def copy_params(new_params: list[np.ndarray]) -> None:
            for p, value in zip(params, new_params):
                if value is not p.data:
                    np.copyto(p.data, value)

        async def close() -> None:
            await ps.close()

        return UpdateHooks(aggregator, copy_params, close=close)
    raise ConfigError(f"netdist.ps has no update path named {name!r} "
                      "(choose ps, ps-sharded or ps-async)")
