"""Distributed checkpointing: crash-safe safetensors shards, dedup, resharding, async saves.

Layout (``docs/PROTOCOL.md``, "Checkpoint layout")::

    ckpt_dir/step_000100/
      metadata.json              written last, after every rank's shard is durable
      rank_00000.safetensors     this rank's shards (replicated tensors written once)
    ckpt_dir/latest              names the newest complete step

Entry points:

- collective, over a ``Group``: ``await save(state, dir, group, step=N, keep_last=K)`` and
  ``await load(dir, group, like=state)`` for nested training state (parameters,
  ``ShardedArray`` shards, optimizer state, counters, RNGs), torch included: tensors,
  ``state_dict()``s as they are, and modules / optimizers / ``RNGState`` themselves,
  restored in place through ``load_state_dict()`` (lazy optimizer state created, tied
  weights stored once and tied again; ``ReplicaCheck`` for replicas that differ);
- per rank, no communication: ``save_distributed`` / ``load_distributed`` / ``reshard`` with
  ``TensorShardSpec`` / ``ShardMetadata`` (``flat_shard_metadata`` builds the usual layout);
- background: ``AsyncCheckpointer(...).save_async(state) -> CheckpointFuture``;
- tools: ``consolidate`` (one safetensors file), ``reshard_checkpoint`` (new world size),
  ``verify_checkpoint``, ``inspect_checkpoint`` (also ``netdist ckpt ...``).
"""

from netdist.checkpoint.api import (
    CheckpointReader,
    SaveResult,
    flat_shard_metadata,
    list_checkpoints,
    load_distributed,
    load_metadata,
    reshard,
    resolve_checkpoint,
    save_distributed,
    shard_state_dict,
)
from netdist.checkpoint.async_save import AsyncCheckpointer, CheckpointFuture
from netdist.checkpoint.collective import (
    RANK_OBJECT_POLICIES,
    ReplicaCheck,
    ReplicaDivergenceWarning,
    load,
    save,
)
from netdist.checkpoint.consolidate import (
    TensorRow,
    VerifyReport,
    consolidate,
    inspect_checkpoint,
    reshard_checkpoint,
    verify_checkpoint,
)
from netdist.checkpoint.metadata import (
    FORMAT_VERSION,
    FileRecord,
    Placement,
    ShardMetadata,
    StateLayout,
    TensorShardSpec,
)
from netdist.checkpoint.rng import RNGState
from netdist.checkpoint.state import ShardedArray

__all__ = [
    "TensorShardSpec",
    "Placement",
    "ShardMetadata",
    "FileRecord",
    "StateLayout",
    "FORMAT_VERSION",
    "ShardedArray",
    "SaveResult",
    "save_distributed",
    "load_distributed",
    "reshard",
    "flat_shard_metadata",
    "shard_state_dict",
    "load_metadata",
    "resolve_checkpoint",
    "list_checkpoints",
    "CheckpointReader",
    "save",
    "load",
    "RANK_OBJECT_POLICIES",
    "ReplicaCheck",
    "ReplicaDivergenceWarning",
    "RNGState",
    "AsyncCheckpointer",
    "CheckpointFuture",
    "consolidate",
    "reshard_checkpoint",
    "verify_checkpoint",
    "inspect_checkpoint",
    "TensorRow",
    "VerifyReport",
]
