"""netdist: asyncio TCP transport, collectives and parameter server for distributed training.

Every public name is importable from here (``netdist.Group``, ``netdist.save_distributed``,
...); exceptions live in ``netdist.errors``. Names are resolved lazily on first use, so
``import netdist`` (and every CLI start) stays fast and pulls in only what is used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

__version__ = "0.1.0"

_EXPORTS: dict[str, str] = {
    # configuration and core types
    "DistributedConfig": "netdist.config",
    "WireLimits": "netdist.config",
    "AdmissionLimits": "netdist.config",
    "ReduceOp": "netdist.types",
    # transport
    "Transport": "netdist.transport",
    "InProcessTransport": "netdist.transport",
    "TcpTransport": "netdist.transport",
    "init": "netdist.transport",
    "create_local_tcp_group": "netdist.transport",
    "launch": "netdist.launcher",
    # the progress thread and the blocking API
    "connect": "netdist.progress",
    "Job": "netdist.progress",
    "ProgressThread": "netdist.progress",
    "Handle": "netdist.progress",
    "Blocking": "netdist.progress",
    # collectives
    "Group": "netdist.collectives",
    "Work": "netdist.collectives",
    "DeviceMesh": "netdist.collectives",
    # sharding arithmetic
    "shard_tensor": "netdist.sharding",
    "gather_shards": "netdist.sharding",
    # compression
    "TopKCompressor": "netdist.compression",
    "Fp16Compressor": "netdist.compression",
    "CompressedGradient": "netdist.compression",
    "compress_gradients": "netdist.compression",
    "decompress_gradients": "netdist.compression",
    # aggregation and the parameter server
    "GradientAggregator": "netdist.parallel",
    "LocalAggregator": "netdist.parallel",
    "AllReduceAggregator": "netdist.parallel",
    "Fp16AllReduceAggregator": "netdist.parallel",
    "TopKAggregator": "netdist.parallel",
    "ParameterServer": "netdist.ps",
    "PSClient": "netdist.ps",
    "PSServer": "netdist.ps",
    # FSDP / ZeRO
    "FSDP": "netdist.parallel.fsdp",
    "ShardingStrategy": "netdist.parallel.fsdp",
    # pipeline
    "PipelineStage": "netdist.parallel.stages",
    "PipelineParallelConfig": "netdist.parallel.stages",
    "split_into_stages": "netdist.parallel.stages",
    "balance_stages": "netdist.parallel.stages",
    "PipelineParallel": "netdist.parallel.pipeline",
    "train_pipelined": "netdist.parallel.pipeline",
    # checkpointing
    "TensorShardSpec": "netdist.checkpoint",
    "ShardMetadata": "netdist.checkpoint",
    "save_distributed": "netdist.checkpoint",
    "load_distributed": "netdist.checkpoint",
    "reshard": "netdist.checkpoint",
    "flat_shard_metadata": "netdist.checkpoint",
    "AsyncCheckpointer": "netdist.checkpoint",
    "CheckpointFuture": "netdist.checkpoint",
    # training kit
    "distributed_train_step": "netdist.train",
    "Parameter": "netdist.train",
    "Module": "netdist.train",
    "Linear": "netdist.train",
    "ReLU": "netdist.train",
    "Tanh": "netdist.train",
    "Sequential": "netdist.train",
    "SGD": "netdist.train",
    "Adam": "netdist.train",
    "softmax_cross_entropy": "netdist.train",
    "mse_loss": "netdist.train",
}

__all__ = sorted(_EXPORTS) + ["errors", "__version__"]

if TYPE_CHECKING:  # static analysers see the eager imports
    from netdist import errors
    from netdist.checkpoint import (AsyncCheckpointer, CheckpointFuture, ShardMetadata,
                                    TensorShardSpec, flat_shard_metadata, load_distributed,
                                    reshard, save_distributed)
    from netdist.collectives import DeviceMesh, Group, Work
    from netdist.compression import (CompressedGradient, Fp16Compressor, TopKCompressor,
                                     compress_gradients, decompress_gradients)
    from netdist.config import AdmissionLimits, DistributedConfig, WireLimits
    from netdist.launcher import launch
    from netdist.parallel import (AllReduceAggregator, Fp16AllReduceAggregator,
                                  GradientAggregator, LocalAggregator, TopKAggregator)
    from netdist.parallel.fsdp import FSDP, ShardingStrategy
    from netdist.parallel.pipeline import PipelineParallel, train_pipelined
    from netdist.parallel.stages import (PipelineParallelConfig, PipelineStage,
                                         balance_stages, split_into_stages)
    from netdist.progress import Blocking, Handle, Job, ProgressThread, connect
    from netdist.ps import ParameterServer, PSClient, PSServer
    from netdist.sharding import gather_shards, shard_tensor
    from netdist.train import (SGD, Adam, Linear, Module, Parameter, ReLU, Sequential, Tanh,
                               distributed_train_step, mse_loss, softmax_cross_entropy)
    from netdist.transport import (InProcessTransport, TcpTransport, Transport,
                                   create_local_tcp_group, init)
else:
    from netdist._lazy import attach as _attach

    __getattr__, __dir__ = _attach(__name__, _EXPORTS, submodules=["errors"])
