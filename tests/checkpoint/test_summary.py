"""What the ranks of a collective save/load exchange: named fields, msgpack round trips."""

from __future__ import annotations

import msgpack
import pytest

from netdist.checkpoint.metadata import TensorShardSpec
from netdist.checkpoint.options import ReplicaCheck
from netdist.checkpoint.summary import (
    RankFailure,
    RankSummary,
    ShardExtent,
    TensorSummary,
    merge_rank_summaries,
)
from netdist.errors import CheckpointMismatchError

STATE = {"skeleton": {"t": "dict", "items": []}, "objects": {}}


def _over_the_wire(data: object) -> object:
    return msgpack.unpackb(msgpack.packb(data, use_bin_type=True), raw=False)


def test_a_rank_summary_survives_the_wire() -> None:
    summary = RankSummary({"w": TensorSummary("float32", (3, 4), 0),
                           "b": TensorSummary("float64", (4,), None, 123456)},
                          dict(STATE), step=7, staging=".step_000007.tmp-ab")
    wire = _over_the_wire(summary.to_wire())
    assert isinstance(wire, dict) and set(wire) == {"tensors", "state", "step", "staging"}
    assert wire["tensors"]["w"] == {"dtype": "float32", "shape": [3, 4], "shard_dim": 0,
                                    "crc32": None}
    assert RankSummary.from_wire(wire) == summary


def test_extents_and_failures_survive_the_wire() -> None:
    extent = ShardExtent(1, 5)
    wire = _over_the_wire(extent.to_wire())
    assert isinstance(wire, dict) and ShardExtent.from_wire(wire) == extent
    failure = RankFailure.of(CheckpointMismatchError("bad shape"))
    assert failure == RankFailure("CheckpointMismatchError", "bad shape")
    assert RankFailure.from_wire(_over_the_wire(failure.to_wire())) == failure
    assert RankFailure.from_wire({"ok": True}) is None
    assert RankFailure.from_wire(RankSummary({}, dict(STATE)).to_wire()) is None


def test_merge_builds_specs_and_reports_diverged_replicas() -> None:
    summaries = [RankSummary({"w": TensorSummary("float32", (rows, 4), 0),
                              "b": TensorSummary("float64", (4,), None, crc)}, dict(STATE))
                 for rows, crc in ((3, 1), (2, 1), (2, 9))]
    specs, layout, diverged = merge_rank_summaries(summaries, ReplicaCheck.WARN)
    assert specs["w"] == TensorShardSpec((7, 4), 0, (3, 2, 2), "float32")
    assert specs["b"] == TensorShardSpec.replicated((4,), "float64")
    assert diverged == {"b": [2]} and layout.objects == {}
    with pytest.raises(CheckpointMismatchError, match="'b' differs between rank 0 and rank 2"):
        merge_rank_summaries(summaries, ReplicaCheck.ERROR)


def test_merge_names_the_rank_that_disagrees() -> None:
    summaries = [RankSummary({"w": TensorSummary("float32", (3, 4), 0)}, dict(STATE)),
                 RankSummary({"w": TensorSummary("float32", (3, 5), 0)}, dict(STATE))]
    with pytest.raises(CheckpointMismatchError,
                       match=r"^sharded 'w': rank 1 has shape \[3, 5\], incompatible with "
                             r"rank 0's \[3, 4\] \(only dim 0 may differ\)$"):
        merge_rank_summaries(summaries)
