"""The training state an elastic job keeps in step: named arrays, hashed and reloaded.

``ElasticState`` is what a joiner fetches and what the members agree on by hash. Give it
either a mapping of arrays that training updates in place (NumPy parameters and optimizer
buffers), or two callables as torch users know them: ``state_dict()`` returning a flat
mapping of names to arrays or CPU tensors, and ``load_state_dict(mapping)`` taking the
fetched NumPy arrays. The names and their order are the layout; every member must
produce the same layout (the layout is part of the hash, so a mismatch is caught).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from netdist.tensors import as_array, is_tensor

__all__ = ["ElasticState", "ArrayLayout", "layout_of", "state_digest"]

StateDict = Callable[[], Mapping[str, Any]]
LoadStateDict = Callable[[Mapping[str, np.ndarray]], None]


@dataclass(frozen=True, slots=True)
class ArrayLayout:
    """One entry of a state: its name, NumPy dtype string and shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        """Bytes of the array."""
        return int(np.dtype(self.dtype).itemsize * int(np.prod(self.shape, dtype=np.int64)))

    def to_list(self) -> list[Any]:
        """As plain msgpack data."""
        return [self.name, self.dtype, list(self.shape)]

    @classmethod
    def from_list(cls, item: Any) -> ArrayLayout:
        """From ``to_list``'s output (``ValueError`` if malformed)."""
        if (not isinstance(item, (list, tuple)) or len(item) != 3 or type(item[0]) is not str
                or type(item[1]) is not str
                or not all(type(d) is int and d >= 0 for d in item[2])):
            raise ValueError(f"malformed state layout entry {item!r}")
        return cls(item[0], str(np.dtype(item[1]).str), tuple(item[2]))


def _as_numpy(name: str, value: Any) -> np.ndarray:
    if is_tensor(value):
        value = as_array(value, f"state entry {name!r}")
    if not isinstance(value, np.ndarray):
        raise TypeError(f"state entry {name!r} is a {type(value).__name__}, not an array or "
                        "a CPU tensor")
    if not value.flags.c_contiguous:
        raise ValueError(f"state entry {name!r} is not C-contiguous")
    return value


def layout_of(arrays: Mapping[str, np.ndarray]) -> tuple[ArrayLayout, ...]:
    """The layout of ``arrays`` in their order."""
    return tuple(ArrayLayout(name, a.dtype.str, tuple(a.shape)) for name, a in arrays.items())


def state_digest(arrays: Mapping[str, np.ndarray], step: int) -> str:
    """A 128-bit BLAKE2b hex digest of the layout, the step and every array's bytes."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(repr((step, [entry.to_list() for entry in layout_of(arrays)])).encode())
    for array in arrays.values():
        digest.update(array.reshape(-1).view(np.uint8).data)
    return digest.hexdigest()


def _copy_into(held: dict[str, Any]) -> LoadStateDict:
    """A ``load_state_dict`` that copies fetched arrays into ``held``'s arrays."""

    def load(fetched: Mapping[str, np.ndarray]) -> None:
        for name, value in fetched.items():
            target = _as_numpy(name, held[name])
            if value is not target:  # fetched in place: nothing to copy
                np.copyto(target, value.reshape(target.shape), casting="no")

    return load


class ElasticState:
    """The state kept in step across members (see the module docstring)."""

    def __init__(self, arrays: Mapping[str, Any] | None = None, *,
                 state_dict: StateDict | None = None,
                 load_state_dict: LoadStateDict | None = None) -> None:
        if (arrays is None) == (state_dict is None):
            raise ValueError("give either arrays or state_dict (with load_state_dict)")
        if (state_dict is None) != (load_state_dict is None):
            raise ValueError("state_dict and load_state_dict go together")
        self._state_dict: StateDict
        self._load_state_dict: LoadStateDict
        if arrays is not None:  # arrays updated in place: read them, copy into them
            held = dict(arrays)
            self._state_dict, self._load_state_dict = (lambda: held), _copy_into(held)
        elif state_dict is not None and load_state_dict is not None:
            self._state_dict, self._load_state_dict = state_dict, load_state_dict
        self._extra: dict[str, tuple[Callable[[], np.ndarray], Callable[[np.ndarray], None]]] = {}

    def add(self, name: str, get: Callable[[], np.ndarray],
            load: Callable[[np.ndarray], None]) -> None:
        """Carry one more array, read by ``get`` and restored by ``load`` (the sampler's
        position, step counters)."""
        if name in self._extra:
            raise ValueError(f"state entry {name!r} is already carried")
        self._extra[name] = (get, load)

    def arrays(self) -> dict[str, np.ndarray]:
        """The current state as NumPy arrays (views where possible), in layout order."""
        out = {name: _as_numpy(name, value) for name, value in self._state_dict().items()}
        for name, (get, _) in self._extra.items():
            out[name] = np.ascontiguousarray(get())
        return out

    def load(self, fetched: Mapping[str, np.ndarray]) -> None:
        """Take ``fetched`` (same layout as ``arrays()``) as the state."""
        self._load_state_dict({name: a for name, a in fetched.items()
                               if name not in self._extra})
        for name, (_, load) in self._extra.items():
            load(fetched[name])
