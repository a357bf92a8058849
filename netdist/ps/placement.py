"""PURE placement of parameter tensors on the parameter servers (ps-lite / MXNet kvstore).

``plan_shards`` places tensors on ``S`` servers the way ps-lite and MXNet's kvstore do:
tensors of at least ``bigarray_bound`` elements are sliced evenly across *all* servers
(``netdist.sharding.chunk_bounds``), smaller ones are placed whole, in contiguous key
ranges balanced by size. Each server holds one flat buffer: its slices in key order.
``ParamSpec`` names a tensor and ``specs_from_arrays`` builds the specs of a model. The
result, a ``ShardPlan``, is identical on every rank, so workers and servers agree on
where every element lives without exchanging more than the specs.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from netdist.sharding import chunk_bounds
from netdist.types import CARRIED_DTYPES, dtype_from_wire, dtype_to_wire, is_bfloat16

__all__ = [
    "DEFAULT_BIGARRAY_BOUND",
    "ParamSpec",
    "ShardSlice",
    "ShardPlan",
    "plan_shards",
    "specs_from_arrays",
    "is_floating",
]

DEFAULT_BIGARRAY_BOUND = 1_000_000
"""Elements from which a tensor is sliced across all servers (MXNet's
``MXNET_KVSTORE_BIGARRAY_BOUND`` default)."""


def is_floating(dtype: np.dtype[Any]) -> bool:
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
    if not is_floating(dtype_from_wire(dtypes[0])):
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

