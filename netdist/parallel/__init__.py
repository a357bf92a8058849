"""Data parallelism (gradient aggregators, DiLoCo), FSDP / ZeRO, tensor and pipeline parallelism.

The aggregators (dense bucketed all-reduce, float16, top-k), ``FSDP`` and the NumPy
tensor-parallel layers (``ColumnParallelLinear``, ``RowParallelLinear``,
``VocabParallelEmbedding``) are importable from here; FSDP's other names and the
pipeline live in sibling modules (``netdist.parallel.fsdp``, ``.pipeline``, ``.stages``,
``.schedule``) and are imported from them directly. Names resolve on first use
(``netdist._lazy``), so importing a PURE module of this package (``stages``,
``schedule``, ``flat_param``, ``fsdp_strategy``, ``fsdp_stats``, ``tp_layout``,
``outer_optim``, ``fragments``) does not
load the aggregators, the collectives or ``asyncio``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

_EXPORTS: dict[str, str] = {
    "GradientAggregator": "netdist.parallel.aggregators",
    "LocalAggregator": "netdist.parallel.aggregators",
    "AllReduceAggregator": "netdist.parallel.aggregators",
    "Fp16AllReduceAggregator": "netdist.parallel.aggregators",
    "TopKAggregator": "netdist.parallel.aggregators",
    "OverlapAggregator": "netdist.parallel.aggregators",
    "OverlapSession": "netdist.parallel.aggregators",
    "SessionState": "netdist.parallel.aggregators",
    "Bucket": "netdist.parallel.aggregators",
    "BucketEntry": "netdist.parallel.aggregators",
    "plan_buckets": "netdist.parallel.aggregators",
    "FSDP": "netdist.parallel.fsdp",
    "ShardingStrategy": "netdist.parallel.fsdp",
    "ColumnParallelLinear": "netdist.parallel.tensor_parallel",
    "RowParallelLinear": "netdist.parallel.tensor_parallel",
    "VocabParallelEmbedding": "netdist.parallel.tensor_parallel",
    "DiLoCo": "netdist.parallel.diloco",
    "DiLoCoConfig": "netdist.parallel.diloco",
    "LocalSGD": "netdist.parallel.diloco",
    "SyncRecord": "netdist.parallel.diloco",
    "OuterSGD": "netdist.parallel.outer_optim",
}

__all__ = list(_EXPORTS)

if TYPE_CHECKING:  # static analysers see the eager imports
    from netdist.parallel.aggregators import (
        AllReduceAggregator,
        Bucket,
        BucketEntry,
        Fp16AllReduceAggregator,
        GradientAggregator,
        LocalAggregator,
        OverlapAggregator,
        OverlapSession,
        SessionState,
        TopKAggregator,
        plan_buckets,
    )
    from netdist.parallel.diloco import DiLoCo, DiLoCoConfig, LocalSGD, SyncRecord
    from netdist.parallel.fsdp import FSDP, ShardingStrategy
    from netdist.parallel.outer_optim import OuterSGD
    from netdist.parallel.tensor_parallel import (
        ColumnParallelLinear,
        RowParallelLinear,
        VocabParallelEmbedding,
    )
else:
    from netdist._lazy import attach as _attach

    __getattr__, __dir__ = _attach(__name__, _EXPORTS)
