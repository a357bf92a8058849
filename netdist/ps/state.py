"""PURE parameter-server state: placement plans, flat layouts, optimizers, version clocks.

Nothing here waits or touches a socket, so every rank's view can be built and checked in
one process:

- ``plan_shards`` places tensors on ``S`` servers the way ps-lite and MXNet's kvstore do:
  tensors of at least ``bigarray_bound`` elements are sliced evenly across *all* servers
  (``netdist.sharding.chunk_bounds``), smaller ones are placed whole, in contiguous key
  ranges balanced by size. Each server holds one flat buffer: its slices in key order.
- ``FlatLayout`` packs a list of tensors into one flat buffer per dtype, so the sync
  server moves one message per chunk instead of one per tensor.
- ``ShardOptimizer`` applies SGD (momentum, Nesterov, weight decay) or Adam to a flat
  shard with exactly the arithmetic of ``netdist.train.optim`` (torch's update rules).
  The updates are elementwise, so a sharded step equals the unsharded step bit for bit.
- ``ServerShard`` is what a server holds: the master parameters, the optimizer and the
  values workers pull. bfloat16 parameters keep a float32 master copy and float32
  optimizer state (mixed-precision training's master weights); see ``ServerShard``.
- ``StalenessController`` is the server's version clock and bounded-staleness rule, with
  the per-update version log tests assert the bound from.
- ``ps_roles`` / ``num_servers_from_env`` say which ranks of a job serve.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from netdist.errors import ConfigError, ParameterServerError
from netdist.optim_kernels import (adam_update, check_adam_hyperparameters, check_lr,
                                    check_sgd_hyperparameters, sgd_update)
from netdist.sharding import chunk_bounds
from netdist.types import (
    CARRIED_DTYPES,
    bfloat16_to_float32,
    dtype_from_wire,
    dtype_to_wire,
    float32_to_bfloat16,
    is_bfloat16,
)

__all__ = [
    "DEFAULT_BIGARRAY_BOUND",
    "PS_SERVERS_ENV",
    "ParamSpec",
    "ShardSlice",
    "ShardPlan",
    "plan_shards",
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
]

DEFAULT_BIGARRAY_BOUND = 1_000_000
"""Elements from which a tensor is sliced across all servers (MXNet's
``MXNET_KVSTORE_BIGARRAY_BOUND`` default)."""

PS_SERVERS_ENV = "NETDIST_PS_SERVERS"
"""Environment variable naming how many of a job's ranks (the first ones) are servers."""

DEFAULT_PS_SERVERS = 2
"""Server ranks when ``NETDIST_PS_SERVERS`` is unset, for every mode (``netdist ps-server``,
``--aggregator ps-sharded`` / ``ps-async``); fewer only in a job too small to keep a worker
(``default_num_servers``)."""


# -- tensor specifications and placement ------------------------------------------------


def _is_float(dtype: np.dtype[Any]) -> bool:
    """Floating point, bfloat16 (``ml_dtypes``' or the raw-bits stand-in) included."""
    return dtype.kind == "f" or is_bfloat16(dtype)


def _dtype_name(dtype: np.dtype[Any]) -> str:
    """``dtype`` as users know it: the raw-bits stand-in is ``bfloat16`` too."""
    return "bfloat16" if is_bfloat16(dtype) else str(dtype)


@dataclass(frozen=True, slots=True)
class ParamSpec:
    """Name, shape and wire dtype name of one parameter tensor."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def to_wire(self) -> list[Any]:
        """A msgpack-able form: ``[name, [dims...], dtype]``."""
        return [self.name, list(self.shape), self.dtype]

    @classmethod
    def from_wire(cls, value: Any) -> ParamSpec:
        """Inverse of ``to_wire``; ``ValueError`` on anything malformed."""
        if (not isinstance(value, (list, tuple)) or len(value) != 3
                or not isinstance(value[0], str) or not isinstance(value[1], (list, tuple))
                or not isinstance(value[2], str)
                or not all(isinstance(d, int) and d >= 0 for d in value[1])):
            raise ValueError(f"malformed parameter spec {value!r}")
        if value[2] not in CARRIED_DTYPES:
            raise ValueError(f"parameter spec names unsupported dtype {value[2]!r}")
        return cls(value[0], tuple(int(d) for d in value[1]), value[2])


def specs_from_arrays(arrays: Sequence[np.ndarray] | Mapping[str, np.ndarray]
                      ) -> tuple[ParamSpec, ...]:
    """Specs for a list (keys ``"0"``, ``"1"``, ...) or a name -> array mapping (in order)."""
    if isinstance(arrays, Mapping):
        items = list(arrays.items())
    else:
        items = [(str(i), a) for i, a in enumerate(arrays)]
    if not items:
        raise ValueError("the parameter server needs at least one tensor")
    specs = []
    for name, array in items:
        if not isinstance(array, np.ndarray):
            raise TypeError(f"parameter {name!r} must be a numpy.ndarray, "
                            f"got {type(array).__name__}")
        specs.append(ParamSpec(str(name), tuple(int(d) for d in array.shape),
                               dtype_to_wire(array.dtype)))
    return tuple(specs)


@dataclass(frozen=True, slots=True)
class ShardSlice:
    """Elements ``[start, stop)`` of tensor ``key`` (flattened, C order), held by ``server``
    at ``[offset, offset + stop - start)`` of its flat buffer."""

    key: int
    start: int
    stop: int
    server: int
    offset: int

    @property
    def size(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True, slots=True)
class ShardPlan:
    """Where every element of every tensor lives; identical on every rank."""

    specs: tuple[ParamSpec, ...]
    num_servers: int
    bigarray_bound: int
    dtype: str
    slices: tuple[tuple[ShardSlice, ...], ...]
    """Per server, its slices in key order (the layout of its flat buffer)."""
    server_sizes: tuple[int, ...]

    def slices_of(self, server: int) -> tuple[ShardSlice, ...]:
        self._check_server(server)
        return self.slices[server]

    def key_slices(self, key: int) -> tuple[ShardSlice, ...]:
        """The slices of tensor ``key`` in element order."""
        found = [s for per in self.slices for s in per if s.key == key]
        return tuple(sorted(found, key=lambda s: s.start))

    def is_sliced(self, key: int) -> bool:
        """True when tensor ``key`` is spread over several servers."""
        return len(self.key_slices(key)) > 1

    def _check_server(self, server: int) -> None:
        if not 0 <= server < self.num_servers:
            raise ValueError(f"server {server} is outside 0..{self.num_servers - 1}")

    def check_arrays(self, arrays: Sequence[np.ndarray], *, writable: bool) -> None:
        """``ValueError``/``TypeError`` unless ``arrays`` have the planned shapes (and, when
        ``writable``, can be written in place)."""
        if len(arrays) != len(self.specs):
            raise ValueError(f"expected {len(self.specs)} tensors, got {len(arrays)}")
        for spec, array in zip(self.specs, arrays):
            if not isinstance(array, np.ndarray):
                raise TypeError(f"tensor {spec.name!r} must be a numpy.ndarray, "
                                f"got {type(array).__name__}")
            if array.shape != spec.shape:
                raise ValueError(f"tensor {spec.name!r} has shape {array.shape}, the "
                                 f"parameter server holds {spec.shape}")
            if writable and (not array.flags.c_contiguous or not array.flags.writeable):
                raise ValueError(f"tensor {spec.name!r} must be C-contiguous and writable "
                                 "to receive parameters in place")
            if array.dtype != dtype_from_wire(self.dtype) and (
                    writable or is_bfloat16(array.dtype)
                    or is_bfloat16(dtype_from_wire(self.dtype))):
                # reading another float dtype casts; bfloat16 raw bits never cast silently
                raise TypeError(f"tensor {spec.name!r} is {_dtype_name(array.dtype)}, the "
                                f"parameter server holds {self.dtype}")

    def pack(self, server: int, arrays: Sequence[np.ndarray],
             out: np.ndarray | None = None) -> np.ndarray:
        """Copy ``server``'s elements of ``arrays`` into one flat buffer (``out`` if given)."""
        self._check_server(server)
        self.check_arrays(arrays, writable=False)
        if out is None:
            out = np.empty(self.server_sizes[server], dtype=dtype_from_wire(self.dtype))
        elif out.shape != (self.server_sizes[server],):
            raise ValueError(f"pack buffer for server {server} must have shape "
                             f"({self.server_sizes[server]},), got {out.shape}")
        for s in self.slices[server]:
            flat = np.ravel(arrays[s.key])
            out[s.offset:s.offset + s.size] = flat[s.start:s.stop]
        return out

    def unpack(self, server: int, flat: np.ndarray, arrays: Sequence[np.ndarray]) -> None:
        """Copy ``server``'s flat buffer into its elements of ``arrays`` (in place)."""
        self._check_server(server)
        self.check_arrays(arrays, writable=True)
        if flat.shape != (self.server_sizes[server],):
            raise ValueError(f"flat buffer of server {server} must have shape "
                             f"({self.server_sizes[server]},), got {flat.shape}")
        for s in self.slices[server]:
            arrays[s.key].reshape(-1)[s.start:s.stop] = flat[s.offset:s.offset + s.size]

    def to_wire(self) -> list[Any]:
        """The inputs that rebuild this plan: specs, server count, bound."""
        return [[s.to_wire() for s in self.specs], self.num_servers, self.bigarray_bound]


def plan_shards(specs: Sequence[ParamSpec], num_servers: int, *,
                bigarray_bound: int = DEFAULT_BIGARRAY_BOUND) -> ShardPlan:
    """Place ``specs`` (in key order) on ``num_servers`` servers.

    A tensor with at least ``bigarray_bound`` elements (and at least one per server) is
    cut into ``num_servers`` contiguous slices by ``chunk_bounds``, one per server, so a
    large embedding or weight never makes one server the bottleneck. The remaining small
    tensors are placed whole: their keys are split into ``num_servers`` contiguous ranges
    of roughly equal total size (ps-lite's key ranges; a tensor goes to the range its
    midpoint falls in). All tensors must share one floating dtype (bfloat16 included): a
    server's shard is one flat buffer its optimizer updates in a single pass.
    """
    specs = tuple(specs)
    if not isinstance(num_servers, int) or isinstance(num_servers, bool):
        raise TypeError(f"num_servers must be an int, got {type(num_servers).__name__}")
    if num_servers < 1:
        raise ValueError(f"num_servers must be >= 1, got {num_servers}")
    if bigarray_bound < 1:
        raise ValueError(f"bigarray_bound must be >= 1, got {bigarray_bound}")
    if not specs:
        raise ValueError("the parameter server needs at least one tensor")
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"parameter names must be unique, got duplicates in {names}")
    dtypes = sorted({s.dtype for s in specs})
    if len(dtypes) != 1:
        raise TypeError(f"all parameters of a sharded parameter server must share one "
                        f"dtype, got {dtypes}")
    if not _is_float(dtype_from_wire(dtypes[0])):
        raise TypeError(f"parameters must be floating point, got {dtypes[0]}")

    big = [spec.size >= bigarray_bound and spec.size >= num_servers for spec in specs]
    small_keys = [k for k, is_big in enumerate(big) if not is_big]
    small_total = sum(specs[k].size for k in small_keys)
    home: dict[int, int] = {}
    cumulative = 0
    for index, key in enumerate(small_keys):
        size = specs[key].size
        if small_total == 0:
            home[key] = index * num_servers // len(small_keys)
        else:
            home[key] = min(num_servers - 1,
                            (2 * cumulative + size) * num_servers // (2 * small_total))
        cumulative += size

    per_server: list[list[ShardSlice]] = [[] for _ in range(num_servers)]
    offsets = [0] * num_servers
    for key, spec in enumerate(specs):
        if big[key]:
            pieces = [(server, start, stop) for server, (start, stop)
                      in enumerate(chunk_bounds(spec.size, num_servers))]
        else:
            pieces = [(home[key], 0, spec.size)]
        for server, start, stop in pieces:
            per_server[server].append(ShardSlice(key, start, stop, server, offsets[server]))
            offsets[server] += stop - start
    return ShardPlan(specs, num_servers, bigarray_bound, dtypes[0],
                     tuple(tuple(s) for s in per_server), tuple(offsets))


DIRECT_SEGMENT_BYTES = 256 * 1024
"""Slices of at least this many bytes travel as their own message, straight from the
gradient tensor and straight into the parameter tensor; smaller ones are packed."""


@dataclass(frozen=True, slots=True)
class Segment:
    """One message between a worker and a server: a run of the server's flat buffer.

    ``direct`` segments are a single large slice, sent from the worker's tensor memory
    and received into it without packing; the others pack consecutive small slices.
    """

    index: int
    offset: int
    size: int
    slices: tuple[ShardSlice, ...]
    direct: bool


def plan_segments(plan: ShardPlan, server: int, *,
                  direct_bytes: int = DIRECT_SEGMENT_BYTES) -> tuple[Segment, ...]:
    """Cut ``server``'s buffer into messages: big slices alone, small ones packed together.

    Both sides of the wire derive the same segments from the same plan.
    """
    itemsize = dtype_from_wire(plan.dtype).itemsize
    segments: list[Segment] = []
    run: list[ShardSlice] = []

    def flush() -> None:
        if run:
            size = sum(s.size for s in run)
            segments.append(Segment(len(segments), run[0].offset, size, tuple(run), False))
            run.clear()

    for piece in plan.slices_of(server):
        if piece.size * itemsize >= direct_bytes:
            flush()
            segments.append(Segment(len(segments), piece.offset, piece.size, (piece,), True))
        else:
            run.append(piece)
    flush()
    return tuple(segments)


# -- flat layout for the sync server ----------------------------------------------------


@dataclass(frozen=True, slots=True)
class FlatLayout:
    """Tensors packed into one flat buffer per dtype (groups in order of first use)."""

    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    """Wire dtype name per tensor."""
    group_dtypes: tuple[str, ...]
    group_sizes: tuple[int, ...]
    placement: tuple[tuple[int, int, int], ...]
    """Per tensor: ``(group, offset, size)``."""

    @classmethod
    def from_arrays(cls, arrays: Sequence[np.ndarray]) -> FlatLayout:
        if isinstance(arrays, np.ndarray):
            raise TypeError("expected a list of arrays, got a single numpy.ndarray")
        shapes, dtypes, placement = [], [], []
        group_of: dict[str, int] = {}
        sizes: list[int] = []
        for index, array in enumerate(arrays):
            if not isinstance(array, np.ndarray):
                raise TypeError(f"tensor {index} must be a numpy.ndarray, "
                                f"got {type(array).__name__}")
            name = dtype_to_wire(array.dtype)
            group = group_of.setdefault(name, len(group_of))
            if group == len(sizes):
                sizes.append(0)
            placement.append((group, sizes[group], int(array.size)))
            sizes[group] += int(array.size)
            shapes.append(tuple(int(d) for d in array.shape))
            dtypes.append(name)
        return cls(tuple(shapes), tuple(dtypes), tuple(group_of), tuple(sizes),
                   tuple(placement))

    def signature(self) -> list[Any]:
        """A msgpack-able description two ranks can compare."""
        return [[list(s) for s in self.shapes], list(self.dtypes)]

    def group_dtype(self, group: int) -> np.dtype[Any]:
        return dtype_from_wire(self.group_dtypes[group])

    def empty(self) -> list[np.ndarray]:
        """Fresh (uninitialised) flat buffers, one per group."""
        return [np.empty(size, dtype=self.group_dtype(g))
                for g, size in enumerate(self.group_sizes)]

    def check(self, arrays: Sequence[np.ndarray]) -> None:
        """``ValueError`` unless ``arrays`` match this layout tensor by tensor."""
        if len(arrays) != len(self.shapes):
            raise ValueError(f"expected {len(self.shapes)} tensors, got {len(arrays)}")
        for index, (array, shape, dtype) in enumerate(zip(arrays, self.shapes, self.dtypes)):
            if array.shape != shape or dtype_to_wire(array.dtype) != dtype:
                raise ValueError(f"tensor {index} is {array.dtype}{list(array.shape)}, "
                                 f"expected {dtype}{list(shape)}")

    def flatten(self, arrays: Sequence[np.ndarray],
                out: Sequence[np.ndarray] | None = None) -> list[np.ndarray]:
        """Copy ``arrays`` into flat group buffers (fresh ones unless ``out`` is given)."""
        self.check(arrays)
        flats = self.empty() if out is None else list(out)
        for array, (group, offset, size) in zip(arrays, self.placement):
            flats[group][offset:offset + size] = np.ravel(array)
        return flats

    def unflatten(self, flats: Sequence[np.ndarray]) -> list[np.ndarray]:
        """Views of ``flats`` shaped like the original tensors (no copy)."""
        return [flats[group][offset:offset + size].reshape(shape)
                for (group, offset, size), shape in zip(self.placement, self.shapes)]

    def copy_into(self, flats: Sequence[np.ndarray], arrays: Sequence[np.ndarray]) -> None:
        """Copy ``flats`` into ``arrays`` in place."""
        self.check(arrays)
        for array, view in zip(arrays, self.unflatten(flats)):
            np.copyto(array, view)


@dataclass(frozen=True, slots=True)
class Piece:
    """One message of a sync round: elements of one tensor, or several small tensors.

    ``parts`` are ``(tensor, start, stop)`` flat element ranges, concatenated in order.
    A ``direct`` piece is one range of one large tensor: it is sent from the tensor's own
    memory and received straight into the result tensor, never packed.
    """

    index: int
    dtype: str
    size: int
    parts: tuple[tuple[int, int, int], ...]
    direct: bool

    def view(self, arrays: Sequence[np.ndarray]) -> np.ndarray | None:
        """For a direct piece of a C-contiguous tensor: a view of its elements, else None."""
        if not self.direct:
            return None
        tensor, start, stop = self.parts[0]
        array = arrays[tensor]
        if not array.flags.c_contiguous:
            return None
        return array.reshape(-1)[start:stop]

    def pack(self, arrays: Sequence[np.ndarray], out: np.ndarray) -> np.ndarray:
        """Copy the piece's elements of ``arrays`` into ``out`` (``size`` elements)."""
        offset = 0
        for tensor, start, stop in self.parts:
            out[offset:offset + stop - start] = np.ravel(arrays[tensor])[start:stop]
            offset += stop - start
        return out

    def unpack(self, flat: np.ndarray, arrays: Sequence[np.ndarray]) -> None:
        """Copy ``flat`` back into the piece's elements of ``arrays`` (C-contiguous)."""
        offset = 0
        for tensor, start, stop in self.parts:
            arrays[tensor].reshape(-1)[start:stop] = flat[offset:offset + stop - start]
            offset += stop - start


def plan_pieces(layout: FlatLayout, chunk_bytes: int, *,
                direct_bytes: int = DIRECT_SEGMENT_BYTES) -> tuple[Piece, ...]:
    """Cut a tensor list into the messages of a sync round, in tensor order.

    Tensors of at least ``direct_bytes`` are split into direct pieces of at most
    ``chunk_bytes`` (so the server can sum and return early chunks while later ones
    arrive); runs of smaller tensors of one dtype are packed into pieces of at most
    ``chunk_bytes``. Both sides derive the same pieces from the same layout.
    """
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
    pieces: list[Piece] = []
    run: list[tuple[int, int, int]] = []
    run_dtype = ""
    run_bytes = 0

    def flush() -> None:
        nonlocal run_bytes
        if run:
            size = sum(stop - start for _, start, stop in run)
            pieces.append(Piece(len(pieces), run_dtype, size, tuple(run), False))
            run.clear()
        run_bytes = 0

    for tensor, (shape, dtype) in enumerate(zip(layout.shapes, layout.dtypes)):
        size = math.prod(shape)
        itemsize = dtype_from_wire(dtype).itemsize
        nbytes = size * itemsize
        if nbytes >= direct_bytes:
            flush()
            per = max(1, chunk_bytes // itemsize)
            for start, stop in chunk_bounds(size, -(-size // per)):
                pieces.append(Piece(len(pieces), dtype, stop - start,
                                    ((tensor, start, stop),), True))
            continue
        if run and (dtype != run_dtype or run_bytes + nbytes > chunk_bytes):
            flush()
        run_dtype = dtype
        run.append((tensor, 0, size))
        run_bytes += nbytes
    flush()
    return tuple(pieces)


# -- optimizers on flat shards ----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SGDConfig:
    """SGD with torch's momentum, Nesterov, dampening and weight decay."""

    lr: float
    momentum: float = 0.0
    nesterov: bool = False
    weight_decay: float = 0.0
    dampening: float = 0.0

    def __post_init__(self) -> None:
        check_lr(self.lr)
        check_sgd_hyperparameters(momentum=self.momentum, nesterov=self.nesterov,
                                  weight_decay=self.weight_decay, dampening=self.dampening)

    def to_dict(self) -> dict[str, Any]:
        return {"name": "sgd", **dataclasses.asdict(self)}


@dataclass(frozen=True, slots=True)
class AdamConfig:
    """Adam with torch's bias correction and L2 weight decay (optionally AMSGrad)."""

    lr: float = 1e-3
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    amsgrad: bool = False

    def __post_init__(self) -> None:
        check_lr(self.lr)
        check_adam_hyperparameters(beta1=self.beta1, beta2=self.beta2, eps=self.eps,
                                   weight_decay=self.weight_decay)

    def to_dict(self) -> dict[str, Any]:
        return {"name": "adam", **dataclasses.asdict(self)}


OptimizerConfig = SGDConfig | AdamConfig


def optimizer_config_from_dict(value: Any) -> OptimizerConfig:
    """Rebuild an optimizer config from ``to_dict()`` output; ``ValueError`` if malformed."""
    if not isinstance(value, Mapping) or value.get("name") not in ("sgd", "adam"):
        raise ValueError(f"malformed optimizer config {value!r}")
    cls: type[SGDConfig] | type[AdamConfig] = SGDConfig if value["name"] == "sgd" else AdamConfig
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = set(value) - fields - {"name"}
    if unknown:
        raise ValueError(f"unknown {value['name']} option(s) {sorted(unknown)}")
    try:
        return cls(**{k: v for k, v in value.items() if k != "name"})
    except TypeError as exc:
        raise ValueError(f"malformed optimizer config {value!r}: {exc}") from None


class ShardOptimizer:
    """One optimizer over one flat shard, with ``netdist.train.optim``'s exact arithmetic.

    The shard steps as a unit, so Adam's step counter is shared by all of its elements,
    just as every tensor of a model steps together in local training.
    """

    def __init__(self, config: OptimizerConfig, size: int, dtype: np.dtype[Any] | str) -> None:
        if not isinstance(config, (SGDConfig, AdamConfig)):
            raise TypeError(f"config must be SGDConfig or AdamConfig, "
                            f"got {type(config).__name__}")
        self.config = config
        self.size = int(size)
        self.dtype = np.dtype(dtype)
        self.steps = 0
        self.state: dict[str, np.ndarray] = {}
        self._scratch_buf: np.ndarray | None = None

    def step(self, param: np.ndarray, grad: np.ndarray) -> None:
        """Update ``param`` in place from ``grad`` (both flat, ``size`` elements)."""
        if param.shape != (self.size,) or grad.shape != (self.size,):
            raise ValueError(f"shard optimizer holds {self.size} elements, got param "
                             f"{param.shape} and grad {grad.shape}")
        self.steps += 1
        if isinstance(self.config, SGDConfig):
            self._sgd(self.config, param, grad)
        else:
            self._adam(self.config, param, grad)

    def _sgd(self, c: SGDConfig, p: np.ndarray, grad: np.ndarray) -> None:
        # the scratch array spares a shard-sized temporary per product (same bits)
        buf = sgd_update(p, grad, self.state.get("momentum_buffer"), lr=c.lr,
                         momentum=c.momentum, nesterov=c.nesterov,
                         weight_decay=c.weight_decay, dampening=c.dampening,
                         scratch=self._scratch(p))
        if buf is not None:
            self.state["momentum_buffer"] = buf

    def _scratch(self, p: np.ndarray) -> np.ndarray:
        if self._scratch_buf is None or self._scratch_buf.shape != p.shape:
            self._scratch_buf = np.empty_like(p)
        return self._scratch_buf

    def _adam(self, c: AdamConfig, p: np.ndarray, grad: np.ndarray) -> None:
        if "exp_avg" not in self.state:
            self.state["exp_avg"] = np.zeros_like(p)
            self.state["exp_avg_sq"] = np.zeros_like(p)
            if c.amsgrad:
                self.state["max_exp_avg_sq"] = np.zeros_like(p)
        adam_update(p, grad, self.state["exp_avg"], self.state["exp_avg_sq"], step=self.steps,
                    lr=c.lr, beta1=c.beta1, beta2=c.beta2, eps=c.eps,
                    weight_decay=c.weight_decay,
                    max_exp_avg_sq=self.state["max_exp_avg_sq"] if c.amsgrad else None)


def master_dtype(wire_dtype: str) -> np.dtype[Any]:
    """The dtype a server keeps parameters of wire dtype ``wire_dtype`` in.

    float32 for bfloat16 (as mixed-precision training keeps float32 master weights: an
    update smaller than half a bfloat16 ulp of the weight would otherwise be lost, and
    NumPy has no bfloat16 arithmetic without ``ml_dtypes``); the dtype itself otherwise.
    """
    dtype = dtype_from_wire(wire_dtype)
    return np.dtype(np.float32) if is_bfloat16(dtype) else dtype


class ServerShard:
    """One server's flat shard: master parameters, optimizer, and what workers pull.

    ``initial`` holds the shard's initial values in the wire dtype. ``apply(grads,
    divisor)`` sums the given gradients (wire dtype) in the order given, divides by
    ``divisor`` and runs the optimizer on the master parameters; ``wire`` then holds the
    values workers pull.

    For float16/32/64 the master *is* the wire buffer and the arithmetic is exactly
    ``netdist.train.optim``'s in that dtype, as before. For bfloat16 the server keeps
    float32 master parameters and float32 optimizer state (``master_dtype``): each
    gradient is widened to float32 (exact), they are summed in float32 in the given
    order and divided once, the float32 optimizer step updates the master, and ``wire``
    is the master rounded to bfloat16 to nearest even, as ``tensor.to(torch.bfloat16)``
    rounds. So a bfloat16 model trained through the servers follows float32 training
    of its master weights, and workers get bfloat16 back.
    """

    def __init__(self, config: OptimizerConfig, initial: np.ndarray) -> None:
        if initial.ndim != 1:
            raise ValueError(f"a server shard is flat, got shape {initial.shape}")
        if not _is_float(initial.dtype):
            raise TypeError(f"parameters must be floating point, got {initial.dtype}")
        self.wire = initial
        """The shard as workers pull it (wire dtype)."""
        self.mixed = is_bfloat16(initial.dtype)
        """True when ``master`` is a float32 copy of bfloat16 parameters."""
        self.master = bfloat16_to_float32(initial) if self.mixed else initial
        """The parameters the optimizer updates (``wire`` itself unless ``mixed``)."""
        size = int(initial.size)
        self.optimizer = ShardOptimizer(config, size, self.master.dtype)
        self._acc = np.empty(size, self.master.dtype)
        self._wide = np.empty(size, np.float32) if self.mixed else None

    @property
    def size(self) -> int:
        return int(self.wire.size)

    def apply(self, grads: Sequence[np.ndarray], divisor: int) -> None:
        """One update from ``grads`` (flat, wire dtype), summed in order, divided once."""
        if not grads:
            raise ValueError("an update needs at least one gradient")
        acc = self._acc
        if self._wide is None:
            if len(grads) == 1:
                np.copyto(acc, grads[0])
            else:  # same bits as copy-then-add, one pass fewer
                np.add(grads[0], grads[1], out=acc)
            for g in grads[2:]:
                np.add(acc, g, out=acc)
        else:
            bfloat16_to_float32(grads[0], out=acc)
            for g in grads[1:]:
                np.add(acc, bfloat16_to_float32(g, out=self._wide), out=acc)
        np.divide(acc, divisor, out=acc)
        self.optimizer.step(self.master, acc)
        if self.mixed:
            float32_to_bfloat16(self.master, out=self.wire)


# -- versions and bounded staleness -----------------------------------------------------


class WorkerState(enum.Enum):
    """Where a worker is in its pull -> compute -> push cycle, as the server sees it."""

    COMPUTING = "computing"
    """Pulled (or initialised) at ``base``; its next gradient is computed on that version."""
    PENDING = "pending"
    """Pushed a gradient the server holds until the staleness rule lets it apply."""
    APPLIED = "applied"
    """Its push was applied; it has not pulled since (it still counts at its old base)."""
    DONE = "done"


@dataclass(frozen=True, slots=True)
class VersionLogEntry:
    """One applied push: who, on which version it was computed, onto which it was applied."""

    worker: int
    """Worker index (0-based among the workers)."""
    worker_version: int
    """Server version of the parameters the gradient was computed on."""
    server_version: int
    """Server version the update was applied to (the new version is this plus one)."""

    @property
    def staleness(self) -> int:
        """Updates the gradient missed: ``server_version - worker_version``."""
        return self.server_version - self.worker_version


class StalenessController:
    """The server's version clock and the rule deciding when held pushes apply.

    The version counts applied updates. Each worker pulls parameters at some version
    (its *base*), computes a gradient on them and pushes it. The rule guarantees that
    every applied gradient is at most ``max_staleness`` versions old:

    - ``max_staleness=None`` (fully asynchronous): every push applies on arrival, alone.
    - otherwise the pending pushes with the oldest base apply together as one update,
      but only if, afterwards, no other active worker's base (the version it last
      pulled) is more than ``max_staleness`` versions behind. Workers that got ahead
      therefore wait -- their pull is answered once their push has applied -- until the
      slowest one pushes and pulls (stale synchronous parallel). A worker whose push
      has applied but who has not pulled yet still counts at its old base, so one fast
      worker cannot slip several updates in before the others have even read the last.
    - ``max_staleness=0`` is synchronous training: an update applies once every active
      worker has pushed a gradient computed on the current version, all of them
      together, so every update is the average over all workers in worker order.

    When every active worker holds a pending push the oldest ones can always apply, so
    the rule never deadlocks; a worker that stops pushing (or pulling) is caught by the
    timeout.
    """

    def __init__(self, num_workers: int, max_staleness: int | None) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        if max_staleness is not None and (not isinstance(max_staleness, int)
                                          or isinstance(max_staleness, bool)
                                          or max_staleness < 0):
            raise ValueError(f"max_staleness must be None or an int >= 0, got {max_staleness!r}")
        self.num_workers = num_workers
        self.max_staleness = max_staleness
        self.version = 0
        self.log: list[VersionLogEntry] = []
        self._state = [WorkerState.COMPUTING] * num_workers
        self._base = [0] * num_workers
        self._arrival = [0] * num_workers
        self._arrivals = 0
        self._finishing: set[int] = set()

    def state(self, worker: int) -> WorkerState:
        return self._state[worker]

    def base(self, worker: int) -> int:
        """The version worker ``worker`` last pulled."""
        return self._base[worker]

    @property
    def active(self) -> list[int]:
        """Workers that have not finished."""
        return [w for w, s in enumerate(self._state) if s is not WorkerState.DONE]

    @property
    def all_done(self) -> bool:
        return all(s is WorkerState.DONE for s in self._state)

    @property
    def pending(self) -> list[int]:
        return [w for w, s in enumerate(self._state) if s is WorkerState.PENDING]

    @property
    def blocked(self) -> bool:
        """True when pushes are held back by a lagging worker."""
        return bool(self.pending) and self.next_update() is None

    def check_push(self, worker: int, base: int) -> None:
        """Raise ``ParameterServerError`` unless ``worker`` may push a gradient of ``base``."""
        state = self._state[worker]
        if state is WorkerState.DONE or worker in self._finishing:
            raise ParameterServerError(f"worker {worker} pushed after finishing")
        if state is WorkerState.PENDING:
            raise ParameterServerError(
                f"worker {worker} pushed again before its previous push was applied")
        if state is WorkerState.APPLIED and self.max_staleness is not None:
            raise ParameterServerError(
                f"worker {worker} pushed twice without pulling; with max_staleness="
                f"{self.max_staleness} every push must be followed by a pull")
        if base != self._base[worker]:
            raise ParameterServerError(
                f"worker {worker} pushed a gradient of version {base}, but the last "
                f"version it pulled is {self._base[worker]}")

    def on_push(self, worker: int, base: int) -> None:
        """Record a push of a gradient computed on version ``base`` (it is now pending).

        Call it only once the gradient has fully arrived: from here on, any state change
        may apply it.
        """
        self.check_push(worker, base)
        self._state[worker] = WorkerState.PENDING
        self._arrivals += 1
        self._arrival[worker] = self._arrivals

    def next_update(self) -> tuple[int, ...] | None:
        """The workers whose pending pushes apply next (as one update), or None to wait."""
        pending = self.pending
        if not pending:
            return None
        if self.max_staleness is None:
            return (min(pending, key=lambda w: self._arrival[w]),)
        oldest = min(self._base[w] for w in pending)
        group = tuple(w for w in pending if self._base[w] == oldest)
        others = [self._base[w] for w, s in enumerate(self._state)
                  if w not in group and s is not WorkerState.DONE]
        if others and self.version + 1 - min(others) > self.max_staleness:
            return None
        return group

    def commit(self, workers: Sequence[int]) -> list[VersionLogEntry]:
        """Apply ``workers``' pending pushes as one update: log them, advance the version."""
        entries = []
        for w in workers:
            if self._state[w] is not WorkerState.PENDING:
                raise ParameterServerError(f"worker {w} has no pending push to apply")
            entry = VersionLogEntry(w, self._base[w], self.version)
            if self.max_staleness is not None and entry.staleness > self.max_staleness:
                raise ParameterServerError(
                    f"internal error: applying worker {w}'s push would exceed "
                    f"max_staleness={self.max_staleness} (staleness {entry.staleness})")
            entries.append(entry)
        for w in workers:
            if w in self._finishing:
                self._finishing.discard(w)
                self._state[w] = WorkerState.DONE
            else:
                self._state[w] = WorkerState.APPLIED
        self.version += 1
        self.log.extend(entries)
        return entries

    def can_pull(self, worker: int) -> bool:
        """A pull is answered once the worker's own push (if any) has applied."""
        return self._state[worker] is not WorkerState.PENDING

    def on_pull(self, worker: int) -> int:
        """Answer a pull: the worker now computes on the current version, returned."""
        state = self._state[worker]
        if state is WorkerState.DONE or worker in self._finishing:
            raise ParameterServerError(f"worker {worker} pulled after finishing")
        if state is WorkerState.PENDING:
            raise ParameterServerError(f"worker {worker} pulled while its push is pending")
        self._state[worker] = WorkerState.COMPUTING
        self._base[worker] = self.version
        return self.version

    def finish(self, worker: int) -> None:
        """The worker is done and no longer holds the others back.

        A push it left pending still applies, under the usual rule; the worker counts
        as done from then on.
        """
        if self._state[worker] is WorkerState.PENDING:
            self._finishing.add(worker)
        else:
            self._state[worker] = WorkerState.DONE

    @property
    def max_observed_staleness(self) -> int:
        return max((e.staleness for e in self.log), default=0)


# -- roles --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PSRoles:
    """Ranks ``0 .. num_servers-1`` serve; the others are workers.

    With ``colocated`` every rank is a worker and the first ``num_servers`` ranks also
    host a server (as BytePS and MXNet deployments often do): no rank sits idle.
    """

    world_size: int
    num_servers: int
    colocated: bool = False

    def __post_init__(self) -> None:
        if self.colocated:
            if not 1 <= self.num_servers <= self.world_size:
                raise ConfigError(
                    f"a job of {self.world_size} ranks can host 1..{self.world_size} "
                    f"co-located parameter servers, got {self.num_servers}")
        elif not 1 <= self.num_servers < self.world_size:
            raise ConfigError(
                f"a job of {self.world_size} ranks can have 1..{self.world_size - 1} "
                f"dedicated parameter servers (at least one worker), got {self.num_servers}")

    @property
    def server_ranks(self) -> range:
        return range(self.num_servers)

    @property
    def worker_ranks(self) -> range:
        return range(0 if self.colocated else self.num_servers, self.world_size)

    @property
    def num_workers(self) -> int:
        return len(self.worker_ranks)

    def is_server(self, rank: int) -> bool:
        return 0 <= rank < self.num_servers

    def is_worker(self, rank: int) -> bool:
        return rank in self.worker_ranks

    def worker_index(self, rank: int) -> int:
        """0-based index of worker ``rank`` (its position among the workers)."""
        if rank not in self.worker_ranks:
            raise ValueError(f"rank {rank} is not a worker rank "
                             f"({self.worker_ranks.start}..{self.world_size - 1})")
        return rank - self.worker_ranks.start


def ps_roles(world_size: int, num_servers: int, *, colocated: bool = False) -> PSRoles:
    """Roles of a job with ``num_servers`` servers on ranks ``0..num_servers-1``."""
    return PSRoles(world_size, num_servers, colocated)


def default_num_servers(world_size: int, *, colocated: bool = False) -> int:
    """``DEFAULT_PS_SERVERS``, or fewer when the job is too small to keep a worker rank.

    Dedicated servers (``colocated=False``) leave at least one rank to work:
    ``min(2, world_size - 1)``; co-located servers also train: ``min(2, world_size)``.
    Never below 1 (a 1-rank dedicated job is then refused by ``ps_roles``).
    """
    limit = world_size if colocated else world_size - 1
    return max(1, min(DEFAULT_PS_SERVERS, limit))


def num_servers_from_env(environ: Mapping[str, str] | None = None, *,
                         default: int | None = None, world_size: int | None = None,
                         colocated: bool = False) -> int:
    """Read ``NETDIST_PS_SERVERS`` (the number of leading server ranks).

    Unset or empty: ``default`` if given, else ``default_num_servers(world_size,
    colocated=colocated)`` when the world size is known, else ``DEFAULT_PS_SERVERS``.
    """
    env = os.environ if environ is None else environ
    text = env.get(PS_SERVERS_ENV, "").strip()
    if not text:
        if default is not None:
            return default
        if world_size is not None:
            return default_num_servers(world_size, colocated=colocated)
        return DEFAULT_PS_SERVERS
    try:
        value = int(text)
    except ValueError:
        raise ConfigError(f"{PS_SERVERS_ENV}={text!r} is not an integer") from None
    if value < 1:
        raise ConfigError(f"{PS_SERVERS_ENV} must be >= 1, got {value}")
    return value
