"""Tensor-parallel layers for the NumPy training kit (Megatron-LM's column/row split).

Each layer holds one rank's piece of a weight split over the ranks of a tensor-parallel
``group`` (contiguous chunks, the first ``total % n`` one larger: ``tp_layout``) and is a
``netdist.train.nn.Module`` (``forward(x) -> (y, ctx)``, ``backward(ctx, g)`` adding into
``param.grad``), so it sits in a ``Sequential`` like any other layer:

- ``ColumnParallelLinear``: weight ``(out, in)`` split along the output features. The
  input arrives replicated; forward is "copy to the TP region" (identity; its backward
  all-reduces the input gradient) then the local matmul and bias slice. The output stays
  split along its last dimension, or with ``gather_output=True`` is all-gathered whole
  (its backward then takes this rank's columns of the gradient, without communication).
- ``RowParallelLinear``: weight split along the input features. The input arrives split
  along its last dimension (``input_is_parallel=True``, what a column layer without
  ``gather_output`` produces) or replicated and split here (then backward all-gathers the
  input gradient). The partial outputs are all-reduced (forward), the replicated bias is
  added once after the sum, and the reduction's backward is the identity; the bias
  gradient is the plain sum of ``grad_out``, the same on every rank.
- ``VocabParallelEmbedding``: the table split along the vocabulary. Ids outside this
  rank's rows look up zeros, and the all-reduce puts every row together; backward adds
  ``grad_out`` into the local rows of the ids in range.

So ``ColumnParallelLinear -> ReLU -> RowParallelLinear`` costs exactly one all-reduce of
the ``(batch, out)`` output forward and one of the ``(batch, in)`` input gradient
backward. Each layer is built from a whole single-process layer (``from_linear``,
``from_embedding``: every rank copies its slice) or drawn from an ``rng`` by the rule of
``Linear``/``Embedding`` for the WHOLE weight, so one seed gives the same model at every
tensor-parallel size. ``tp_placements`` and ``full_shapes`` say how each local parameter
lies on a device mesh (for checkpoints).

The collectives run through ``netdist.parallel.tp_comm``: ``group`` is a blocking proxy
(``job.group``) or a ``Group`` whose loop runs elsewhere (call the layer from a thread,
``asyncio.to_thread``). Every rank of the group must call the same layers in the same
order, as with any collective; shapes are checked before anything is sent, so a wrong
shape raises the same ``ValueError`` on every rank and leaves the group usable.

This module imports ``netdist.train.nn`` (the kit's NumPy-only leaf module): the layers
are that kit's ``Module``s.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Self

import numpy as np

from netdist.parallel.tp_comm import TPComm
from netdist.parallel.tp_layout import (
    TPKind,
    TPLayout,
    TPLayoutOwner,
    check_ids,
    check_last_dim,
    tp_layout,
)
from netdist.train.nn import Embedding, Linear, Module, Parameter

if TYPE_CHECKING:
    from netdist.collectives.group import Group
    from netdist.progress.proxy import Blocking

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding"]


class _TensorParallel(TPLayoutOwner, Module):
    """The parts every NumPy tensor-parallel layer shares: group, layout, parameters."""

    comm: TPComm
    layout: TPLayout
    weight: Parameter
    bias: Parameter | None

    _adopt: Callable[..., None]
    """Keep this rank's piece of a whole layer (each layer's own options after ``group``)."""

    @classmethod
    def _cut(cls, source: Any, group: Group | Blocking, *options: Any) -> Self:
        """A layer holding this rank's piece of the whole layer ``source``."""
        layer = cls.__new__(cls)
        layer._adopt(source, group, *options)
        return layer

    def _setup(self, kind: TPKind, group: Group | Blocking, full_weight: np.ndarray,
               full_bias: np.ndarray | None) -> None:
        self.comm = TPComm(group, kind.value)
        rows, cols = full_weight.shape
        self.layout = tp_layout(kind, rows, cols, bias=full_bias is not None,
                                rank=self.comm.rank, world_size=self.comm.world_size)
        self.weight = Parameter("weight", self.layout.piece("weight", full_weight).copy())
        self.bias = None
        if full_bias is not None:
            self.bias = Parameter("bias", self.layout.piece("bias", full_bias).copy())

    def _setup_linear(self, kind: TPKind, linear: Linear, group: Group | Blocking) -> None:
        """Keep this rank's piece of the whole ``linear``."""
        if not isinstance(linear, Linear):
            raise TypeError(f"{kind.value}: expected a Linear, got {type(linear).__name__}")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self._setup(kind, group, linear.weight.data,
                    None if linear.bias is None else linear.bias.data)

    @property
    def group(self) -> Group | Blocking:
        """The tensor-parallel group the layer communicates over."""
        return self.comm.group

    def named_parameters(self) -> list[tuple[str, Parameter]]:
        pairs = [("weight", self.weight)]
        if self.bias is not None:
            pairs.append(("bias", self.bias))
        return pairs

    def _describe(self, sizes: str, extra: str = "") -> str:
        shard = self.layout.shard
        return (f"{self.layout.kind.value}({sizes}, rank {self.layout.rank} of "
                f"{self.layout.world_size} holds [{shard.start}:{shard.stop}]{extra}, "
                f"dtype={self.weight.data.dtype})")


class ColumnParallelLinear(_TensorParallel):
    """``Linear`` with the weight split along the output features (module docstring).

    The direct constructor draws the whole ``Linear(in_features, out_features)`` from
    ``rng`` (the same draws as ``Linear``) and keeps this rank's rows.
    """

    def __init__(self, in_features: int, out_features: int, group: Group | Blocking, *,
                 rng: np.random.Generator, dtype: Any = np.float64, bias: bool = True,
                 gather_output: bool = False) -> None:
        full = Linear(in_features, out_features, rng=rng, dtype=dtype, bias=bias)
        self._adopt(full, group, gather_output)

    @classmethod
    def from_linear(cls, linear: Linear, group: Group | Blocking, *,
                    gather_output: bool = False) -> ColumnParallelLinear:
        """This rank's slice of ``linear`` (copied; ``linear`` is left as it is)."""
        return cls._cut(linear, group, gather_output)

    def _adopt(self, linear: Linear, group: Group | Blocking, gather_output: bool) -> None:
        self.gather_output = bool(gather_output)
        self._setup_linear(TPKind.COLUMN, linear, group)

    @property
    def local_out_features(self) -> int:
        """How many output features this rank computes."""
        return self.layout.shard.size

    def forward(self, x: np.ndarray) -> tuple[np.ndarray, Any]:
        check_last_dim("ColumnParallelLinear.forward", x.shape, self.in_features, "input")
        y = x @ self.weight.data.T  # copy-to-TP: the replicated input as it is
        if self.bias is not None:
            y += self.bias.data
        if self.gather_output:
            y = self.comm.all_gather_last(y, self.out_features, "forward")
        return y, x

    def backward(self, ctx: Any, grad_out: np.ndarray) -> np.ndarray:
        x: np.ndarray = ctx
        width = self.out_features if self.gather_output else self.local_out_features
        check_last_dim("ColumnParallelLinear.backward", grad_out.shape, width, "grad_out")
        g = grad_out[..., self.layout.shard.slice] if self.gather_output else grad_out
        g2 = g.reshape(-1, self.local_out_features)
        self.weight.grad += g2.T @ x.reshape(-1, self.in_features)
        if self.bias is not None:
            self.bias.grad += g2.sum(axis=0)
        grad_in = np.ascontiguousarray(g @ self.weight.data)  # this rank's share
        return self.comm.all_reduce(grad_in, "backward")

    def __repr__(self) -> str:
        return self._describe(f"{self.in_features}, {self.out_features}",
                              ", gather_output" if self.gather_output else "")


class RowParallelLinear(_TensorParallel):
    """``Linear`` with the weight split along the input features (module docstring).

    The direct constructor draws the whole ``Linear(in_features, out_features)`` from
    ``rng`` (the same draws as ``Linear``) and keeps this rank's columns and the whole
    bias.
    """

    def __init__(self, in_features: int, out_features: int, group: Group | Blocking, *,
                 rng: np.random.Generator, dtype: Any = np.float64, bias: bool = True,
                 input_is_parallel: bool = True) -> None:
        full = Linear(in_features, out_features, rng=rng, dtype=dtype, bias=bias)
        self._adopt(full, group, input_is_parallel)

    @classmethod
    def from_linear(cls, linear: Linear, group: Group | Blocking, *,
                    input_is_parallel: bool = True) -> RowParallelLinear:
        """This rank's slice of ``linear`` (copied; ``linear`` is left as it is)."""
        return cls._cut(linear, group, input_is_parallel)

    def _adopt(self, linear: Linear, group: Group | Blocking,
               input_is_parallel: bool) -> None:
        self.input_is_parallel = bool(input_is_parallel)
        self._setup_linear(TPKind.ROW, linear, group)

    @property
    def local_in_features(self) -> int:
        """How many input features this rank's weight columns take."""
        return self.layout.shard.size

    def forward(self, x: np.ndarray) -> tuple[np.ndarray, Any]:
        width = self.local_in_features if self.input_is_parallel else self.in_features
        check_last_dim("RowParallelLinear.forward", x.shape, width,
                       "input (split)" if self.input_is_parallel else "input")
        local = x if self.input_is_parallel else x[..., self.layout.shard.slice]
        y = np.ascontiguousarray(local @ self.weight.data.T)
        self.comm.all_reduce(y, "forward")  # reduce-from-TP: the partial sums
        if self.bias is not None:
            y += self.bias.data  # once, after the sum
        return y, local

    def backward(self, ctx: Any, grad_out: np.ndarray) -> np.ndarray:
        local: np.ndarray = ctx
        check_last_dim("RowParallelLinear.backward", grad_out.shape, self.out_features,
                       "grad_out")
        g2 = grad_out.reshape(-1, self.out_features)
        self.weight.grad += g2.T @ local.reshape(-1, self.local_in_features)
        if self.bias is not None:
            self.bias.grad += g2.sum(axis=0)  # grad_out is replicated: no communication
        grad_in = grad_out @ self.weight.data
        if self.input_is_parallel:
            return grad_in
        return self.comm.all_gather_last(grad_in, self.in_features, "backward")

    def __repr__(self) -> str:
        return self._describe(f"{self.in_features}, {self.out_features}",
                              "" if self.input_is_parallel else ", input split here")


class VocabParallelEmbedding(_TensorParallel):
    """``Embedding`` with the table split along the vocabulary (module docstring).

    The direct constructor draws the whole ``Embedding(num_embeddings, embedding_dim)``
    from ``rng`` (N(0, 1), as ``Embedding``) and keeps this rank's rows. Like
    ``Embedding``, backward returns zeros of the ids' shape: integer ids have no
    gradient.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, group: Group | Blocking, *,
                 rng: np.random.Generator, dtype: Any = np.float64) -> None:
        self._adopt(Embedding(num_embeddings, embedding_dim, rng=rng, dtype=dtype), group)

    @classmethod
    def from_embedding(cls, embedding: Embedding,
                       group: Group | Blocking) -> VocabParallelEmbedding:
        """This rank's rows of ``embedding`` (copied; ``embedding`` is left as it is)."""
        return cls._cut(embedding, group)

    def _adopt(self, embedding: Embedding, group: Group | Blocking) -> None:
        if not isinstance(embedding, Embedding):
            raise TypeError(f"VocabParallelEmbedding: expected an Embedding, got "
                            f"{type(embedding).__name__}")
        self.num_embeddings = embedding.num_embeddings
        self.embedding_dim = embedding.embedding_dim
        self._setup(TPKind.EMBEDDING, group, embedding.weight.data, None)

    def forward(self, x: np.ndarray) -> tuple[np.ndarray, Any]:
        ids = np.asarray(x)
        integer = ids.dtype.kind in ("i", "u")
        low, high = (int(ids.min()), int(ids.max())) if ids.size and integer else (0, 0)
        check_ids("VocabParallelEmbedding.forward", str(ids.dtype), integer, low, high,
                  self.num_embeddings)
        shard = self.layout.shard
        outside = (ids < shard.start) | (ids >= shard.stop)
        local = np.where(outside, 0, ids - shard.start)
        y = self.weight.data[local]
        y[outside] = 0
        self.comm.all_reduce(y, "forward")
        return y, (local, outside)

    def backward(self, ctx: Any, grad_out: np.ndarray) -> np.ndarray:
        local, outside = ctx
        expected = (*local.shape, self.embedding_dim)
        if grad_out.shape != expected:
            raise ValueError(f"VocabParallelEmbedding.backward: expected grad_out of shape "
                             f"{expected}, got {grad_out.shape}")
        inside = ~outside
        np.add.at(self.weight.grad, local[inside], grad_out[inside])
        return np.zeros(local.shape, self.weight.data.dtype)

    def __repr__(self) -> str:
        return self._describe(f"{self.num_embeddings}, {self.embedding_dim}")
