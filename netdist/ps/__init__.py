"""Parameter servers, in three modes.

1. ``ParameterServer(group)`` -- synchronous, rank 0 serves *and* trains (the seeds' API):
   ``broadcast_params(params)``, ``reduce_gradients(grads)`` / ``aggregate(grads)``.
2. ``PSServer`` / ``PSClient`` -- dedicated server ranks (``netdist ps-server``) holding
   parameters partitioned by key range, big tensors sliced across all servers, and
   running the optimizer on their shards: ``push(grads)``, ``pull()``, ``step(grads)``.
3. The same with ``max_staleness=k`` (bounded staleness) or ``None`` (fully async).

``ColocatedPS`` runs servers inside training ranks (every rank trains, the first ``S``
also serve); ``ServerOptimizerAggregator`` plugs the server-side optimizer into a
``distributed_train_step`` loop (the demo job's update paths over these modes are
``netdist.train.ps_paths``).

The PURE logic, one module per job:
``placement`` (which server holds which elements), ``messages`` (how an exchange is cut
into messages), ``shard`` (a server's parameters and optimizer), ``staleness`` (the
version clock and bounded-staleness rule), ``roles`` (which ranks serve, environment
knobs), ``faults`` (shard replicas and what a lost worker does) and ``protocol`` (tags
and headers). ``replication`` is the primary-backup channel of a replicated shard. The optimizer configs are
``netdist.optim``'s, shared with ``netdist.train`` and FSDP.

Every mode takes CPU torch tensors wherever it takes NumPy arrays (``netdist.tensors``),
and bfloat16 without ``ml_dtypes``: the rank-0 server averages it as torch does, the
sharded servers keep a float32 master copy (``ServerShard``).

Names resolve lazily (``netdist._lazy``): importing a PURE module such as
``netdist.ps.placement`` does not import the servers and clients, and with them asyncio.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

_EXPORTS: dict[str, str] = {
    "ParameterServer": "netdist.ps.parameter_server",
    "PSServer": "netdist.ps.server",
    "PSClient": "netdist.ps.client",
    "ColocatedPS": "netdist.ps.colocated",
    "ServerOptimizerAggregator": "netdist.ps.adapters",
    "max_staleness_from_env": "netdist.ps.roles",
    "PS_MAX_STALENESS_ENV": "netdist.ps.roles",
    "ServerReport": "netdist.ps.server",
    "serve": "netdist.ps.server",
    "SGDConfig": "netdist.optim",
    "AdamConfig": "netdist.optim",
    "OptimizerConfig": "netdist.optim",
    "ParamSpec": "netdist.ps.placement",
    "ShardSlice": "netdist.ps.placement",
    "ShardPlan": "netdist.ps.placement",
    "plan_shards": "netdist.ps.placement",
    "ShardOptimizer": "netdist.optim",
    "StalenessController": "netdist.ps.staleness",
    "VersionLogEntry": "netdist.ps.staleness",
    "PSRoles": "netdist.ps.roles",
    "ps_roles": "netdist.ps.roles",
    "num_servers_from_env": "netdist.ps.roles",
    "PS_SERVERS_ENV": "netdist.ps.roles",
    "DEFAULT_BIGARRAY_BOUND": "netdist.ps.placement",
    "WorkerLoss": "netdist.ps.faults",
    "ReplicaLayout": "netdist.ps.faults",
    "replicas_from_env": "netdist.ps.faults",
    "PS_REPLICAS_ENV": "netdist.ps.faults",
}

__all__ = [
    "ParameterServer",
    "PSServer",
    "PSClient",
    "ColocatedPS",
    "ServerOptimizerAggregator",
    "max_staleness_from_env",
    "PS_MAX_STALENESS_ENV",
    "ServerReport",
    "serve",
    "SGDConfig",
    "AdamConfig",
    "OptimizerConfig",
    "ParamSpec",
    "ShardSlice",
    "ShardPlan",
    "plan_shards",
    "ShardOptimizer",
    "StalenessController",
    "VersionLogEntry",
    "PSRoles",
    "ps_roles",
    "num_servers_from_env",
    "PS_SERVERS_ENV",
    "DEFAULT_BIGARRAY_BOUND",
    "WorkerLoss",
    "ReplicaLayout",
    "replicas_from_env",
    "PS_REPLICAS_ENV",
]

if TYPE_CHECKING:
    from netdist.optim import AdamConfig, OptimizerConfig, SGDConfig, ShardOptimizer
    from netdist.ps.adapters import ServerOptimizerAggregator
    from netdist.ps.client import PSClient
    from netdist.ps.faults import PS_REPLICAS_ENV, ReplicaLayout, WorkerLoss, replicas_from_env
    from netdist.ps.colocated import ColocatedPS
    from netdist.ps.parameter_server import ParameterServer
    from netdist.ps.placement import (
        DEFAULT_BIGARRAY_BOUND,
        ParamSpec,
        ShardPlan,
        ShardSlice,
        plan_shards,
    )
    from netdist.ps.roles import (
        PS_MAX_STALENESS_ENV,
        PS_SERVERS_ENV,
        PSRoles,
        max_staleness_from_env,
        num_servers_from_env,
        ps_roles,
    )
    from netdist.ps.server import PSServer, ServerReport, serve
    from netdist.ps.staleness import StalenessController, VersionLogEntry
else:
    from netdist._lazy import attach as _attach

    __getattr__, __dir__ = _attach(__name__, _EXPORTS)
