"""Bring every member of a new epoch to the same state: agree, then fetch from several donors.

Run by every member right after an epoch's transport is up:

1. every member publishes its committed step and its layout (one ``all_gather_object``);
2. the newest step wins: the members at that step are the *donors*; members behind
   (joiners, or a member that missed the last commit) are the *receivers*. Without
   receivers nothing more happens (a shrinking group hashes nothing). Otherwise every
   donor hashes its state and the hashes must agree (else ``DivergenceError``, naming
   the ranks: the job stops rather than train on diverged replicas);
3. each receiver takes up to ``MAX_DONORS`` donors (rotated, so several receivers use
   different ones); the state's bytes are cut into pieces (``plan_pieces``) dealt
   round-robin to them, and each donor streams its pieces to its receivers at once,
   straight from the state arrays into the receivers' new arrays (zero-copy on both
   ends);
4. each receiver hashes what arrived and compares it with the donors' hash
   (``StateTransferError`` on a mismatch) before loading it.

The transfers travel on the epoch's authenticated transport, like every other byte.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from netdist.collectives.group import Group
from netdist.errors import DivergenceError, StateTransferError

from netdist.elastic.state import ArrayLayout, ElasticState, layout_of, state_digest

__all__ = ["SyncReport", "Piece", "plan_pieces", "synchronize_state"]

PIECE_BYTES = 8 << 20
"""Largest piece one donor sends in one message."""

MAX_DONORS = 2
"""Donors per receiver. Two spread the load (several joiners at once are served by
different donors, so no member is choked, hivemind's problem, and a donor's link carries
half a state); more gain nothing once the receiver's own link is full, and on one host
cost CPU switching: 89 MB on a 2-core machine arrived at 1.8-2.1 GB/s from 2 donors,
0.8-1.6 from 4, 0.36 from 7 (a single stream runs at 2.2 GB/s there)."""


@dataclass(frozen=True, slots=True)
class Piece:
    """Bytes ``start:stop`` of array ``index``, sent by donor number ``donor``."""

    index: int
    start: int
    stop: int
    donor: int


@dataclass(frozen=True, slots=True)
class SyncReport:
    """What ``synchronize_state`` did on this member."""

    step: int
    digest: str
    donors: tuple[int, ...]
    """The members at the newest step (on a receiver: the ones it fetched from)."""
    receivers: tuple[int, ...]
    fetched_bytes: int = 0
    fetch_seconds: float = 0.0

    @property
    def fetch_gbps(self) -> float:
        """GB/s of this member's fetch (0 when it fetched nothing)."""
        return self.fetched_bytes / self.fetch_seconds / 1e9 if self.fetch_seconds else 0.0


def plan_pieces(sizes: list[int], donors: int, piece_bytes: int = PIECE_BYTES) -> list[Piece]:
    """Cut arrays of ``sizes`` bytes into pieces dealt round-robin to ``donors``.

    Pieces are at most ``piece_bytes`` and at least enough that every donor has a share
    of a large state (``total / (4 * donors)``), so several donors stream at once.
    """
    total = sum(sizes)
    if donors < 1:
        raise ValueError("at least one donor is needed")
    step = max(1, min(piece_bytes, -(-total // (4 * donors)) if total else 1))
    pieces: list[Piece] = []
    for index, size in enumerate(sizes):
        for start in range(0, size, step):
            pieces.append(Piece(index, start, min(size, start + step), len(pieces) % donors))
    return pieces


def _bytes_of(array: np.ndarray) -> np.ndarray:
    return array.reshape(-1).view(np.uint8)


async def synchronize_state(group: Group, state: ElasticState, step: int,
                            on_overwrite: Callable[[], None] = lambda: None) -> SyncReport:
    """Agree on the newest state and bring every member to it; returns the agreed step.

    ``step`` is this member's number of committed steps (-1: no state yet, a joiner).
    Every member of ``group`` calls this at the same point. A receiver calls
    ``on_overwrite()`` before it starts overwriting its own state in place (the caller
    then counts it as holding no state until this returns).
    """
    arrays = state.arrays()
    layout = [entry.to_list() for entry in layout_of(arrays)]
    infos = await group.all_gather_object([step, layout])
    newest = max(info[0] for info in infos)
    if newest < 0:
        raise StateTransferError("no member of the new epoch holds a state to start from")
    donors = tuple(r for r, info in enumerate(infos) if info[0] == newest)
    receivers = tuple(r for r, info in enumerate(infos) if info[0] < newest)
    if not receivers:
        return SyncReport(newest, "", donors, receivers)
    digest = state_digest(arrays, step) if group.rank in donors else ""
    hashes = await group.all_gather_object(digest)
    digests = {hashes[r] for r in donors}
    if len(digests) != 1:
        detail = ", ".join(f"rank {r}: {hashes[r][:12]}" for r in donors)
        raise DivergenceError(f"members that committed step {newest} hold different states "
                              f"({detail}); refusing to continue")
    agreed = digests.pop()
    wanted = [ArrayLayout.from_list(item) for item in infos[donors[0]][1]]
    tags = group.reserve_tags("elastic-state")
    transport = group.transport
    ranks = group.ranks
    sizes = [entry.nbytes for entry in wanted]
    take = min(MAX_DONORS, len(donors))
    chosen = {receiver: tuple(donors[(j * take + i) % len(donors)] for i in range(take))
              for j, receiver in enumerate(receivers)}
    pieces = plan_pieces(sizes, take)
    me = group.rank
    if me in donors:
        ordered = list(arrays.values())

        async def feed(receiver: int) -> None:
            mine = chosen[receiver].index(me)
            for piece in (p for p in pieces if p.donor == mine):
                await transport.send(ranks[receiver], _bytes_of(ordered[piece.index])
                                     [piece.start:piece.stop], tag=tags.tag(0))

        await asyncio.gather(*(feed(r) for r in receivers if me in chosen[r]))
        return SyncReport(newest, agreed, donors, receivers)
    if me not in receivers:  # pragma: no cover - every member is one of the two
        raise AssertionError("member is neither donor nor receiver")
    # The donors' layout is authoritative. When this member's own state has it (the
    # usual case: the same model), the bytes land straight in the live arrays: no
    # second copy of the state in memory and no page faults on fresh memory (which
    # bound the fetch at ~0.3 GB/s on this test machine). The member then holds no
    # valid state until the hash matches (``on_overwrite``). Otherwise (entries that
    # appear lazily, such as torch optimizer buffers) new arrays receive them.
    if list(layout_of(arrays)) == wanted:
        fetched = arrays
        on_overwrite()
    else:
        fetched = {entry.name: np.empty(entry.shape, dtype=np.dtype(entry.dtype))
                   for entry in wanted}
    targets = [_bytes_of(a) for a in fetched.values()]
    started = time.perf_counter()

    mine = chosen[me]

    async def drain(donor_index: int) -> None:
        donor = mine[donor_index]
        for piece in (p for p in pieces if p.donor == donor_index):
            await transport.recv(ranks[donor], tag=tags.tag(0),
                                 out=targets[piece.index][piece.start:piece.stop])

    await asyncio.gather(*(drain(i) for i in range(len(mine))))
    seconds = time.perf_counter() - started
    got = state_digest(fetched, newest)
    if got != agreed:
        raise StateTransferError(f"the state fetched from ranks {list(mine)} hashes to "
                                 f"{got[:12]}, the donors agreed on {agreed[:12]}")
    state.load(fetched)
    nbytes = sum(t.nbytes for t in targets)
    return SyncReport(newest, agreed, mine, receivers, nbytes, seconds)


