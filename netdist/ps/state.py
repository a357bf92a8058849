"""PURE parameter-server state, one import away: every name of the modules below.

Nothing here waits or touches a socket, so every rank's view can be built and checked in
one process. Each job lives in its own module:

- ``netdist.ps.placement``: ``plan_shards`` places tensors on the servers (big ones
  sliced across all of them, small ones whole in balanced key ranges) -- ``ParamSpec``,
  ``ShardSlice``, ``ShardPlan``;
- ``netdist.ps.messages``: how an exchange is cut into messages -- one packer
  (``pack_runs``) behind ``plan_segments`` (sharded servers) and ``plan_pieces`` (the
  sync server's rounds over a ``FlatLayout``);
- ``netdist.optim``: the optimizer vocabulary shared with ``netdist.train`` and FSDP --
  ``SGDConfig``, ``AdamConfig``, ``ShardOptimizer`` (torch's update rules on a flat
  shard; elementwise, so a sharded step equals the unsharded step bit for bit);
- ``netdist.ps.shard``: ``ServerShard``, what a server holds -- the master parameters,
  the optimizer and the values workers pull (bfloat16 keeps a float32 master copy);
- ``netdist.ps.staleness``: ``StalenessController``, the version clock and the
  bounded-staleness rule, with the per-update version log tests assert the bound from;
- ``netdist.ps.roles``: ``ps_roles`` / ``num_servers_from_env`` /
  ``max_staleness_from_env``, which ranks of a job serve and the environment knobs.
"""

from __future__ import annotations

from netdist.optim import (
    AdamConfig,
    OptimizerConfig,
    SGDConfig,
    ShardOptimizer,
    optimizer_config_from_dict,
)
from netdist.ps.messages import (
    DIRECT_SEGMENT_BYTES,
    FlatLayout,
    Piece,
    Run,
    Segment,
    pack_runs,
    plan_pieces,
    plan_segments,
)
from netdist.ps.placement import (
    DEFAULT_BIGARRAY_BOUND,
    ParamSpec,
    ShardPlan,
    ShardSlice,
    plan_shards,
    specs_from_arrays,
)
from netdist.ps.roles import (
    DEFAULT_PS_SERVERS,
    PS_MAX_STALENESS_ENV,
    PS_SERVERS_ENV,
    PSRoles,
    default_num_servers,
    max_staleness_from_env,
    num_servers_from_env,
    ps_roles,
)
from netdist.ps.shard import ServerShard, master_dtype
from netdist.ps.staleness import StalenessController, VersionLogEntry, WorkerState

__all__ = [
    "DEFAULT_BIGARRAY_BOUND",
    "PS_SERVERS_ENV",
    "ParamSpec",
    "ShardSlice",
    "ShardPlan",
    "plan_shards",
    "Run",
    "pack_runs",
    "Segment",
    "plan_segments",
    "DIRECT_SEGMENT_BYTES",
    "specs_from_arrays",
    "FlatLayout",
    "Piece",
    "plan_pieces",
    "SGDConfig",
    "AdamConfig",
    "OptimizerConfig",
    "optimizer_config_from_dict",
    "ShardOptimizer",
    "master_dtype",
    "ServerShard",
    "WorkerState",
    "VersionLogEntry",
    "StalenessController",
    "PSRoles",
    "ps_roles",
    "DEFAULT_PS_SERVERS",
    "default_num_servers",
    "num_servers_from_env",
    "PS_MAX_STALENESS_ENV",
    "max_staleness_from_env",
]
