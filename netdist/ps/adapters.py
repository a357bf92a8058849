"""Plugging the parameter-server modes into a ``distributed_train_step`` loop.

Two shapes of update exist:

- the sync rank-0 ``ParameterServer`` *is* a ``GradientAggregator``: ``aggregate(grads)``
  returns averaged gradients and the training loop runs its own optimizer;
- with dedicated or co-located servers the optimizer runs on the servers, so the
  adapter ``ServerOptimizerAggregator.aggregate(grads)`` returns the *new parameters*
  (``returns_parameters = True``); the loop's apply step copies them into the model
  (nothing to copy when the adapter was built with ``out=`` the model's own arrays).

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
from netdist.ps.state import SGDConfig, ShardOptimizer, num_servers_from_env
from netdist.ps.sync import ParameterServer
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

    async def step(self, grads: Sequence[np.ndarray], *,
                   out: Sequence[np.ndarray] | None = None) -> list[np.ndarray]: ...


class ServerOptimizerAggregator:
    """``GradientAggregator``-shaped adapter whose ``aggregate`` returns new parameters.

    Wraps a ``PSClient`` or ``ColocatedPS``: ``aggregate(grads)`` is ``step(grads)``.
    With ``out`` (the model's parameter arrays) the parameters are written in place and
    ``out`` is returned, so the apply step has nothing left to do.
    """

    returns_parameters = True

    def __init__(self, client: _Stepper, *, out: Sequence[np.ndarray] | None = None) -> None:
        self.client = client
        self.out = None if out is None else list(out)

    @property
    def bytes_sent(self) -> int:
        return int(self.client.bytes_sent)

    async def aggregate(self, grads: list[np.ndarray]) -> list[np.ndarray]:
        """Push ``grads``, return the servers' updated parameters."""
        return await self.client.step(grads, out=self.out)

    async def step(self, grads: list[np.ndarray]) -> list[np.ndarray]:
        return await self.aggregate(grads)


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
