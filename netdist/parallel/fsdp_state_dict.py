"""FSDP's state-dict adapters: its units' storage as checkpoint pieces and whole tensors.

- ``sharded_arrays``: this rank's 1-D pieces of every flattened parameter (and optimizer
  state ``"optim.<param>.<key>"``), views of live storage, each with its
  ``netdist.sharding.TensorShardSpec`` (a ``FlatShardSpec``, which also reads as the
  mapping of its arguments). Replica 0 names itself owner; other replicas report empty
  pieces.
- ``load_sharded_arrays`` / ``load_full``: copy pieces or whole tensors into storage.
- ``full_params`` / ``full_optim_state``: whole tensors, all-gathered one unit at a time.

Communication (gathers, the broadcast to other replicas after a load) goes through the
``GatherReduceSchedule``; the ``ShardingPolicy`` says what is sharded.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from netdist.parallel.flat_param import dtype_name
from netdist.parallel.fsdp_schedule import GatherReduceSchedule
from netdist.parallel.fsdp_strategy import ShardingPolicy
from netdist.parallel.fsdp_units import Unit
from netdist.sharding import TensorShardSpec
from netdist.tensors import as_array, is_tensor
from netdist.types import is_bfloat16

__all__ = [
    "ShardedStateDict",
    "StateOf",
    "sharded_arrays",
    "load_sharded_arrays",
    "load_full",
    "full_params",
    "full_optim_state",
    "copy_into",
]

StateOf = Callable[[Unit], dict[str, np.ndarray]]
"""A unit's optimizer state arrays by key (allocated on first use)."""

@dataclass(frozen=True, slots=True)
class ShardedStateDict:
    """What this rank owns: local 1-D pieces of each flattened tensor, and their specs.

    ``tensors[name]`` views live storage (writing into it, e.g. by an in-place
    checkpoint load, changes the model): NumPy views, or tensors over them for a module
    whose parameters are tensors. ``specs[name]`` is its ``TensorShardSpec``
    (``full_shape`` ``(numel,)``, ``shard_dim`` 0 or None for replicated, ``shard_sizes``
    per *world* rank, ``dtype``, the layout's dtype name). ``shapes`` maps
    each parameter to its original shape; ``step`` and ``hyperparams`` describe the
    optimizer (``hyperparams`` is empty without one).
    """

    tensors: dict[str, Any]
    specs: dict[str, TensorShardSpec]
    shapes: dict[str, tuple[int, ...]]
    step: int
    hyperparams: dict[str, Any]


def sharded_arrays(units: Sequence[Unit], policy: ShardingPolicy, state_of: StateOf | None,
                   step: int, hyperparams: dict[str, Any]) -> ShardedStateDict:
    """This rank's pieces as NumPy views (``state_of`` None: no optimizer state)."""
    tensors: dict[str, np.ndarray] = {}
    specs: dict[str, TensorShardSpec] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    sharded = policy.shards_gradients   # else every rank holds everything (replicated)
    owner = policy.reports_shards
    for unit in units:
        layout = unit.layout
        state = state_of(unit) if state_of is not None else {}
        pieces = {piece.slot: piece for piece in layout.pieces(policy.shard_index)}
        for index, slot in enumerate(layout.slots):
            shapes[slot.name] = slot.shape
            arrays = {slot.name: unit.shard}
            arrays.update({f"optim.{slot.name}.{key}": value for key, value in state.items()})
            if not sharded:
                spec = TensorShardSpec((slot.numel,), None, (), layout.dtype)
                for name, array in arrays.items():
                    tensors[name] = array[slot.offset:slot.offset + slot.numel]
                    specs[name] = spec
                continue
            sizes = policy.checkpoint_shard_sizes(layout.param_shard_sizes(index))
            spec = TensorShardSpec((slot.numel,), 0, sizes, layout.dtype)
            piece = pieces.get(index)
            for name, array in arrays.items():
                if piece is None or not owner:
                    tensors[name] = array[0:0]
                else:
                    tensors[name] = array[piece.shard_start:piece.shard_start + piece.numel]
                specs[name] = spec
    return ShardedStateDict(tensors, specs, shapes, step, hyperparams)


def load_sharded_arrays(current: ShardedStateDict, tensors: Mapping[str, Any]) -> None:
    """Copy ``tensors`` into ``current``'s views (names must match exactly)."""
    missing = sorted(set(current.tensors) - set(tensors))
    unexpected = sorted(set(tensors) - set(current.tensors))
    if missing or unexpected:
        raise ValueError(f"sharded state dict mismatch: missing {missing}, "
                         f"unexpected {unexpected}")
    for name, target in current.tensors.items():
        copy_into(target, tensors[name], repr(name))


def load_full(units: Sequence[Unit], policy: ShardingPolicy, state: Mapping[str, Any]) -> None:
    """Copy whole parameters into local storage: each rank keeps the slice it owns."""
    names = {slot.name for unit in units for slot in unit.layout.slots}
    missing = sorted(names - set(state))
    unexpected = sorted(set(state) - names)
    if missing or unexpected:
        raise ValueError(f"state dict mismatch: missing {missing}, unexpected {unexpected}")
    for unit in units:
        layout = unit.layout
        flat = layout.flatten([state[slot.name] for slot in layout.slots])
        if unit.full is not None:
            unit.full[...] = flat
        else:
            lo, hi = layout.shard_bounds(policy.shard_index)
            unit.shard[...] = flat[lo:hi]


async def full_params(units: Sequence[Unit], schedule: GatherReduceSchedule, keep: bool
                      ) -> dict[str, Any]:
    """Whole parameters (copies, original shapes) by name; ``{}`` unless ``keep``."""
    out: dict[str, Any] = {}
    for unit in units:
        flat, temporary = await schedule.gather_flat(unit, unit.shard, unit.full)
        if keep and flat is not None:
            for slot, view in zip(unit.layout.slots, unit.layout.views(flat)):
                out[slot.name] = schedule.view.expose(view.copy())
        if temporary:
            schedule.memory.free(flat)
    return out


async def full_optim_state(units: Sequence[Unit], schedule: GatherReduceSchedule,
                           state_of: StateOf, keep: bool, step: int | None
                           ) -> dict[str, dict[str, Any]]:
    """Whole optimizer state by parameter name and key (``"step": step`` added to each
    entry unless ``step`` is None); ``{}`` unless ``keep``."""
    state: dict[str, dict[str, Any]] = {}
    for unit in units:
        for key, value in state_of(unit).items():
            local = np.zeros(unit.layout.shard_numel, unit.layout.np_dtype)
            local[:unit.valid] = value
            flat, temporary = await schedule.gather_flat(unit, local, None)
            if keep and flat is not None:
                for slot, view in zip(unit.layout.slots, unit.layout.views(flat)):
                    entry = state.setdefault(slot.name, {})
                    entry[key] = schedule.view.expose(view.copy())
                    if step is not None:
                        entry["step"] = step
            if temporary:
                schedule.memory.free(flat)
    return state


def copy_into(target: np.ndarray, value: Any, what: str) -> None:
    """``target[...] = value`` for a state-dict entry (array or tensor); bfloat16 only
    from bfloat16, copied as bits (``TypeError`` otherwise, naming ``what``)."""
    array = as_array(value, what) if is_tensor(value) else np.asarray(value)
    if array.shape != target.shape:
        raise ValueError(f"{what}: local shape {array.shape}, this rank holds {target.shape}")
    if is_bfloat16(array.dtype) != is_bfloat16(target.dtype):
        raise TypeError(f"{what}: dtype {dtype_name(array.dtype)}, FSDP holds "
                        f"{dtype_name(target.dtype)} (bfloat16 is never cast implicitly)")
    if target.size and not np.shares_memory(array, target):
        if is_bfloat16(target.dtype):
            target.view(np.uint16)[...] = array.view(np.uint16)
        else:
            target[...] = array
