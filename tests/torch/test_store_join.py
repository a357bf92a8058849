"""Meeting through torch's store across torchrun attempts (issue 27): every key netdist
writes is unique per attempt, group and generation, and a rank never uses a coordinator
address from an earlier attempt, even when two attempts share a key.

The store is a real ``TCPStore`` served from this process and shared by every "attempt",
as torchrun's agent store is; ranks are ``join_from_store`` calls in threads, each
connecting a real netdist ``Job`` over TCP on 127.0.0.1. ``TORCHELASTIC_RESTART_COUNT``
and ``TORCHELASTIC_RUN_ID`` are set as torchrun sets them for the workers of an attempt.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import torch.distributed as dist

from netdist.config import DistributedConfig
from netdist.errors import AuthenticationError, RendezvousError, RendezvousTimeoutError
from netdist.progress.job import Job
from netdist.torch.store_join import join_from_store, read_record
from netdist.torch.store_keys import Attempt, CoordinatorRecord

TIMEOUT = timedelta(seconds=20)
BOUND = 60.0  # outer bound on every thread of a test
GROUP = "0"  # torch's name of the default group


@pytest.fixture
def server() -> Iterator[dist.TCPStore]:
    """torchrun's agent store: one server for the whole run, on 127.0.0.1."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=TIMEOUT)
    yield store


def client(server: dist.TCPStore) -> dist.PrefixStore:
    """A worker's view of the store, prefixed as ``init_process_group`` prefixes it."""
    store = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=TIMEOUT)
    return dist.PrefixStore(f"default_pg/{GROUP}//cpu/", store)


@pytest.fixture
def torchrun_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """torchrun's variables for attempt 0 of run ``r27``; no NETDIST_TOKEN (netdist draws)."""
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "r27")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    monkeypatch.delenv("NETDIST_TOKEN", raising=False)
    monkeypatch.delenv("NETDIST_COORDINATOR", raising=False)
    return monkeypatch


def join(server: dist.TCPStore, rank: int, world: int = 2) -> tuple[Job, CoordinatorRecord]:
    return join_from_store(client(server), rank, world, TIMEOUT, GROUP)


def close_all(*joined: tuple[Job, CoordinatorRecord]) -> None:
    for job, _ in joined:
        job.close()


# ------------------------------------------------------------------------ key naming


def test_keys_are_unique_per_attempt_group_world_and_generation() -> None:
    base = Attempt("0", 2, "r27", 0)
    others = [Attempt("0", 2, "r27", 1), Attempt("1", 2, "r27", 0),
              Attempt("0", 3, "r27", 0), Attempt("0", 2, "r28", 0),
              Attempt("0", 2, None, None)]
    keys = {base.coordinator_key(0), base.coordinator_key(1),
            *(a.coordinator_key(0) for a in others)}
    assert len(keys) == 7
    assert len({base.arrivals_key, *(a.arrivals_key for a in others)}) == 6
    assert base.coordinator_key(0) == "netdist/0/r27:0/w2/g0/coordinator"
    assert Attempt("a/b", 2, "x/y", 3).prefix == "netdist/a%2Fb/x%2Fy:3/w2"
    assert [base.generation(n) for n in (1, 2, 3, 4, 5)] == [0, 0, 1, 1, 2]


def test_attempt_comes_from_torchruns_variables() -> None:
    env = {"TORCHELASTIC_RUN_ID": "job7", "TORCHELASTIC_RESTART_COUNT": "2"}
    assert Attempt.from_env("0", 4, env) == Attempt("0", 4, "job7", 2)
    assert Attempt.from_env("0", 4, {}) == Attempt("0", 4, None, None)
    with pytest.raises(ValueError, match="TORCHELASTIC_RESTART_COUNT='two'"):
        Attempt.from_env("0", 4, {"TORCHELASTIC_RESTART_COUNT": "two"})


def test_the_record_names_its_attempt_and_hides_its_token() -> None:
    attempt = Attempt("0", 2, "r27", 1)
    record = CoordinatorRecord(("::1", 4567), attempt, 0, "ab12", token="secret")
    again = CoordinatorRecord.decode(record.encode(), "k")
    assert again == record and again.token == "secret"
    assert "secret" not in repr(record) and "token" not in record.as_dict()
    assert record.as_dict()["address"] == "[::1]:4567"
    assert record.job_id == "torch:0:1.0:ab12"
    assert record.stale_for(attempt, 0) is None
    assert "restart 0" in str(record.stale_for(Attempt("0", 2, "r27", 0), 0))
    assert "generation" in str(record.stale_for(attempt, 1))
    with pytest.raises(RendezvousError, match="store key 'k'"):
        CoordinatorRecord.decode(b"127.0.0.1:4567", "k")  # what netdist wrote before


# ------------------------------------------------------- one store, two attempts


def test_a_restarted_rank_never_reads_the_earlier_attempts_address(
        server: dist.TCPStore, torchrun_env: pytest.MonkeyPatch) -> None:
    """The reported failure: attempt 0's record is in the store when attempt 1's rank 1
    arrives before attempt 1's rank 0 has published. It must wait for attempt 1's."""
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        first = [pool.submit(join, server, rank) for rank in (0, 1)]
        attempt0 = [f.result(BOUND) for f in first]
    close_all(*attempt0)  # attempt 0 is gone, its record stays in the store

    torchrun_env.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    observer = client(server)
    arrivals = Attempt("0", 2, "r27", 1).arrivals_key
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        rank1 = pool.submit(join, server, 1)
        wait_until(lambda: observer.add(arrivals, 0) == 1 or rank1.done())
        assert not rank1.done(), rank1.result()  # it is waiting, not joined elsewhere
        rank0 = pool.submit(join, server, 0)
        attempt1 = [rank0.result(BOUND), rank1.result(BOUND)]
    try:
        (_, old), (_, old1) = attempt0
        (_, new), (_, new1) = attempt1
        assert old == old1 and new == new1  # each attempt met at one coordinator
        assert (old.attempt.restart_count, new.attempt.restart_count) == (0, 1)
        assert new.nonce != old.nonce
        assert attempt1[1][0].config.coordinator == new.address
        assert attempt1[1][0].config.job_id == new.job_id != old.job_id
    finally:
        close_all(*attempt1)


def test_a_stale_record_under_a_shared_key_is_never_used(
        server: dist.TCPStore, torchrun_env: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """Were two attempts to share a key, the reader would find the earlier attempt's
    record there: it reads again until rank 0 of its own attempt overwrites it."""
    attempt = Attempt("0", 2, "r27", 1)
    key = attempt.coordinator_key(0)
    store = Watched(client(server))
    stale = CoordinatorRecord(("127.0.0.1", 1), Attempt("0", 2, "r27", 0), 0, "old")
    fresh = CoordinatorRecord(("127.0.0.1", 2), attempt, 0, "new")
    store.set(key, stale.encode())
    with caplog.at_level(logging.WARNING, logger="netdist.torch"), \
            concurrent.futures.ThreadPoolExecutor(1) as pool:
        reading = pool.submit(read_record, store, attempt, 0, 1, BOUND)
        assert store.got.wait(BOUND)  # the reader has seen the stale record...
        assert not reading.done()     # ...and did not take it
        store.set(key, fresh.encode())
        assert reading.result(BOUND) == fresh
    assert "stale coordinator record" in caplog.text and "restart 0" in caplog.text


def test_a_stale_record_that_is_never_replaced_times_out_naming_it(
        server: dist.TCPStore, torchrun_env: pytest.MonkeyPatch) -> None:
    attempt = Attempt("0", 2, "r27", 1)
    store = client(server)
    old = CoordinatorRecord(("127.0.0.1", 1), Attempt("0", 2, "r27", 0), 0, "old")
    store.set(attempt.coordinator_key(0), old.encode())
    with pytest.raises(RendezvousTimeoutError) as info:
        read_record(store, attempt, 0, 1, 0.3)
    text = str(info.value)
    assert "netdist/0/r27:1/w2/g0/coordinator" in text and "restart 0" in text
    assert "127.0.0.1:1 was not used" in text


def test_a_missing_rank_0_times_out_naming_the_key(
        server: dist.TCPStore, torchrun_env: pytest.MonkeyPatch) -> None:
    with pytest.raises(RendezvousTimeoutError, match=r"did not publish .* 'netdist/0/r27:0"):
        read_record(client(server), Attempt("0", 2, "r27", 0), 0, 1, 0.5)


def test_two_joins_on_one_store_outside_torchrun_use_new_generations(
        server: dist.TCPStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """No torchrun variables (env://, a FileStore kept across runs, init after destroy in
    one process): the arrivals counter numbers the joins, and each has its own key."""
    for name in ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "NETDIST_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    records = []
    for _ in range(2):
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            joined = [f.result(BOUND) for f in [pool.submit(join, server, r) for r in (0, 1)]]
        close_all(*joined)
        assert joined[0][1] == joined[1][1]
        records.append(joined[0][1])
    assert [r.generation for r in records] == [0, 1]
    assert records[0].nonce != records[1].nonce


def test_a_rank_holding_another_incarnations_record_is_refused(
        server: dist.TCPStore, torchrun_env: pytest.MonkeyPatch) -> None:
    """The nonce is part of the job id that netdist's handshake checks: an old record that
    points at a live coordinator (a reused port) cannot join it."""
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        rank0 = pool.submit(join, server, 0)
        record = read_record(client(server), Attempt("0", 2, "r27", 0), 0, 1, BOUND)
        old = CoordinatorRecord(record.address, record.attempt, 0, "0ld0ld", record.token)
        config = DistributedConfig(rank=1, world_size=2, coordinator=old.address,
                                   job_id=old.job_id, token=str(record.token), timeout=5.0)
        with pytest.raises(AuthenticationError) as info:
            Job.connect(config)
        assert info.value.code == "job_id"
        rank1 = pool.submit(join, server, 1)  # the right record still joins
        joined = [rank0.result(BOUND), rank1.result(BOUND)]
    close_all(*joined)


# --------------------------------------------------------------------------- helpers


class Watched:
    """A store that sets ``got`` once a ``get`` has returned: the event a test waits for
    instead of guessing how long a reader takes."""

    def __init__(self, store: Any) -> None:
        self._store = store
        self.got = threading.Event()

    def get(self, key: str) -> bytes:
        value = self._store.get(key)
        self.got.set()
        return bytes(value)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


def wait_until(condition: Any, timeout: float = BOUND) -> None:
    """Wait (bounded) until ``condition()``, which reads the store, holds."""
    deadline = time.monotonic() + timeout
    pause = 0.005
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"condition not met within {timeout}s")
        time.sleep(pause)  # polling the store for the event, not waiting for time
        pause = min(pause * 2, 0.05)


def test_a_world_of_one_rank_joins_without_publishing(
        server: dist.TCPStore, torchrun_env: pytest.MonkeyPatch) -> None:
    """One rank binds no coordinator (``init_process_group("netdist")`` with world size 1,
    as a one-worker Ray Train run makes it): the join still returns its job and a record
    of its attempt, and writes nothing for others to read."""
    job, record = join(server, 0, world=1)
    try:
        assert (job.rank, job.world_size) == (0, 1)
        assert record.stale_for(Attempt.from_env(GROUP, 1), record.generation) is None
        assert not client(server).check([Attempt.from_env(GROUP, 1).coordinator_key(0)])
    finally:
        job.close()
