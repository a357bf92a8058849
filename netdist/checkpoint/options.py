"""PURE checkpoint options as enums: what a caller chooses, spelled as types, not strings.

Every option is a ``str`` enum, so the strings callers already pass (``"modulo"``,
``"warn"``, ``"drop"``) keep working; anything else is refused by :func:`parse_option`
with a ``ConfigError`` naming the argument, the function and the allowed values.

- :class:`RankObjects`: how plain values that differed between the saving ranks (a
  per-rank RNG, a data cursor) map onto another world size. The collective ``load`` and
  ``load_distributed`` accept ``ERROR``, ``LIKE``, ``MODULO``, ``RANK0``
  (:data:`LOAD_RANK_OBJECTS`); the offline ``reshard_checkpoint`` has no current state
  to keep, so instead of ``LIKE`` it offers ``DROP`` (:data:`RESHARD_RANK_OBJECTS`).
- :class:`ReplicaCheck`: what a collective ``save`` does about replicated tensors whose
  copies differ between ranks.
- :class:`TiedTensors`: how ``consolidate`` writes a tensor stored once under several
  names (tied weights).
"""

from __future__ import annotations

import enum
from collections.abc import Collection
from typing import TypeVar

from netdist.errors import ConfigError

__all__ = [
    "RankObjects",
    "LOAD_RANK_OBJECTS",
    "RESHARD_RANK_OBJECTS",
    "ReplicaCheck",
    "TiedTensors",
    "parse_option",
]

E = TypeVar("E", bound=enum.Enum)


class RankObjects(str, enum.Enum):
    """How per-rank plain values map onto a different world size.

    ``ERROR`` refuses and names the keys; ``LIKE`` keeps the caller's current value from
    ``like`` (e.g. freshly seeded per-rank RNGs; loads only); ``MODULO`` gives new rank
    ``r`` old rank ``r % old_size``'s value; ``RANK0`` gives every rank old rank 0's
    value; ``DROP`` forgets them (``reshard_checkpoint`` only).
    """

    ERROR = "error"
    LIKE = "like"
    MODULO = "modulo"
    RANK0 = "rank0"
    DROP = "drop"


LOAD_RANK_OBJECTS: tuple[RankObjects, ...] = (
    RankObjects.ERROR, RankObjects.LIKE, RankObjects.MODULO, RankObjects.RANK0)
"""The policies a load accepts (collective ``load``, ``load_distributed``)."""

RESHARD_RANK_OBJECTS: tuple[RankObjects, ...] = (
    RankObjects.ERROR, RankObjects.MODULO, RankObjects.RANK0, RankObjects.DROP)
"""The policies ``reshard_checkpoint`` (and ``netdist ckpt reshard``) accepts."""


class ReplicaCheck(str, enum.Enum):
    """What a collective ``save`` does about replicated tensors (plain arrays and torch
    tensors, assumed equal on every rank and written once) that differ between ranks,
    such as BatchNorm running statistics that no collective keeps in sync.

    ``WARN`` (default) and ``ERROR`` compare a CRC-32 of every replicated tensor across
    ranks (one extra pass over the bytes of each, no extra communication beyond the
    plan's ``all_gather_object``). ``WARN`` issues a ``ReplicaDivergenceWarning``
    on every rank naming the tensors and the ranks that differ, and saves **rank 0's**
    copy of each; ``ERROR`` raises ``CheckpointMismatchError`` on every rank and writes
    nothing. ``OFF`` skips the comparison (the writer rank's copy is saved unchecked).
    """

    OFF = "off"
    WARN = "warn"
    ERROR = "error"


class TiedTensors(str, enum.Enum):
    """How ``consolidate`` writes a tensor the checkpoint stores once for several names.

    ``COPY`` writes it under each of its names (what ``load_state_dict(strict=True)``
    needs); ``DROP`` writes it under its first name only, as ``save_pretrained`` does.
    """

    COPY = "copy"
    DROP = "drop"


def parse_option(value: E | str, kind: type[E], name: str, where: str,
                 allowed: Collection[E] | None = None) -> E:
    """``value`` as a member of ``kind`` (members and their string values are accepted).

    ``allowed`` narrows the members this caller supports. Anything else raises
    ``ConfigError`` naming the argument ``name``, the function ``where`` and the allowed
    values.
    """
    members = tuple(kind) if allowed is None else tuple(allowed)
    for member in members:
        if value is member or (isinstance(value, str) and value == member.value):
            return member
    choices = ", ".join(repr(m.value) for m in members)
    raise ConfigError(f"{where}: {name} must be one of {choices} (or the {kind.__name__} "
                      f"members), got {value!r}")
