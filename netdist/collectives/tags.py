"""PURE: who owns which transport tags, in one layout for the whole library.

A transport tag is a 63-bit integer (``netdist.transport.MAX_TAG``). It is cut into three
disjoint spaces, told apart by the top two bits, so no owner can reach another's tags:

==============  =========================================  ===============================
space           tag                                        owner
==============  =========================================  ===============================
application     ``0 .. 2**62 - 1``                         the caller's own
                                                           ``transport.send``/``recv``
group           ``GROUP_FLAG | gid << 22 | low``           one ``Group``: its collectives
                (bit 61 clear)                             (``seq << 4 | sub-tag``) and its
                                                           ``send``/``recv`` (``P2P_BIT |
                                                           tag``)
reserved        ``GROUP_FLAG | RESERVED_BIT |              a ``TagRange`` that a layer
                range_id << 32 | offset``                  above reserved from a group
                                                           (pipeline, parameter server)
==============  =========================================  ===============================

A group id is a hash of how the group was made; a range id is a hash of the member
ranks, the owner's name and how many ranges of that owner those ranks already hold. Both
are computed alike on every rank, so every rank names the same tags without a message.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

__all__ = [
    "GROUP_FLAG",
    "RESERVED_BIT",
    "GID_SHIFT",
    "GID_LIMIT",
    "P2P_BIT",
    "P2P_TAG_LIMIT",
    "SEQ_SHIFT",
    "SEQ_MASK",
    "RANGE_SHIFT",
    "RANGE_SIZE",
    "RANGE_ID_LIMIT",
    "TagRange",
    "group_id",
    "group_tag_base",
    "range_id",
    "reserved_range",
]

GROUP_FLAG = 1 << 62
"""Set in every tag a group or a reserved range owns; clear in application tags."""

RESERVED_BIT = 1 << 61
"""Set in reserved-range tags; clear in a group's own tags (its ids stay below it)."""

GID_SHIFT = 22
GID_LIMIT = (1 << 39) - 1
"""Group ids are below this, so ``gid << GID_SHIFT`` never reaches ``RESERVED_BIT``."""

P2P_BIT = 1 << 21
"""Within a group's space: set for ``send``/``recv``, clear for collectives."""

P2P_TAG_LIMIT = 2**20
"""Group point-to-point tags must be below this."""

SEQ_SHIFT = 4
SEQ_MASK = (1 << 17) - 1
"""A group's collectives number their tags modulo ``2**17``, 16 sub-tags each."""

RANGE_SHIFT = 32
RANGE_SIZE = 1 << RANGE_SHIFT
"""Tags in one reserved range."""

RANGE_ID_LIMIT = (1 << (61 - RANGE_SHIFT)) - 1
"""Range ids are below this, so ``range_id << RANGE_SHIFT`` stays below ``RESERVED_BIT``."""


@dataclass(frozen=True)
class TagRange:
    """``size`` consecutive transport tags from ``base``, reserved for ``owner``."""

    owner: str
    base: int
    size: int = RANGE_SIZE

    def tag(self, offset: int) -> int:
        """The transport tag at ``offset``; ``ValueError`` outside ``0 .. size-1``."""
        if not 0 <= offset < self.size:
            raise ValueError(f"tag offset {offset} is outside {self.owner}'s range "
                             f"0..{self.size - 1}")
        return self.base + offset

    def __contains__(self, tag: object) -> bool:
        return isinstance(tag, int) and self.base <= tag < self.base + self.size


def _digest(parts: tuple[object, ...], limit: int) -> int:
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % limit


def group_id(*parts: object) -> int:
    """The id of a group made as ``parts`` describe (a root number, a parent and ranks)."""
    return _digest(parts, GID_LIMIT)


def group_tag_base(gid: int) -> int:
    """First tag of group ``gid``'s space (its collectives and point-to-point)."""
    if not 0 <= gid < GID_LIMIT:
        raise ValueError(f"group id {gid:#x} is outside 0..{GID_LIMIT - 1:#x}")
    return GROUP_FLAG | (gid << GID_SHIFT)


def range_id(ranks: tuple[int, ...], owner: str, index: int) -> int:
    """The id of the ``index``-th range ``owner`` reserved among transport ``ranks``."""
    return _digest(("reserved", tuple(int(r) for r in ranks), owner, index), RANGE_ID_LIMIT)


def reserved_range(ranks: tuple[int, ...], owner: str, index: int) -> TagRange:
    """The ``index``-th range of ``owner`` among transport ``ranks`` (see ``range_id``)."""
    if not owner:
        raise ValueError("a tag range needs an owner name")
    if index < 0:
        raise ValueError(f"range index must be >= 0, got {index}")
    base = GROUP_FLAG | RESERVED_BIT | (range_id(ranks, owner, index) << RANGE_SHIFT)
    return TagRange(owner, base)
