"""The demo job's parameter-server update paths (``--aggregator ps | ps-sharded | ps-async``).

``demo_update_path(name, group, model, config)`` builds the aggregator and apply step of
one mode from ``netdist.ps``; ``netdist.train.digits_job`` calls it for ``ps-sharded`` /
``ps-async``. It lives in ``netdist.train`` because it composes the parameter server with
a training loop (``train`` sits above ``ps``). It only relies on the duck-typed surface
of the training kit -- ``model.parameters()`` yielding objects with ``.data`` and
``.grad`` arrays, ``config.lr`` / ``.momentum`` / ``.weight_decay`` / ``.timeout`` -- so
any model with that surface can use it. Server counts and the staleness bound come from
the environment:

- ``NETDIST_PS_SERVERS``: co-located servers for ``ps-sharded`` / ``ps-async``
  (default ``min(2, world size)``);
- ``NETDIST_PS_MAX_STALENESS``: the bound for ``ps-async`` (default 2; ``none`` for
  fully asynchronous).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from netdist.errors import ConfigError
from netdist.optim import SGDConfig, ShardOptimizer
from netdist.ps import (
    ColocatedPS,
    ParameterServer,
    ServerOptimizerAggregator,
    max_staleness_from_env,
    num_servers_from_env,
)

if TYPE_CHECKING:
    from netdist.collectives import Group
    from netdist.transport.base import Transport

__all__ = ["UpdateHooks", "demo_update_path"]


@dataclass(frozen=True, slots=True)
class UpdateHooks:
    """What a training loop needs from one update mode (the demo's ``UpdatePath`` shape)."""

    aggregator: Any
    apply: Callable[[list[np.ndarray]], Any]
    close: Callable[[], Any] | None = None
    state: Callable[[], dict[str, Any]] | None = None


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


async def demo_update_path(name: str, group: Group | Transport, model: Any,
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
        return await _sync_path(group, params, config, timeout)
    if name in ("ps-sharded", "ps-async"):
        return await _colocated_path(name, group, params, config, timeout)
    raise ConfigError(f"netdist.ps has no update path named {name!r} "
                      "(choose ps, ps-sharded or ps-async)")


async def _sync_path(group: Group | Transport, params: list[Any], config: Any,
                     timeout: float | None) -> UpdateHooks:
    server = ParameterServer(group, timeout=timeout)
    await server.broadcast_params([p.data for p in params])
    optimizers = [ShardOptimizer(_sgd_config(config), p.data.size, p.data.dtype)
                  for p in params]

    def apply(averaged: list[np.ndarray]) -> None:
        for p, opt, g in zip(params, optimizers, averaged):
            opt.step(p.data.reshape(-1), np.ascontiguousarray(g).reshape(-1))

    return UpdateHooks(server, apply, close=server.aclose)


async def _colocated_path(name: str, group: Group | Transport, params: list[Any],
                          config: Any, timeout: float | None) -> UpdateHooks:
    world = len(group.ranks) if hasattr(group, "ranks") else group.world_size
    servers = num_servers_from_env(world_size=world, colocated=True)
    staleness = 0 if name == "ps-sharded" else max_staleness_from_env()
    ps = ColocatedPS(group, num_servers=min(servers, world), timeout=timeout)
    aggregator = ServerOptimizerAggregator(ps, optimizer=_sgd_config(config),
                                           max_staleness=staleness)
    try:  # registers the model; the first worker's values land in every p.data
        await aggregator.init([p.data for p in params])
    except BaseException as exc:
        await ps.abort(f"init failed: {exc}")
        raise

    def copy_params(new_params: list[np.ndarray]) -> None:
        for p, value in zip(params, new_params):
            if value is not p.data:
                np.copyto(p.data, value)

    async def close() -> None:
        await ps.close()

    return UpdateHooks(aggregator, copy_params, close=close)
