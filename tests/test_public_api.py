"""Every public name DESIGN.md promises is importable from the top-level package."""

from __future__ import annotations

import subprocess
import sys

import pytest

import netdist

DESIGN_NAMES = [
    "DistributedConfig", "init", "Transport", "InProcessTransport", "TcpTransport", "Group",
    "GradientAggregator", "LocalAggregator", "AllReduceAggregator", "ParameterServer",
    "TopKCompressor", "compress_gradients", "decompress_gradients", "PipelineStage",
    "PipelineParallelConfig", "split_into_stages", "balance_stages", "shard_tensor",
    "gather_shards", "ShardingStrategy", "FSDP", "TensorShardSpec", "ShardMetadata",
    "save_distributed", "load_distributed", "reshard", "AsyncCheckpointer",
    "CheckpointFuture", "flat_shard_metadata", "distributed_train_step",
]


@pytest.mark.parametrize("name", sorted(set(DESIGN_NAMES) | set(netdist.__all__)))
def test_name_resolves(name: str) -> None:
    assert getattr(netdist, name) is not None


def test_design_names_are_exported() -> None:
    assert set(DESIGN_NAMES) <= set(netdist.__all__)


def test_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        getattr(netdist, "nope")


def test_sharding_strategy_members() -> None:
    names = {member.name for member in netdist.ShardingStrategy}
    assert {"FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD"} <= names


def test_import_is_lazy() -> None:
    code = "import sys, netdist; print('numpy' in sys.modules, 'asyncio' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True).stdout.split()
    assert out == ["False", "False"]


def test_a_lazy_package_pickles_as_its_import() -> None:
    """A function shipped by value (cloudpickle: Ray Train's train function, a Dask task)
    carries the modules it uses; a lazy netdist package pickles as its import by name,
    as a plain module does, instead of failing on its module type."""
    import pickle

    import netdist.checkpoint

    for package in (netdist, netdist.checkpoint):
        blob = pickle.dumps(package)
        assert package.__name__.encode() in blob and len(blob) < 200  # a name, no contents
        assert pickle.loads(blob) is package
