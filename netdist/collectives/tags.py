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
from collections.abc import Sequence
from dataclasses import dataclass

from netdist.errors import CollectiveError

__all__ = [
    "next_root_group",
    "reserve_tags",
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


_ROOT_COUNT_ATTRIBUTE = "_netdist_root_groups"
_RANGES_ATTRIBUTE = "_netdist_tag_ranges"


def next_root_group(transport: object) -> int:
    """Number the next root ``Group`` built on ``transport``: 0, 1, 2, ...

    Every rank builds its root groups in the same order, so equal numbers name the same
    group on every rank and give it the same tag namespace. The count lives on the
    transport object (groups of different transports never share it), owned by ``Group``.
    """
    created: int = getattr(transport, _ROOT_COUNT_ATTRIBUTE, 0)
    setattr(transport, _ROOT_COUNT_ATTRIBUTE, created + 1)
    return created


def reserve_tags(transport: object, ranks: Sequence[int], owner: str) -> TagRange:
    """Reserve the next tag range of ``owner`` among transport ``ranks`` on ``transport``.

    The n-th reservation of ``owner`` among the same ranks gets the same range on every
    rank, so the ranks that will talk on it must reserve in the same order (as they
    build subgroups); a second parameter server or pipeline on those ranks gets a range
    of its own. The ranges live in the reserved space (above),
    apart from application tags and from every group's collectives. ``Group.reserve_tags``
    is this for the group's members; layers given a bare transport call it with every rank.
    """
    members = tuple(int(r) for r in ranks)
    taken: dict[tuple[tuple[int, ...], str], int] = getattr(transport, _RANGES_ATTRIBUTE, None) or {}
    index = taken.get((members, owner), 0)
    tag_range = reserved_range(members, owner, index)
    for (other_ranks, other_owner), count in taken.items():
        if (other_ranks, other_owner) != (members, owner) and any(
                reserved_range(other_ranks, other_owner, i).base == tag_range.base
                for i in range(count)):
            raise CollectiveError(f"tag range of {owner!r} on ranks {list(members)} collides "
                                  f"with one of {other_owner!r} on ranks {list(other_ranks)}; "
                                  f"use another owner name")
    taken[(members, owner)] = index + 1
    setattr(transport, _RANGES_ATTRIBUTE, taken)
    return tag_range
