"""Parameter servers, in three modes.

1. ``ParameterServer(group)`` -- synchronous, rank 0 serves *and* trains (the seeds' API):
   ``broadcast_params(params)``, ``reduce_gradients(grads)`` / ``aggregate(grads)``.
2. ``PSServer`` / ``PSClient`` -- dedicated server ranks (``netdist ps-server``) holding
   parameters partitioned by key range, big tensors sliced across all servers, and
   running the optimizer on their shards: ``push(grads)``, ``pull()``, ``step(grads)``.
3. The same with ``max_staleness=k`` (bounded staleness) or ``None`` (fully async).

``ColocatedPS`` runs servers inside training ranks (every rank trains, the first ``S``
also serve); ``ServerOptimizerAggregator`` / ``demo_update_path`` plug the modes into a
``distributed_train_step`` loop.

``netdist.ps.state`` holds the pure planning, optimizer and version-clock logic.

Every mode takes CPU torch tensors wherever it takes NumPy arrays (``netdist.tensors``),
and bfloat16 without ``ml_dtypes``: the rank-0 server averages it as torch does, the
sharded servers keep a float32 master copy (``ServerShard``).
"""

from netdist.ps.adapters import (
    PS_MAX_STALENESS_ENV,
    ServerOptimizerAggregator,
    UpdateHooks,
    demo_update_path,
    max_staleness_from_env,
)
from netdist.ps.client import PSClient
from netdist.ps.colocated import ColocatedPS
from netdist.ps.server import PSServer, ServerReport, serve
from netdist.ps.state import (
    DEFAULT_BIGARRAY_BOUND,
    PS_SERVERS_ENV,
    AdamConfig,
    OptimizerConfig,
    ParamSpec,
    PSRoles,
    SGDConfig,
    ShardOptimizer,
    ShardPlan,
    ShardSlice,
    StalenessController,
    VersionLogEntry,
    num_servers_from_env,
    plan_shards,
    ps_roles,
)
from netdist.ps.sync import ParameterServer

__all__ = [
    "ParameterServer",
    "PSServer",
    "PSClient",
    "ColocatedPS",
    "ServerOptimizerAggregator",
    "UpdateHooks",
    "demo_update_path",
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
]
