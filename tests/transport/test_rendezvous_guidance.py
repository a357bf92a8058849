"""Rendezvous failures say what to do (issue 26, "the first hour of a new user").

* Rank 0's timeout names the connections its coordinator refused and why (a rank with
  the wrong token), from a record that strangers cannot grow.
* A rank retrying an absent coordinator says so once, naming the address, the time left
  and what to check; its final error says the same.
* ``netdist.init()`` / ``netdist.connect()`` failing in a user's script end in the
  user's own lines and one line naming the error, unless ``NETDIST_DEBUG=1``: checked on
  real interpreters (bounded subprocesses), as a user would see it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import secrets
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from netdist.config import DistributedConfig
from netdist.errors import AuthenticationError, ConnectError, RendezvousTimeoutError
from netdist.transport.admission import MAX_REFUSAL_RANKS, RefusalRecord
from netdist.transport.rendezvous import (
    COORDINATOR_ADVICE,
    Coordinator,
    PeerAddress,
    RendezvousClient,
)

from tests.ranks import REPO, finish_ranks, free_port, rank_env, start_processes

TOKEN = "secret-rendezvous-token"
TOKEN_ADVICE = "check that NETDIST_TOKEN is the same on every rank"
BOUND = 60.0
"""Bound on every subprocess (generous: a loaded 2-core machine)."""


def config(rank: int, world_size: int, port: int, **overrides) -> DistributedConfig:
    settings: dict[str, Any] = dict(job_id="rdv-guidance", token=TOKEN, connect_timeout=5.0)
    settings.update(overrides)
    return DistributedConfig(rank=rank, world_size=world_size,
                             coordinator=("127.0.0.1", port), **settings)


async def register(rank: int, world_size: int, port: int, **overrides
                   ) -> tuple[PeerAddress, ...]:
    loop = asyncio.get_running_loop()
    cfg = config(rank, world_size, port, **overrides)
    client = await RendezvousClient.connect(cfg, deadline=loop.time() + cfg.join_timeout)
    try:
        return await client.register(PeerAddress("127.0.0.1", 9000 + rank))
    finally:
        await client.aclose()


async def wait_registered(coordinator: Coordinator, rank: int) -> None:
    for _ in range(1000):
        if rank in coordinator.registered:
            return
        await asyncio.sleep(0.01)  # polling the coordinator's state, bounded
    raise AssertionError(f"rank {rank} never registered")


@contextlib.contextmanager
def refusing_port() -> Iterator[int]:
    """A port on 127.0.0.1 where nothing listens: bound (so no one else takes it) but
    not listening, so every connection is refused at once."""
    with contextlib.closing(socket.socket()) as sock:
        sock.bind(("127.0.0.1", 0))
        yield int(sock.getsockname()[1])


# ------------------------------------------------------------------ the refusal record


def test_refusal_record_counts_per_claimed_rank_and_says_why() -> None:
    record = RefusalRecord(4)
    assert record.describe([1]) == ""
    record.add("10.0.0.1:5000", "bad token (fix it)", claimed_rank=1)
    record.add("10.0.0.2:5001", "bad token (fix it)", claimed_rank=1)
    record.add("10.0.0.3:5002", "another job id (fix that)", claimed_rank=3)
    assert record.describe([1]) == (
        "refused 2 connections claiming rank 1, the last from 10.0.0.2:5001: bad token "
        "(fix it); refused 1 other connection from 10.0.0.3:5002: another job id (fix that)")
    assert record.describe([1, 3]) == (
        "refused 2 connections claiming rank 1, the last from 10.0.0.2:5001: bad token "
        "(fix it); refused 1 connection claiming rank 3 from 10.0.0.3:5002: another job id "
        "(fix that)")
    assert record.describe([2]) == (
        "refused 3 connections, the last from 10.0.0.3:5002: another job id (fix that)")
    assert record.total == 3 and record.ranks == (1, 3) and record.other is None


def test_refusal_record_stays_bounded_whatever_strangers_claim() -> None:
    record = RefusalRecord(1000)
    for claimed in range(1000):  # every rank of the job, then ranks no job has
        record.add(f"198.51.100.7:{claimed}", "bad token", claimed_rank=claimed)
    for stranger in (1000, 2**32 - 1, None):
        record.add("198.51.100.8:1", "x" * 10_000, claimed_rank=stranger)
    assert record.ranks == tuple(range(MAX_REFUSAL_RANKS))  # the first ones refused
    assert record.total == 1003
    other = record.other
    assert other is not None and other.count == 1003 - MAX_REFUSAL_RANKS
    assert len(other.reason) == 200 and other.reason.endswith("...")
    # a rank kept apart keeps counting; one beyond the bound goes to the shared entry
    record.add("198.51.100.9:2", "bad token", claimed_rank=0)
    record.add("198.51.100.9:3", "bad token", claimed_rank=500)
    first = record.get(0)
    assert first is not None and first.count == 2 and first.address == "198.51.100.9:2"
    assert record.get(500) is None and other.count == 1004 - MAX_REFUSAL_RANKS


# -------------------------------------------------------- rank 0 names what it refused


async def test_timeout_names_the_rank_refused_for_a_bad_token() -> None:
    coordinator = await Coordinator.start(config(0, 2, 0, connect_timeout=1.0))
    try:
        port = coordinator.address[1]
        rank0 = asyncio.create_task(register(0, 2, port, connect_timeout=1.0))
        await wait_registered(coordinator, 0)
        for _ in range(2):
            with pytest.raises(AuthenticationError) as refused:
                await register(1, 2, port, token="wrong-rendezvous-token")
            assert refused.value.code == "token"
            assert str(refused.value) == (
                f"coordinator at 127.0.0.1:{port} refused rank 1: authentication failed: "
                f"token mismatch ({TOKEN_ADVICE})")
        # a stranger claiming a rank this job does not have is counted apart
        with pytest.raises(AuthenticationError):
            await register(5, 8, port, token="wrong-rendezvous-token")
        with pytest.raises(RendezvousTimeoutError) as timed_out:
            await rank0
    finally:
        await coordinator.aclose()
    assert timed_out.value.missing == (1,)
    assert re.fullmatch(
        r"rank 0: rendezvous timed out after 1\.0s: rank 1 never arrived \(1 of 2 "
        r"registered\); the coordinator refused 2 connections claiming rank 1, the last "
        r"from 127\.0\.0\.1:\d+: bad token \(check that NETDIST_TOKEN is the same on every "
        r"rank\); refused 1 other connection from 127\.0\.0\.1:\d+: bad token \(check that "
        r"NETDIST_TOKEN is the same on every rank\)", str(timed_out.value)), timed_out.value
    assert coordinator.refusals.total == 3 and coordinator.refusals.ranks == (1,)


async def test_timeout_without_refusals_says_what_to_check() -> None:
    coordinator = await Coordinator.start(config(0, 4, 0, connect_timeout=0.5))
    try:
        port = coordinator.address[1]
        with pytest.raises(RendezvousTimeoutError) as timed_out:
            await register(0, 4, port, connect_timeout=0.5)
    finally:
        await coordinator.aclose()
    assert str(timed_out.value) == (
        "rank 0: rendezvous timed out after 0.5s: ranks 1, 2, 3 never arrived (1 of 4 "
        "registered); check that ranks 1, 2, 3 were started and that their "
        "NETDIST_COORDINATOR (or MASTER_ADDR / MASTER_PORT) points at this coordinator "
        f"(127.0.0.1:{port}), with the same NETDIST_WORLD_SIZE")


# ------------------------------------------------ a rank retrying an absent coordinator


async def test_retrying_rank_says_once_what_it_waits_for(caplog) -> None:
    loop = asyncio.get_running_loop()
    with refusing_port() as port, \
            caplog.at_level(logging.WARNING, logger="netdist.transport"):
        with pytest.raises(ConnectError) as failed:
            await RendezvousClient.connect(config(1, 2, port, connect_timeout=0.5),
                                           deadline=loop.time() + 0.5, notice_after=0.0)
    notices = [record for record in caplog.records if record.name == "netdist.transport"]
    assert len(notices) == 1, caplog.text
    assert notices[0].levelno == logging.WARNING
    assert re.fullmatch(
        rf"netdist: rank 1 is still trying to reach the coordinator at 127\.0\.0\.1:{port} "
        r"\(for \d+\.\ds now\); it keeps trying for \d+\.\ds more \(the join timeout is 0\.5s, "
        r"NETDIST_CONNECT_TIMEOUT\): check that rank 0 is running and that "
        r"NETDIST_COORDINATOR \(or MASTER_ADDR / MASTER_PORT\) is its address",
        notices[0].getMessage()), notices[0].getMessage()
    message = str(failed.value)
    assert f"cannot connect to 127.0.0.1:{port}" in message
    assert message.endswith(f"(NETDIST_CONNECT_TIMEOUT): {COORDINATOR_ADVICE}")
    assert type(failed.value) is ConnectError
    assert isinstance(failed.value.__cause__, ConnectionRefusedError)  # the OS error


# ------------------------------------------------------ what a user's script prints

ASYNC_SCRIPT = """\
import asyncio
import netdist

async def main():
    async with netdist.init() as transport:
        print("joined", transport.rank)

asyncio.run(main())
"""

SYNC_SCRIPT = """\
import netdist

with netdist.connect() as job:
    print("joined", job.rank)
"""


def run_script(tmp_path: Path, source: str, env: dict[str, str]
               ) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "train.py"
    script.write_text(source)
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=BOUND, env=env, cwd=tmp_path)


def user_env(rank: int, port: int, *, token: str, connect_timeout: float,
             debug: bool = False) -> dict[str, str]:
    env = rank_env(rank, 2, f"127.0.0.1:{port}", token, "guidance-job")
    env["NETDIST_CONNECT_TIMEOUT"] = str(connect_timeout)
    if debug:
        env["NETDIST_DEBUG"] = "1"
    return env


def frames(stderr: str) -> list[str]:
    """The files the traceback in ``stderr`` goes through."""
    return re.findall(r'^  File "([^"]+)", line \d+', stderr, flags=re.MULTILINE)


@pytest.mark.parametrize(("source", "user_frames"), [(ASYNC_SCRIPT, 2), (SYNC_SCRIPT, 1)],
                         ids=["init", "connect"])
def test_a_failed_join_ends_in_one_line_in_the_users_script(
        tmp_path: Path, source: str, user_frames: int) -> None:
    with refusing_port() as port:
        result = run_script(tmp_path, source, user_env(
            1, port, token=secrets.token_hex(16), connect_timeout=1.0))
    assert result.returncode == 1, result.stderr
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    # the one notice while it retried (after half the 1 s timeout), then the traceback
    assert lines[0].startswith("netdist: rank 1 is still trying to reach the coordinator "
                               f"at 127.0.0.1:{port} "), lines
    assert lines[1] == "Traceback (most recent call last):", lines
    # which holds the user's lines (and asyncio.run's own), nothing of netdist
    files = frames(result.stderr)
    script = str(tmp_path / "train.py")
    assert files.count(script) == user_frames, files
    asyncio_dir = os.path.dirname(asyncio.__file__)
    assert all(os.path.dirname(path) == asyncio_dir for path in files if path != script)
    assert not [line for line in lines if "netdist/" in line or "The above" in line], lines
    # each frame is its File line, its source line and perhaps a caret line
    assert all(line.startswith("    ") or line.startswith('  File "') for line in lines[2:-1])
    assert len(lines) <= 2 + 3 * len(files) + 1, lines
    assert lines[-1].startswith("netdist.errors.ConnectError: rank 1 reaching the "
                                f"coordinator: cannot connect to 127.0.0.1:{port} ")
    assert lines[-1].endswith(f"(NETDIST_CONNECT_TIMEOUT): {COORDINATOR_ADVICE}")
    if user_frames == 1:
        assert len(lines) <= 6, lines


def test_netdist_debug_keeps_the_whole_traceback(tmp_path: Path) -> None:
    with refusing_port() as port:
        result = run_script(tmp_path, SYNC_SCRIPT, user_env(
            1, port, token=secrets.token_hex(16), connect_timeout=1.0, debug=True))
    assert result.returncode == 1, result.stderr
    assert "netdist/transport/rendezvous.py" in result.stderr
    assert "netdist/transport/connection.py" in result.stderr
    assert "ConnectionRefusedError: [Errno 111]" in result.stderr
    assert "The above exception was the direct cause" in result.stderr
    assert result.stderr.splitlines()[-1].endswith(COORDINATOR_ADVICE)


WRONG_TOKEN_RANK = """\
import netdist

connect = netdist.connect  # imported before saying it started
print("START", flush=True)
with connect() as job:
    print("joined", job.rank)
"""


def test_rank_0_names_the_rank_it_refused_for_a_wrong_token(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(WRONG_TOKEN_RANK)
    port = free_port()
    token = secrets.token_hex(16)
    # rank 1 first, with another token and a long timeout: it retries until rank 0's
    # coordinator is up, and is refused at once then
    rank1, = start_processes([[str(script)]], merge_stderr=False, env=user_env(
        1, port, token=secrets.token_hex(16), connect_timeout=BOUND))
    procs = [rank1]
    try:
        rank1.expect("START", timeout=BOUND)
        rank0, = start_processes([[str(script)]], merge_stderr=False, env=user_env(
            0, port, token=token, connect_timeout=4.0))
        procs.append(rank0)
        done = finish_ranks(procs, timeout=BOUND)
    finally:
        for proc in procs:
            proc.kill()
    refused, timed_out = done[0].stderr.splitlines(), done[1].stderr.splitlines()
    assert done[0].returncode == 1 and done[1].returncode == 1, (refused, timed_out)
    assert refused[-1] == (
        f"netdist.errors.AuthenticationError: coordinator at 127.0.0.1:{port} refused "
        f"rank 1: authentication failed: token mismatch ({TOKEN_ADVICE})"), refused
    assert re.fullmatch(
        r"netdist\.errors\.RendezvousTimeoutError: rank 0: rendezvous timed out after "
        r"4\.0s: rank 1 never arrived \(1 of 2 registered\); the coordinator refused 1 "
        r"connection claiming rank 1 from 127\.0\.0\.1:\d+: bad token \(check that "
        r"NETDIST_TOKEN is the same on every rank\)", timed_out[-1]), timed_out
    for lines in (refused, timed_out):
        assert not [line for line in lines if f"{REPO}/netdist" in line], lines
