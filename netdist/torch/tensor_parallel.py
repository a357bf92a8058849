"""Tensor-parallel torch layers over a netdist group (Megatron-LM's column/row split).

The torch twins of ``netdist.parallel.tensor_parallel`` (same split, same placements,
same communication; see that module for what each layer does), as ``torch.nn.Module``s
whose backward is torch's autograd. They are built on four autograd functions, Megatron's
conjugate pairs, each calling the netdist group on CPU tensors (zero-copy):

==================  ==================================  ==================================
function            forward                             backward
==================  ==================================  ==================================
``copy_to_tp``      identity                            all-reduce (sum) of the gradient
``reduce_from_tp``  all-reduce (sum)                    identity
``gather_from_tp``  all-gather along the last dim       this rank's columns of the gradient
``scatter_to_tp``   this rank's columns                 all-gather of the gradient
==================  ==================================  ==================================

Like any autograd function, ``copy_to_tp``'s backward runs only when its input needs a
gradient: a ``ColumnParallelLinear`` fed by data (no ``requires_grad``) all-reduces
nothing backward.

``group`` is a blocking proxy (``job.group`` of ``netdist.connect()``) or a ``Group``
whose loop runs on another thread (``netdist.parallel.tp_comm``). Autograd runs a CPU
backward on the thread that called ``backward()``, so the layers' collectives run where
their forward's did. Tensors must be on the CPU (netdist's group takes CPU tensors only).

torch's own tensor parallelism (DTensor's ``parallelize_module``) also runs over netdist,
through the ``torch.distributed`` backend ``"netdist"``; these layers are for programs
on netdist's own API.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Self

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from netdist.parallel.tp_comm import TPComm
from netdist.parallel.tp_layout import (
    TPKind,
    TPLayout,
    TPLayoutOwner,
    check_ids,
    check_last_dim,
    tp_layout,
)
from netdist.sharding import chunk_bounds

if TYPE_CHECKING:
    from netdist.collectives.group import Group
    from netdist.progress.proxy import Blocking

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "copy_to_tp",
    "reduce_from_tp",
    "gather_from_tp",
    "scatter_to_tp",
]

GroupLike = Any
"""A netdist ``Group``, a blocking proxy of one (``job.group``), or a ``TPComm``."""

_INTEGER_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


def _comm(group: GroupLike, who: str) -> TPComm:
    return group if isinstance(group, TPComm) else TPComm(group, who)


def _summed(comm: TPComm, t: Tensor, what: str) -> Tensor:
    """A contiguous copy of ``t`` summed over the group (the caller's tensor untouched)."""
    out = t.detach().clone(memory_format=torch.contiguous_format)
    return comm.all_reduce(out, what)


def _columns(t: Tensor, comm: TPComm, total: int) -> Tensor:
    """This rank's ``chunk_bounds`` share of the last dimension of ``t`` (a copy)."""
    start, stop = chunk_bounds(total, comm.world_size)[comm.rank]
    return t[..., start:stop].clone(memory_format=torch.contiguous_format)


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, comm: TPComm) -> Tensor:
        ctx.comm = comm
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return _summed(ctx.comm, grad, "backward"), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, comm: TPComm) -> Tensor:
        return _summed(comm, x, "forward")

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, comm: TPComm, total: int) -> Tensor:
        ctx.comm, ctx.total = comm, total
        return comm.all_gather_last(x.detach().contiguous(), total, "forward")

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        return _columns(grad, ctx.comm, ctx.total), None, None


class _ScatterToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, comm: TPComm) -> Tensor:
        ctx.comm, ctx.total = comm, x.shape[-1]
        return _columns(x, comm, x.shape[-1])

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return ctx.comm.all_gather_last(grad.contiguous(), ctx.total, "backward"), None


def copy_to_tp(x: Tensor, group: GroupLike) -> Tensor:
    """Enter the tensor-parallel region: ``x`` as it is; backward sums the gradient over
    ``group`` (each rank's layers saw the whole ``x`` and contributed a part of its
    gradient)."""
    return _CopyToTP.apply(x, _comm(group, "copy_to_tp"))


def reduce_from_tp(x: Tensor, group: GroupLike) -> Tensor:
    """Leave the region by summing the ranks' partial results; backward: the gradient as
    it is (every rank needs all of it)."""
    return _ReduceFromTP.apply(x, _comm(group, "reduce_from_tp"))


def gather_from_tp(x: Tensor, group: GroupLike, size: int) -> Tensor:
    """Leave the region by putting the ranks' column blocks side by side (``size``
    columns in all, split by ``chunk_bounds``); backward keeps this rank's columns."""
    return _GatherFromTP.apply(x, _comm(group, "gather_from_tp"), size)


def scatter_to_tp(x: Tensor, group: GroupLike) -> Tensor:
    """Enter the region by keeping this rank's ``chunk_bounds`` share of the last
    dimension; backward all-gathers the gradient's column blocks."""
    return _ScatterToTP.apply(x, _comm(group, "scatter_to_tp"))


class _TensorParallel(TPLayoutOwner, nn.Module):
    """What the torch tensor-parallel layers share: the group, the layout, parameters."""

    comm: TPComm
    layout: TPLayout
    weight: nn.Parameter
    bias: nn.Parameter | None

    _adopt: Callable[..., None]
    """Keep this rank's piece of a whole layer (each layer's own options after ``group``)."""

    @classmethod
    def _cut(cls, source: Any, group: Group | Blocking, *options: Any) -> Self:
        """A layer holding this rank's piece of the whole layer ``source``."""
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer._adopt(source, group, *options)
        return layer

    def _setup(self, kind: TPKind, group: Group | Blocking, full_weight: Tensor,
               full_bias: Tensor | None) -> None:
        self.comm = TPComm(group, kind.value)
        rows, cols = full_weight.shape
        self.layout = tp_layout(kind, int(rows), int(cols), bias=full_bias is not None,
                                rank=self.comm.rank, world_size=self.comm.world_size)
        with torch.no_grad():
            self.weight = nn.Parameter(self.layout.piece("weight", full_weight).clone())
            if full_bias is None:
                self.register_parameter("bias", None)
            else:
                self.bias = nn.Parameter(self.layout.piece("bias", full_bias).clone())

    def _setup_linear(self, kind: TPKind, linear: nn.Linear, group: Group | Blocking) -> None:
        """Keep this rank's piece of the whole ``linear``."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"{kind.value}: expected an nn.Linear, got "
                            f"{type(linear).__name__}")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self._setup(kind, group, linear.weight, linear.bias)

    def _check(self, step: str, x: Tensor, width: int, what: str = "input") -> None:
        check_last_dim(f"{self.layout.kind.value}.{step}", tuple(x.shape), width, what)

    def extra_repr(self) -> str:
        shard = self.layout.shard
        return (f"rank {self.layout.rank} of {self.layout.world_size} holds "
                f"[{shard.start}:{shard.stop}]")


class ColumnParallelLinear(_TensorParallel):
    """``nn.Linear`` with the weight split along the output features.

    The direct constructor builds a whole ``nn.Linear(in_features, out_features)`` (torch's
    own initialisation, from torch's random state: seed it alike on every rank) and keeps
    this rank's rows. ``gather_output=True`` all-gathers the whole output.
    """

    def __init__(self, in_features: int, out_features: int, group: Group | Blocking, *,
                 bias: bool = True, gather_output: bool = False,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self._adopt(nn.Linear(in_features, out_features, bias=bias, dtype=dtype), group,
                    gather_output)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group: Group | Blocking, *,
                    gather_output: bool = False) -> ColumnParallelLinear:
        """This rank's rows of ``linear`` (copied; ``linear`` is left as it is)."""
        return cls._cut(linear, group, gather_output)

    def _adopt(self, linear: nn.Linear, group: Group | Blocking, gather_output: bool) -> None:
        self.gather_output = bool(gather_output)
        self._setup_linear(TPKind.COLUMN, linear, group)

    def forward(self, x: Tensor) -> Tensor:
        self._check("forward", x, self.in_features)
        y = F.linear(copy_to_tp(x, self.comm), self.weight, self.bias)
        return gather_from_tp(y, self.comm, self.out_features) if self.gather_output else y


class RowParallelLinear(_TensorParallel):
    """``nn.Linear`` with the weight split along the input features; the bias is whole
    and added once, after the partial outputs are summed.

    The direct constructor builds a whole ``nn.Linear(in_features, out_features)`` (seed
    torch alike on every rank) and keeps this rank's columns. ``input_is_parallel=False``
    takes the whole input and keeps this rank's columns of it.
    """

    def __init__(self, in_features: int, out_features: int, group: Group | Blocking, *,
                 bias: bool = True, input_is_parallel: bool = True,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self._adopt(nn.Linear(in_features, out_features, bias=bias, dtype=dtype), group,
                    input_is_parallel)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group: Group | Blocking, *,
                    input_is_parallel: bool = True) -> RowParallelLinear:
        """This rank's columns of ``linear`` and its whole bias (copied)."""
        return cls._cut(linear, group, input_is_parallel)

    def _adopt(self, linear: nn.Linear, group: Group | Blocking,
               input_is_parallel: bool) -> None:
        self.input_is_parallel = bool(input_is_parallel)
        self._setup_linear(TPKind.ROW, linear, group)

    def forward(self, x: Tensor) -> Tensor:
        if self.input_is_parallel:
            self._check("forward", x, self.layout.shard.size, "input (split)")
        else:
            self._check("forward", x, self.in_features)
            x = scatter_to_tp(x, self.comm)
        y = reduce_from_tp(F.linear(x, self.weight), self.comm)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(_TensorParallel):
    """``nn.Embedding`` with the table split along the vocabulary: ids outside this
    rank's rows look up zeros and the sum over the group puts the rows together.

    The direct constructor builds a whole ``nn.Embedding(num_embeddings, embedding_dim)``
    (N(0, 1) from torch's random state) and keeps this rank's rows.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, group: Group | Blocking, *,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self._adopt(nn.Embedding(num_embeddings, embedding_dim, dtype=dtype), group)

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding,
                       group: Group | Blocking) -> VocabParallelEmbedding:
        """This rank's rows of ``embedding`` (copied). Only plain lookups are split:
        ``padding_idx``, ``max_norm`` and sparse gradients are refused."""
        return cls._cut(embedding, group)

    def _adopt(self, embedding: nn.Embedding, group: Group | Blocking) -> None:
        if not isinstance(embedding, nn.Embedding):
            raise TypeError(f"VocabParallelEmbedding: expected an nn.Embedding, got "
                            f"{type(embedding).__name__}")
        if (embedding.padding_idx is not None or embedding.max_norm is not None
                or embedding.sparse):
            raise ValueError("VocabParallelEmbedding: padding_idx, max_norm and sparse "
                             "gradients are not supported")
        self.num_embeddings = embedding.num_embeddings
        self.embedding_dim = embedding.embedding_dim
        self._setup(TPKind.EMBEDDING, group, embedding.weight, None)

    def forward(self, ids: Tensor) -> Tensor:
        integer = ids.dtype in _INTEGER_DTYPES
        low, high = (int(ids.min()), int(ids.max())) if ids.numel() and integer else (0, 0)
        check_ids("VocabParallelEmbedding.forward", str(ids.dtype), integer, low, high,
                  self.num_embeddings)
        shard = self.layout.shard
        outside = (ids < shard.start) | (ids >= shard.stop)
        local = (ids - shard.start).masked_fill(outside, 0)
        rows = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0)
        return reduce_from_tp(rows, self.comm)
