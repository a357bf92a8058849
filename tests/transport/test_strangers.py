"""No stranger can exhaust a rank (issue 12, item 8): bounded pre-authentication admission.

Real sockets on 127.0.0.1: strangers open connections to a rank's listener (or the
coordinator) in bounded batches while the job runs. Beyond ``max_unauthenticated`` they
are closed at once, the rank holds at most that many (counted by its own counter and, for
a rank in a child process, from ``/proc/<pid>/fd``), established peers keep working, ranks
still join through a saturated coordinator, and a checkpoint save still gets descriptors
under a low ``RLIMIT_NOFILE``.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import logging
import os
import secrets
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from netdist.collectives import Group
from netdist.config import AdmissionLimits, DistributedConfig, WireLimits
from netdist.errors import ConfigError
from netdist.transport import TcpTransport
from netdist.transport.admission import (
    AdmissionControl,
    RateLimitedLog,
    raise_nofile_limit,
)
from netdist.transport.connection import (
    HANDSHAKE_SCRATCH_BYTES,
    SCRATCH_BYTES,
    FrameConnection,
)
from netdist.wire import ClientHandshake, FrameKind, HandshakeIdentity

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("strangers_worker.py")
WAIT = 30.0
"""Bound on every wait for the rank's reaction (generous: a loaded 2-core machine)."""


class Stranger:
    """One connection from someone without the token: idle, or a HELLO and then silence.

    ``outcome`` completes with ``"closed"`` when the rank closes the connection before
    sending anything, or ``"answered"`` when the rank's first bytes arrive (its handshake
    reply to the HELLO: the connection was admitted and is being held).
    """

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.outcome: asyncio.Task[str] = asyncio.get_running_loop().create_task(self._watch())

    @classmethod
    async def connect(cls, port: int, hello: bytes = b"") -> Stranger:
        reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port),
                                                WAIT)
        if hello:
            writer.write(hello)
        return cls(reader, writer)

    async def _watch(self) -> str:
        try:
            data = await self.reader.read(1)
        except ConnectionError:
            return "closed"
        return "answered" if data else "closed"

    async def close(self) -> None:
        self.outcome.cancel()
        self.writer.close()
        with contextlib.suppress(ConnectionError, asyncio.CancelledError):
            await self.writer.wait_closed()


async def wait_for_outcomes(strangers: list[Stranger], count: int, timeout: float) -> None:
    """Wait (bounded) until at least ``count`` of ``strangers`` have an outcome."""
    pending = {s.outcome for s in strangers if not s.outcome.done()}
    done = len(strangers) - len(pending)
    async with asyncio.timeout(timeout):
        while done < count:
            finished, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            done += len(finished)


def closed(strangers: list[Stranger]) -> int:
    return sum(1 for s in strangers if s.outcome.done() and s.outcome.result() == "closed")


async def close_all(strangers: list[Stranger]) -> None:
    await asyncio.gather(*(s.close() for s in strangers))


async def all_reduce_on(transports: list[TcpTransport]) -> list[list[int]]:
    groups = [Group(t) for t in transports]
    try:
        arrays = [np.full(5, 10 ** rank, np.int64) for rank in range(len(transports))]
        await asyncio.gather(*(g.all_reduce(a, timeout=WAIT) for a, g in zip(arrays, groups)))
        return [a.tolist() for a in arrays]
    finally:
        for g in groups:
            await g.aclose()


# ---------------------------------------------------------------------------------------
# the bound, with real sockets


async def test_strangers_beyond_the_cap_are_closed_at_once_and_peers_keep_working(
        tcp_group, caplog):
    cap = 8
    limits = AdmissionLimits(max_unauthenticated=cap, handshake_timeout=60.0, fd_reserve=0,
                             refusal_log_interval=3600.0)
    rank0, rank1 = await tcp_group(2, admission=limits)
    port = rank0.listen_address[1]
    before = rank0.admission.stats()
    assert before.pending == 0  # every legitimate connection has authenticated
    strangers: list[Stranger] = []
    try:
        with caplog.at_level(logging.WARNING, logger="netdist.transport"):
            for _ in range(5):  # 5 batches of 40 idle strangers
                strangers += [await Stranger.connect(port) for _ in range(40)]
                await wait_for_outcomes(strangers, len(strangers) - cap, WAIT)
                stats = rank0.admission.stats()
                assert stats.pending == cap and stats.peak_pending == cap
                assert stats.admitted - before.admitted == cap
                assert stats.refused_capacity - before.refused_capacity == len(strangers) - cap
                assert closed(strangers) == len(strangers) - cap
            # the first `cap` are the ones held; the established peers are untouched
            assert all(not s.outcome.done() for s in strangers[:cap])
            assert await all_reduce_on([rank0, rank1]) == [[11] * 5, [11] * 5]
        refusals = [r.getMessage() for r in caplog.records if "refused a connection" in
                    r.getMessage()]
        assert len(refusals) == 1, refusals  # 192 refusals, one log line per interval
        assert ("rank 0 refused a connection from 127.0.0.1:" in refusals[0]
                and "8 connections are already authenticating" in refusals[0])
    finally:
        await close_all(strangers)


async def test_ranks_join_through_a_coordinator_saturated_by_strangers():
    """The coordinator is full of idle strangers when rank 1 arrives: they are dropped
    after the short handshake deadline (not the 30 s join timeout), rank 1's refused
    attempts are retried, and the job forms and runs a collective."""
    cap = 4
    settings = dict(
        world_size=2, job_id=f"strangers-{secrets.token_hex(4)}", token=secrets.token_hex(16),
        coordinator=("127.0.0.1", 0), listen_host="127.0.0.1", advertise_addr="127.0.0.1",
        timeout=WAIT, connect_timeout=WAIT,
        admission=AdmissionLimits(max_unauthenticated=cap, handshake_timeout=1.0,
                                  fd_reserve=0, refusal_log_interval=3600.0))
    loop = asyncio.get_running_loop()
    ready: asyncio.Future[tuple[str, int]] = loop.create_future()
    tasks = [loop.create_task(TcpTransport.connect(
        DistributedConfig(rank=0, **settings),
        on_coordinator_ready=lambda address: ready.set_result(address)))]
    strangers: list[Stranger] = []
    transports: list[TcpTransport] = []
    try:
        host, port = await asyncio.wait_for(asyncio.shield(ready), WAIT)
        settings["coordinator"] = (host, port)
        strangers = [await Stranger.connect(port) for _ in range(20)]
        await wait_for_outcomes(strangers, 20 - cap, WAIT)  # all but `cap` closed at once
        tasks.append(loop.create_task(TcpTransport.connect(DistributedConfig(rank=1, **settings))))
        # the held ones are dropped at the 1 s handshake deadline: 20 s is far below the
        # 30 s join timeout, which bounded a stranger's stay before
        await wait_for_outcomes(strangers, 20, 20.0)
        assert closed(strangers) == 20
        async with asyncio.timeout(WAIT):
            transports = list(await asyncio.gather(*tasks))
        assert await all_reduce_on(transports) == [[11] * 5, [11] * 5]
        stats = transports[0].admission.stats()  # shared by rank 0's listener and coordinator
        assert stats.peak_pending == cap and stats.pending == 0
        assert stats.refused_capacity >= 20 - cap
    finally:
        await close_all(strangers)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for transport in transports:
            await transport.aclose()


async def test_a_stranger_may_not_send_a_header_beyond_the_handshake_limit(tcp_group, caplog):
    """Before authentication headers are capped at handshake_header_bytes (4096), far below
    the job's 64 KiB: a stranger announcing a 5000-byte HELLO is dropped from the prefix."""
    rank0, rank1 = await tcp_group(2)
    prefix = b"ND\x01" + bytes([FrameKind.HELLO]) + (5000).to_bytes(4, "little") + bytes(8)
    with caplog.at_level(logging.WARNING, logger="netdist.transport"):
        stranger = await Stranger.connect(rank0.listen_address[1], prefix)
        try:
            assert await asyncio.wait_for(stranger.outcome, WAIT) == "closed"
        finally:
            await stranger.close()
    assert "header length 5000 exceeds max_header_bytes 4096" in caplog.text
    assert await all_reduce_on([rank0, rank1]) == [[11] * 5, [11] * 5]


async def test_a_connection_reads_with_a_small_buffer_until_authenticated():
    conn = FrameConnection(WireLimits(), label="test")
    assert not conn.authenticated
    assert len(conn.get_buffer(-1)) == HANDSHAKE_SCRATCH_BYTES == 1024
    conn.mark_authenticated()
    conn.mark_authenticated()  # idempotent
    assert conn.authenticated and len(conn.get_buffer(-1)) == SCRATCH_BYTES


async def test_the_admission_slot_is_released_once_on_authentication_or_close():
    admission = AdmissionControl(AdmissionLimits(max_unauthenticated=2, fd_reserve=0),
                                 owner="test")
    made: list[FrameConnection] = []

    def make(release):
        made.append(FrameConnection(WireLimits(), label="test", release=release))
        return made[-1]

    factory = admission.protocol_factory(make)
    first, second = factory(), factory()
    assert admission.pending == 2
    assert not isinstance(factory(), FrameConnection)  # the third is refused, nothing built
    assert len(made) == 2 and admission.stats().refused_capacity == 1
    made[0].mark_authenticated()
    made[0].connection_lost(None)  # released on authentication, not again on close
    assert admission.pending == 1
    made[1].connection_lost(None)
    assert admission.pending == 0 and admission.stats().peak_pending == 2
    assert first is made[0] and second is made[1]


async def test_a_large_job_admits_its_own_world_size_at_once():
    """128 ranks register (or, eager, dial rank 0) at once: none is turned away for it,
    and the bound is still a bound."""
    admission = AdmissionControl(AdmissionLimits(max_unauthenticated=4, fd_reserve=0),
                                 owner="test", expected=6)
    assert admission.capacity == 6
    factory = admission.protocol_factory(lambda release: FrameConnection(
        WireLimits(), label="test", release=release))
    admitted = [factory() for _ in range(6)]
    assert all(isinstance(p, FrameConnection) for p in admitted) and admission.pending == 6
    assert not isinstance(factory(), FrameConnection)  # the seventh is refused
    assert admission.stats().refused_capacity == 1
    small = AdmissionControl(AdmissionLimits(max_unauthenticated=4), owner="t", expected=2)
    assert small.capacity == 4  # a small job keeps the configured bound
    with pytest.raises(ValueError, match="expected"):
        AdmissionControl(AdmissionLimits(), owner="t", expected=-1)


# ---------------------------------------------------------------------------------------
# the descriptor reserve and the rate-limited log, without sockets


class Admitted(asyncio.Protocol):
    """Stands in for a FrameConnection in the admission decisions below."""

    def __init__(self, release) -> None:
        self.release = release


def test_strangers_are_refused_within_the_descriptor_reserve():
    now = [0.0]
    open_fds = [100]
    admission = AdmissionControl(
        AdmissionLimits(max_unauthenticated=1000, fd_reserve=50), owner="test",
        clock=lambda: now[0], fd_counter=lambda: open_fds[0], fd_limit=lambda: 200)
    factory = admission.protocol_factory(Admitted)
    refused = 0
    for _ in range(100):
        open_fds[0] += 1  # each accepted socket is a descriptor
        if not isinstance(factory(), Admitted):
            refused += 1
            open_fds[0] -= 1  # closed at once
    # admitted while at least 50 of the 200 stayed free: fds 101..150
    assert admission.stats().admitted == 50 and refused == 50
    assert admission.stats().refused_descriptors == 50


def test_the_descriptor_count_is_refreshed_and_exact_near_the_limit():
    now = [0.0]
    counts = []

    def counter() -> int:
        counts.append(now[0])
        return 10

    admission = AdmissionControl(AdmissionLimits(max_unauthenticated=10**6, fd_reserve=8),
                                 owner="t", clock=lambda: now[0], fd_counter=counter,
                                 fd_limit=lambda: 10_000)
    factory = admission.protocol_factory(Admitted)
    for _ in range(5):
        factory()
    assert counts == [0.0]  # far from the limit: one count, corrected by admissions since
    now[0] = 0.2
    factory()
    assert counts == [0.0, 0.2]
    near = AdmissionControl(AdmissionLimits(max_unauthenticated=10**6, fd_reserve=8),
                            owner="t", clock=lambda: 0.0, fd_counter=counter,
                            fd_limit=lambda: 20)
    factory = near.protocol_factory(Admitted)
    counts.clear()
    factory(), factory()
    assert len(counts) == 2  # within 2 x reserve of the limit: counted every time


def test_out_of_descriptors_while_counting_refuses():
    def counter() -> int:
        raise OSError(errno.EMFILE, "Too many open files")

    admission = AdmissionControl(AdmissionLimits(), owner="t", fd_counter=counter,
                                 fd_limit=lambda: 1024)
    factory = admission.protocol_factory(Admitted)
    assert not isinstance(factory(), Admitted)
    assert admission.stats().refused_descriptors == 1


def test_the_refusal_log_is_rate_limited(caplog):
    now = [100.0]
    log = RateLimitedLog(logging.getLogger("netdist.transport"), 30.0, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="netdist.transport"):
        assert log.warning("refused %s", "a")
        assert not any(log.warning("refused %s", "b") for _ in range(500))
        assert log.held_back == 500
        now[0] += 30.0
        assert log.warning("refused %s", "c")
    assert [r.getMessage() for r in caplog.records] == [
        "refused a",
        "refused c [500 similar message(s) in the previous 30s not logged]"]


def test_admission_limits_are_validated():
    for field, value, message in [
        ("max_unauthenticated", 0, "max_unauthenticated must be >= 1, got 0"),
        ("handshake_timeout", 0.0, "handshake_timeout must be > 0 seconds, got 0.0"),
        ("handshake_header_bytes", 63, "handshake_header_bytes must be >= 64, got 63"),
        ("fd_reserve", -1, "fd_reserve must be >= 0, got -1"),
        ("refusal_log_interval", -1.0, "refusal_log_interval must be >= 0 seconds"),
    ]:
        with pytest.raises(ConfigError, match=message):
            AdmissionLimits(**{field: value})
    config = DistributedConfig(rank=0, world_size=2)
    assert config.admission == AdmissionLimits()
    assert config.admission.max_unauthenticated == 64 and config.admission.fd_reserve == 256


# ---------------------------------------------------------------------------------------
# a rank in a child process under RLIMIT_NOFILE 256: counted from /proc, and its
# checkpoint save still gets descriptors


def _open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc")
@pytest.mark.parametrize("bound", ["cap", "reserve"])
async def test_a_rank_under_a_low_descriptor_limit_survives_a_flood(bound, tmp_path):
    limit, total, batch = 256, 400, 50
    cap, reserve = (64, 64) if bound == "cap" else (100_000, 128)
    raise_nofile_limit()  # our 400 strangers must not exhaust the test process
    loop_kind = type(asyncio.get_running_loop()).__module__.split(".")[0]
    env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
    ckpt = tmp_path / "ckpt"
    # stderr goes to a file: an unread pipe could fill up and stall the child's exit
    with open(tmp_path / "stderr.txt", "wb") as errors:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, str(WORKER), str(limit), str(cap), str(reserve), str(ckpt),
            loop_kind, cwd=REPO, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=errors)
    strangers: list[Stranger] = []
    try:
        assert proc.stdout is not None and proc.stdin is not None
        line = await asyncio.wait_for(proc.stdout.readline(), 60)
        info = json.loads(line)
        pid, port = info["pid"], info["port"]
        # a HELLO makes an admitted stranger visible (the rank answers it, then waits for
        # an AUTH that never comes); a refused one is closed with nothing said
        hello = ClientHandshake(HandshakeIdentity(info["job_id"], 1, 2, "not-the-token"),
                                expect_role="rank", expect_rank=0).initiate()
        baseline = _open_fds(pid)
        peak = 0
        for _ in range(total // batch):
            strangers += [await Stranger.connect(port, hello) for _ in range(batch)]
            await wait_for_outcomes(strangers, len(strangers), WAIT)
            held = len(strangers) - closed(strangers)
            assert _open_fds(pid) == baseline + held  # the rank holds exactly those
            peak = max(peak, held)
        if bound == "cap":
            assert peak == cap and closed(strangers) == total - cap
        else:
            assert baseline + peak <= limit - reserve
            assert closed(strangers) >= total - (limit - reserve)
        proc.stdin.write(b"go\n")  # save, load and all_reduce with the strangers held
        await proc.stdin.drain()
        result = json.loads(await asyncio.wait_for(proc.stdout.readline(), 60))
        assert result["ok"], (result, (tmp_path / "stderr.txt").read_text()[-2000:])
        assert result["equal"] and result["reduced"] == [[3] * 4, [3] * 4]
        step = Path(result["step"])
        assert (step / "metadata.json").is_file() and step.parent == ckpt
        stats = result["stats"]
        assert stats["peak_pending"] == peak
        if bound == "cap":
            assert stats["refused_capacity"] == total - cap
        else:
            assert stats["refused_descriptors"] == closed(strangers)
        assert await asyncio.wait_for(proc.wait(), WAIT) == 0
    finally:
        await close_all(strangers)
        if proc.returncode is None:
            proc.kill()
            await asyncio.wait_for(proc.wait(), WAIT)


def test_raise_nofile_limit_never_lowers_and_stays_within_the_hard_limit():
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert raise_nofile_limit(target=soft) is None  # already there: nothing to do
    assert raise_nofile_limit(target=1) is None  # never lowered
    assert resource.getrlimit(resource.RLIMIT_NOFILE) == (soft, hard)


_RAISE_AT_START = """
import asyncio, resource
resource.setrlimit(resource.RLIMIT_NOFILE, (256, 2048))
from netdist.transport.local_tcp import create_local_tcp_group

async def main():
    group = await create_local_tcp_group(2, timeout=30.0, connect_timeout=30.0)
    print(resource.getrlimit(resource.RLIMIT_NOFILE))
    for transport in group:
        await transport.aclose()

asyncio.run(main())
"""


def test_a_transport_raises_the_soft_descriptor_limit_towards_the_hard_one():
    env = dict(os.environ, PYTHONPATH=str(REPO))
    done = subprocess.run([sys.executable, "-c", _RAISE_AT_START], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[0] == "(2048, 2048)"
