"""Connections on first use (``connect="lazy"``, the default), over real sockets.

In one process (real TCP on 127.0.0.1): start-up opens no peer connection, a barrier
connects only its dissemination partners, simultaneous first sends keep their order and
leave exactly the lower rank's connection, a rank that left before first contact is
reported lost to senders and receivers, strangers and wrong tokens are still refused,
and ``connect="eager"`` still builds the full mesh. With real processes
(``tests.transport.lazy_worker``): a ring all-reduce among 8 ranks holds only its two
neighbours' connections, and a peer killed or stopped before anyone connected to it is
reported lost to whoever waits on it. Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import logging
import signal

import numpy as np
import pytest

from netdist.config import ConnectMode
from netdist.errors import AuthenticationError, PeerLostError
from netdist.transport.dissemination import barrier_partners
from netdist.transport.local_tcp import local_tcp_group
from netdist.wire import HandshakeIdentity
from tests.ranks import RankProcess, start_ranks
from tests.transport.test_tcp_security import assert_group_works, dial

WAIT = 10.0
"""Bound on each receive here; the outcomes under test arrive well within it."""


def endpoints(transport, peer: int) -> tuple[str, str]:
    """``(local, remote)`` ``host:port`` of ``transport``'s connection to ``peer``."""
    conn = transport._connections[peer]
    host, port = conn.sockname()
    return f"{host}:{port}", conn.peername()


async def test_start_up_opens_no_peer_connection_and_the_table_is_complete():
    async with local_tcp_group(4, timeout=WAIT) as group:
        assert [t.config.connect for t in group] == [ConnectMode.LAZY] * 4
        assert [t.connected_peers() for t in group] == [()] * 4
        for t in group:
            assert [a.port for a in t.peer_addresses] == [g.listen_address[1] for g in group]


async def test_eager_mode_connects_the_full_mesh_at_start_up():
    async with local_tcp_group(4, timeout=WAIT, connect="eager") as group:
        assert [t.connected_peers() for t in group] == [
            tuple(p for p in range(4) if p != r) for r in range(4)]
        await assert_group_works(group)


async def test_a_barrier_connects_only_its_dissemination_partners():
    async with local_tcp_group(8, timeout=WAIT) as group:
        await asyncio.gather(*(t.barrier() for t in group))
        for rank, t in enumerate(group):
            partners = {p for pair in barrier_partners(rank, 8) for p in pair}
            assert set(t.connected_peers()) == partners  # 5 of 7 peers for n = 8
        await asyncio.gather(*(t.barrier() for t in group))  # and again, on those


async def test_simultaneous_first_sends_keep_their_order_and_one_connection_survives():
    async with local_tcp_group(2, timeout=WAIT) as (a, b):
        count = 40

        async def receive(dst, src: int) -> list[int]:
            return [int((await dst.recv(src, tag=5))[0]) for _ in range(count)]

        # both ranks dial in the same loop turn; every send waits for the connection,
        # and they must still leave in the order they were called
        sends = [t.send(1 - r, np.array([i + 1000 * r]), tag=5)
                 for i in range(count) for r, t in enumerate((a, b))]
        results = await asyncio.gather(*sends, receive(b, 0), receive(a, 1))
        assert results[-2] == list(range(count))
        assert results[-1] == [1000 + i for i in range(count)]
        assert (a.connected_peers(), b.connected_peers()) == ((1,), (0,))
        # one connection, the same at both ends: the one rank 0 (the lower rank) made
        a_local, a_remote = endpoints(a, 1)
        b_local, b_remote = endpoints(b, 0)
        assert (a_local, a_remote) == (b_remote, b_local)
        assert b_local == f"127.0.0.1:{b.listen_address[1]}"
        await assert_group_works([a, b])


async def test_a_rank_that_left_before_first_contact_is_lost_to_receivers_and_senders():
    async with local_tcp_group(3, timeout=WAIT) as (a, b, c):
        port = b.listen_address[1]
        await b.aclose()
        reason = (f"rank 1 refused the connection at 127.0.0.1:{port}: nothing listens there "
                  "any more (it exited, crashed or closed its transport)")
        with pytest.raises(PeerLostError) as waiting:
            await a.recv(1, tag=4, timeout=WAIT)  # posted first: it connects, then fails
        assert (waiting.value.rank, waiting.value.origin_rank) == (1, 1)
        assert str(waiting.value) == f"{reason} while this rank waited for tag 4"
        with pytest.raises(PeerLostError) as sending:
            await a.send(1, b"x", tag=4, timeout=WAIT)
        assert (sending.value.rank, str(sending.value)) == (1, reason)
        with pytest.raises(PeerLostError) as later:
            await a.recv(1, tag=9, timeout=WAIT)
        assert str(later.value) == f"{reason} before this rank's recv on tag 9"
        await a.send(2, np.array([1, 2]), tag=4)  # the rest of the job is unaffected
        assert (await c.recv(0, tag=4, timeout=WAIT)).tolist() == [1, 2]


async def test_strangers_and_wrong_tokens_are_still_refused(caplog):
    async with local_tcp_group(3, timeout=WAIT) as group:
        rank0 = group[0]
        port = rank0.listen_address[1]
        with caplog.at_level(logging.WARNING, logger="netdist.transport"):
            wrong_token = HandshakeIdentity(rank0.config.job_id, 2, 3, "not-the-token")
            with pytest.raises(AuthenticationError, match="token mismatch"):
                await dial(port, wrong_token, expect_rank=0)
            other_job = HandshakeIdentity("another-job", 2, 3, rank0.config.token)
            with pytest.raises(AuthenticationError, match="job id 'another-job'"):
                await dial(port, other_job, expect_rank=0)
            assert rank0.connected_peers() == ()  # nothing was adopted
            await assert_group_works(group)  # the ring connects on first use
            impostor = HandshakeIdentity(rank0.config.job_id, 1, 3, rank0.config.token)
            with pytest.raises(AuthenticationError, match="duplicate connection from rank 1"):
                await dial(port, impostor, expect_rank=0)
        assert "rank 0 dropped connection from 127.0.0.1" in caplog.text
        await assert_group_works(group)


# -- real processes ----------------------------------------------------------------------


def start_job(world_size: int, args: list[str]) -> list[RankProcess]:
    return start_ranks(world_size, "tests.transport.lazy_worker", args, timeout=30.0,
                       job_prefix="lazy")


def peers_of(line: str) -> set[int]:
    text = line.split()[2]
    return set() if text == "-" else {int(p) for p in text.split(",")}


@pytest.mark.slow
def test_a_ring_all_reduce_among_8_processes_holds_only_its_neighbours():
    n = 8
    ranks = start_job(n, ["ring", str(256 * 1024)])  # 2 MiB of float64
    try:
        startup = [rank.expect("STARTUP ", timeout=90.0) for rank in ranks]
        for rank in ranks:
            rank.send_line("go")  # every rank has counted its start-up connections
        after = [rank.expect("PEERS ", timeout=90.0) for rank in ranks]
        for rank in ranks:
            rank.send_line("done")  # every rank has counted: they may leave
        codes = [rank.finish(timeout=30.0) for rank in ranks]
    finally:
        for rank in ranks:
            rank.kill()
    assert codes == [0] * n, [rank.text() for rank in ranks]
    assert [peers_of(line) for line in startup] == [set()] * n
    assert [peers_of(line) for line in after] == [{(r - 1) % n, (r + 1) % n}
                                                  for r in range(n)]


@pytest.mark.slow
def test_a_peer_killed_before_first_contact_is_lost_to_whoever_waits_on_it():
    victim = 2
    # a long liveness window (5 s x 4): the loss must come from the kill, not from silence
    ranks = start_job(3, ["wait", str(victim), "5.0"])
    try:
        for rank in ranks:
            rank.expect("READY", timeout=90.0)
        ranks[victim].proc.send_signal(signal.SIGSTOP)  # alive: its kernel still accepts
        ranks[0].send_line("go")
        assert ranks[0].expect("WAITING", timeout=30.0) == "WAITING 0 -"  # never connected
        ranks[victim].proc.send_signal(signal.SIGKILL)  # while rank 0 waits on it
        ranks[victim].proc.wait(timeout=30.0)
        ranks[1].send_line("go")  # and a rank that starts waiting after the kill
        for rank in (ranks[0], ranks[1]):
            line = rank.expect("PEERLOST", timeout=30.0)
            assert line.startswith(f"PEERLOST {victim} rank {victim} refused the connection "
                                   "at 127.0.0.1:"), line
            assert line.endswith("nothing listens there any more (it exited, crashed or "
                                 "closed its transport) while this rank waited for tag 3"), line
        assert [ranks[0].finish(timeout=30.0), ranks[1].finish(timeout=30.0)] == [0, 0]
    finally:
        if ranks[victim].proc.poll() is None:
            ranks[victim].proc.send_signal(signal.SIGCONT)
        for rank in ranks:
            rank.kill()


@pytest.mark.slow
def test_a_stopped_peer_never_connected_is_lost_after_one_liveness_window():
    ranks = start_job(2, ["wait", "1", "0.25"])  # liveness window 0.25 s x 4 = 1 s
    try:
        for rank in ranks:
            rank.expect("READY", timeout=90.0)
        ranks[1].proc.send_signal(signal.SIGSTOP)
        ranks[0].send_line("go")
        line = ranks[0].expect("PEERLOST", timeout=30.0)
        assert line.startswith("PEERLOST 1 rank 1 at 127.0.0.1:"), line
        assert " did not complete the handshake within 1.0s: presumed dead (stopped, " in line
        assert ranks[0].finish(timeout=30.0) == 0
    finally:
        if ranks[1].proc.poll() is None:
            ranks[1].proc.send_signal(signal.SIGCONT)
        for rank in ranks:
            rank.kill()
