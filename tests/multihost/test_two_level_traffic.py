"""How many bytes cross each host link: the two-level schedules reach the bound's
arithmetic exactly, the flat ring does not.

Ranks are real TCP transports in one process, told apart into hosts by per-rank host
ids (``local_tcp_group(host_ids=...)``); each counts payload bytes per peer
(``Transport.traffic``). For ``S`` bytes over ``H`` hosts, what leaves each host is:
all-reduce ``2(H-1)/H x S`` summed over its lanes (exactly ``S`` at two hosts), a
reduce-scatter the chunks of the other hosts' ranks, an all-gather its own ranks'
chunks, a broadcast ``S`` from the root's host.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import numpy as np
import pytest

from netdist.collectives import Group
from netdist.sharding import chunk_bounds
from netdist.transport import local_tcp_group
from netdist.transport.host_identity import host_key
from tests.ranks import run_ranks

ELEMENTS = 1_000_003  # float32: ~4 MiB, odd so chunks and pieces are uneven
S = ELEMENTS * 4


def _hosts(layout: Sequence[int]) -> list[str]:
    return [f"host{h}" for h, count in enumerate(layout) for _ in range(count)]


async def _crossing(layout: Sequence[int], call: Callable[[Group], Awaitable[Any]],
                    **group_options: Any) -> dict[str, int]:
    """Payload bytes each host sent to the other hosts during ``call``, by host id (and
    the group's local mode as ``"mode"``)."""
    ids = _hosts(layout)
    async with local_tcp_group(len(ids), host_ids=ids, timeout=60) as transports:
        async def body(group: Group) -> tuple[int, Any]:
            await group.all_reduce(np.ones(1 << 20, np.float32))  # sets the arena up
            before = group.transport.traffic()
            await call(group)
            window = group.transport.traffic() - before
            own = host_key(ids[group.rank])
            crossed = sum(t.sent_bytes for key, t in window.by_host.items() if key != own)
            return crossed, group.local_mode

        results = await run_ranks(transports, body, **{"shared_memory": True,
                                                        **group_options})
    sent: dict[str, int] = {}
    for host, (crossed, _) in zip(ids, results):
        sent[host] = sent.get(host, 0) + crossed
    sent["mode"] = results[0][1].value  # type: ignore[assignment]
    return sent


def _data(group: Group) -> np.ndarray:
    return np.full(ELEMENTS, group.rank + 1, np.float32)


async def _all_reduce(group: Group) -> None:
    result = await group.all_reduce(_data(group))
    assert np.all(result == sum(range(1, group.world_size + 1)))


@pytest.mark.parametrize("layout", [(2, 2), (3, 3)], ids=["2x2", "2x3"])
async def test_two_level_all_reduce_sends_s_across_each_of_two_hosts(
        layout: tuple[int, ...]) -> None:
    sent = await _crossing(layout, _all_reduce)
    assert sent == {"host0": S, "host1": S, "mode": "hierarchical"}


async def test_the_flat_ring_sends_more_across_the_same_link() -> None:
    """Shared memory off: the ring over 4 ranks crosses each host link with
    2(n-1)/n x S = 1.5 x S, what the two-level schedule saves."""
    sent = await _crossing((2, 2), _all_reduce, shared_memory=False)
    sizes = [b - a for a, b in chunk_bounds(ELEMENTS, 4)]

    def ring_sends(r: int) -> int:  # every chunk but its own, then every chunk but r + 1's
        return (2 * ELEMENTS - sizes[r] - sizes[(r + 1) % 4]) * 4

    # rank 1 sends to rank 2 across the link, rank 3 to rank 0
    assert sent == {"host0": ring_sends(1), "host1": ring_sends(3), "mode": "tcp"}
    assert min(sent["host0"], sent["host1"]) > 1.49 * S


async def test_uneven_hosts_cross_with_the_smallest_hosts_lanes() -> None:
    """Hosts of 1, 2 and 3 ranks: one lane, whose ring over 3 hosts sends 2(H-1) x S in
    all (each host 2(H-1)/H x S, give or take the uneven chunks)."""
    sent = await _crossing((1, 2, 3), _all_reduce)
    assert sent.pop("mode") == "uneven hosts"
    assert sum(sent.values()) == 2 * 2 * S


async def test_reduce_scatter_and_all_gather_cross_only_the_other_hosts_chunks() -> None:
    chunks = chunk_bounds(ELEMENTS, 4)
    host_bytes = [sum(b - a for a, b in chunks[2 * h:2 * h + 2]) * 4 for h in range(2)]

    async def scatter(group: Group) -> None:
        out = await group.reduce_scatter(_data(group))
        lo, hi = chunks[group.rank]
        assert out.size == hi - lo and np.all(out == 10)

    sent = await _crossing((2, 2), scatter)
    assert sent == {"host0": host_bytes[1], "host1": host_bytes[0], "mode": "hierarchical"}

    async def gather(group: Group) -> None:
        lo, hi = chunks[group.rank]
        out = np.empty(ELEMENTS, np.float32)  # given: no shape exchange crosses too
        await group.all_gather(np.full(hi - lo, group.rank, np.float32), out=out)
        assert np.array_equal(out, np.repeat(np.arange(4, dtype=np.float32),
                                             [b - a for a, b in chunks]))

    sent = await _crossing((2, 2), gather)
    assert sent == {"host0": host_bytes[0], "host1": host_bytes[1], "mode": "hierarchical"}


async def test_broadcast_crosses_once_from_the_roots_host() -> None:
    async def broadcast(group: Group) -> None:
        data = _data(group)
        await group.broadcast(data, 3)
        assert np.all(data == 4)

    sent = await _crossing((2, 2), broadcast)
    assert sent == {"host0": 0, "host1": S, "mode": "hierarchical"}
