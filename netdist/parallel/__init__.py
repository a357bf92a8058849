"""Data parallelism: gradient aggregators (dense bucketed all-reduce, float16, top-k).

FSDP and pipeline parallelism live in sibling modules of this package and are imported
from them directly.
"""

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

__all__ = [
    "GradientAggregator",
    "LocalAggregator",
    "AllReduceAggregator",
    "Fp16AllReduceAggregator",
    "TopKAggregator",
    "OverlapAggregator",
    "OverlapSession",
    "SessionState",
    "Bucket",
    "BucketEntry",
    "plan_buckets",
]
