"""Distributed checkpointing: crash-safe safetensors shards, dedup, resharding, async saves.

Layout (``docs/PROTOCOL.md``, "Checkpoint layout")::

    ckpt_dir/step_000100/
      metadata.json              written last, after every rank's shard is durable
      rank_00000.safetensors     this rank's shards (replicated tensors written once)
    ckpt_dir/latest              names the newest complete step

Entry points:

- collective, over a ``Group``: ``await save(state, dir, group, step=N, keep_last=K)`` and
  ``await load(dir, group, like=state)`` for nested training state (parameters,
  ``ShardedArray`` shards - along one dim, or pieces placed on a device mesh, each written
  once and resharded onto any other mesh -, optimizer state, counters, RNGs), torch
  included (``DTensor``s as mesh pieces): tensors,
  ``state_dict()``s as they are, and modules / optimizers / ``RNGState`` themselves,
  restored in place through ``load_state_dict()`` (lazy optimizer state created, tied
  weights stored once and tied again; ``ReplicaCheck`` for replicas that differ,
  ``RankObjects`` for per-rank values at another world size; ``group`` is anything
  ``GroupLike``);
- per rank, no communication: ``save_distributed`` / ``load_distributed`` / ``reshard`` with
  ``TensorShardSpec`` / ``ShardMetadata`` (``flat_shard_metadata`` builds the usual layout);
- background: ``AsyncCheckpointer(...).save_async(state) -> CheckpointFuture``;
- tools: ``consolidate`` (one safetensors file), ``reshard_checkpoint`` (new world size),
  ``verify_checkpoint``, ``inspect_checkpoint`` (also ``netdist ckpt ...``).

Names resolve lazily (``netdist._lazy``): importing the PURE ``metadata`` or ``planner``
modules does not import the collective save/load and with it asyncio.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

_EXPORTS: dict[str, str] = {
    "TensorShardSpec": "netdist.checkpoint.metadata",
    "Placement": "netdist.checkpoint.metadata",
    "ShardMetadata": "netdist.checkpoint.metadata",
    "FileRecord": "netdist.checkpoint.metadata",
    "StateLayout": "netdist.checkpoint.metadata",
    "FORMAT_VERSION": "netdist.checkpoint.metadata",
    "ShardedArray": "netdist.checkpoint.state",
    "SaveResult": "netdist.checkpoint.writing",
    "save_distributed": "netdist.checkpoint.api",
    "load_distributed": "netdist.checkpoint.api",
    "reshard": "netdist.checkpoint.api",
    "flat_shard_metadata": "netdist.checkpoint.api",
    "shard_state_dict": "netdist.checkpoint.api",
    "load_metadata": "netdist.checkpoint.reading",
    "resolve_checkpoint": "netdist.checkpoint.reading",
    "list_checkpoints": "netdist.checkpoint.reading",
    "CheckpointReader": "netdist.checkpoint.reading",
    "save": "netdist.checkpoint.collective",
    "load": "netdist.checkpoint.collective",
    "GroupLike": "netdist.checkpoint.group_like",
    "RankObjects": "netdist.checkpoint.options",
    "RANK_OBJECT_POLICIES": "netdist.checkpoint.restore",
    "ReplicaCheck": "netdist.checkpoint.options",
    "TiedTensors": "netdist.checkpoint.options",
    "ReplicaDivergenceWarning": "netdist.checkpoint.collective",
    "RNGState": "netdist.checkpoint.rng",
    "AsyncCheckpointer": "netdist.checkpoint.async_save",
    "CheckpointFuture": "netdist.checkpoint.async_save",
    "consolidate": "netdist.checkpoint.consolidate",
    "reshard_checkpoint": "netdist.checkpoint.consolidate",
    "verify_checkpoint": "netdist.checkpoint.consolidate",
    "inspect_checkpoint": "netdist.checkpoint.consolidate",
    "TensorRow": "netdist.checkpoint.consolidate",
    "VerifyReport": "netdist.checkpoint.consolidate",
}

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
    "GroupLike",
    "RankObjects",
    "RANK_OBJECT_POLICIES",
    "ReplicaCheck",
    "TiedTensors",
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

if TYPE_CHECKING:
    from netdist.checkpoint.api import (
        flat_shard_metadata,
        load_distributed,
        reshard,
        save_distributed,
        shard_state_dict,
    )
    from netdist.checkpoint.async_save import AsyncCheckpointer, CheckpointFuture
    from netdist.checkpoint.collective import ReplicaDivergenceWarning, load, save
    from netdist.checkpoint.group_like import GroupLike
    from netdist.checkpoint.options import RankObjects, ReplicaCheck, TiedTensors
    from netdist.checkpoint.reading import (
        CheckpointReader,
        list_checkpoints,
        load_metadata,
        resolve_checkpoint,
    )
    from netdist.checkpoint.restore import RANK_OBJECT_POLICIES
    from netdist.checkpoint.writing import SaveResult
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
else:
    from netdist._lazy import attach as _attach

    __getattr__, __dir__ = _attach(__name__, _EXPORTS)
