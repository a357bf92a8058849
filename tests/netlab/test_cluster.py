"""``netdist.netlab.Cluster``: hosts on a switch reach each other, their links hold the
rate they were given (in both directions, also through the bridge), and ``cut`` makes a
host unreachable within a bound until ``heal``.

Only lower bounds on time are asserted: a shaped link can be no faster than its rate
(plus one token bucket of burst), but a loaded CI machine can make anything slower.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from netdist.netlab import Cluster, burst_bytes
from tests.netlab import require_netlab

pytestmark = pytest.mark.slow

WORKER = Path(__file__).resolve().parent / "transfer_worker.py"
PORT = 29600
DEADLINE = 90.0
RATE_MBIT = 100.0


@contextmanager
def _servers(cluster: Cluster, peers: dict[int, int]) -> Iterator[dict[int, subprocess.Popen[str]]]:
    """A ``serve`` worker on each host of ``peers`` (host -> connections to take), each
    ready (it printed READY) before the block runs; killed if still running after it."""
    procs: dict[int, subprocess.Popen[str]] = {}
    try:
        for host, count in peers.items():
            procs[host] = cluster.lab.popen(
                cluster.hosts[host],
                [sys.executable, str(WORKER), "serve", cluster.address(host), str(PORT),
                 str(count)],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for host, proc in procs.items():
            assert proc.stdout is not None
            line = _line(proc, time.monotonic() + DEADLINE)
            assert line == "READY", f"host {host}'s server said {line!r}"
        yield procs
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
            proc.communicate(timeout=30)


def _line(proc: subprocess.Popen[str], deadline: float) -> str:
    import select

    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], max(deadline - time.monotonic(), 0))
    assert ready, f"no output within the deadline (exit {proc.poll()})"
    return proc.stdout.readline().strip()


def _received(proc: subprocess.Popen[str]) -> tuple[int, float]:
    """A server's ``RECEIVED BYTES SECONDS``."""
    out, err = proc.communicate(timeout=DEADLINE)
    words = out.split()
    assert proc.returncode == 0 and words[:1] == ["RECEIVED"], out + err
    return int(words[1]), float(words[2])


def _sent(stdout: str) -> tuple[int, float]:
    words = stdout.split()
    assert words[:1] == ["SENT"], stdout
    return int(words[1]), float(words[2])


def _least_seconds(nbytes: int) -> float:
    """The shortest time ``nbytes`` can take through one shaped direction of a link."""
    return (nbytes - burst_bytes(RATE_MBIT)) / (RATE_MBIT * 1e6 / 8)


@pytest.mark.timeout(DEADLINE * 2)
def test_every_host_reaches_every_other_over_tcp() -> None:
    """Hosts with 1, 2 and 1 ranks: each rank sends to every other host's server."""
    require_netlab()
    size = 4096
    with Cluster.create("1,2,1") as cluster:
        layout = cluster.layout
        env = cluster.rank_env(2, 29500, "t" * 32, torch=True)
        assert (env["NETDIST_RANK"], env["RANK"], env["LOCAL_RANK"],
                env["LOCAL_WORLD_SIZE"], env["WORLD_SIZE"]) == ("2", "2", "1", "2", "4")
        assert env["NETDIST_ADVERTISE_ADDR"] == env["NETDIST_LISTEN_HOST"] == cluster.address(1)
        assert env["NETDIST_COORDINATOR"] == f"{cluster.address(0)}:29501"
        assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == (cluster.address(0), "29500")
        assert env["GLOO_SOCKET_IFNAME"] == cluster.interface(1)
        assert env["NETDIST_HOST_ID"] == cluster.hosts[1].name
        assert len({cluster.address(h) for h in range(3)}) == 3
        peers = {h: layout.world_size - layout.ranks_per_host[h] for h in range(3)}
        with _servers(cluster, peers) as servers:
            results = cluster.run(lambda rank: [
                sys.executable, str(WORKER), "send", str(PORT), str(size),
                *(cluster.address(h) for h in range(3) if h != layout.host_of(rank))],
                DEADLINE)
            for result in results:
                assert result.ok, result
                assert _sent(result.stdout)[0] == 2 * size, result
            for host, server in servers.items():
                assert _received(server)[0] == peers[host] * size


@pytest.mark.timeout(DEADLINE * 2)
def test_a_two_host_link_holds_its_rate() -> None:
    require_netlab()
    size = 4 * 1024 * 1024  # 0.34 s at 100 Mbit/s
    with Cluster.create("2x1", rate_mbit=RATE_MBIT) as cluster:
        with _servers(cluster, {1: 1}) as servers:
            results = cluster.run(lambda rank: [
                sys.executable, str(WORKER), "send", str(PORT), str(size),
                *([cluster.address(1)] if rank == 0 else [])], DEADLINE)
            assert all(r.ok for r in results), results
            received, seconds = _received(servers[1])
    assert received == size
    assert seconds >= _least_seconds(size), f"{size} B took {seconds:.3f} s"
    assert _sent(results[0].stdout)[1] >= _least_seconds(size)


@pytest.mark.timeout(DEADLINE * 2)
def test_links_through_the_switch_limit_each_hosts_upload_and_download() -> None:
    """4 hosts: 0 and 1 both send to 2 (2's download carries both), while 3 sends to 0
    and 1 (3's upload carries both); the directions used are otherwise all distinct."""
    require_netlab()
    size = 2 * 1024 * 1024
    targets = {0: [2], 1: [2], 2: [], 3: [0, 1]}
    with Cluster.create("4x1", rate_mbit=RATE_MBIT) as cluster:
        with _servers(cluster, {0: 1, 1: 1, 2: 2}) as servers:
            results = cluster.run(lambda rank: [
                sys.executable, str(WORKER), "send", str(PORT), str(size),
                *(cluster.address(h) for h in targets[rank])], DEADLINE)
            assert all(r.ok for r in results), results
            download = _received(servers[2])
            for host in (0, 1):
                assert _received(servers[host])[0] == size
    upload = _sent(results[3].stdout)
    assert download[0] == upload[0] == 2 * size
    assert download[1] >= _least_seconds(2 * size), f"host 2 got 2x{size} B in {download[1]:.3f} s"
    assert upload[1] >= _least_seconds(2 * size), f"host 3 sent 2x{size} B in {upload[1]:.3f} s"


def _probe(cluster: Cluster, source: int, target: int, seconds: float) -> tuple[str, float]:
    proc = cluster.lab.popen(cluster.hosts[source],
                             [sys.executable, str(WORKER), "probe", cluster.address(target),
                              str(PORT), str(seconds)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate(timeout=DEADLINE)
    words = out.split()
    assert proc.returncode == 0 and words[:1] in (["CONNECTED"], ["FAILED"]), out + err
    return words[0], float(words[1])


@pytest.mark.timeout(DEADLINE * 2)
def test_a_cut_host_is_unreachable_until_healed() -> None:
    require_netlab()
    attempt = 2.0
    with Cluster.create("3x1", rate_mbit=RATE_MBIT) as cluster:
        with _servers(cluster, {1: 2, 2: 1}):
            assert _probe(cluster, 0, 1, attempt)[0] == "CONNECTED"
            cluster.cut(1)
            verdict, seconds = _probe(cluster, 0, 1, attempt)
            assert verdict == "FAILED" and seconds <= attempt + 1.0, (verdict, seconds)
            verdict, seconds = _probe(cluster, 1, 2, attempt)  # nor can it reach out
            assert verdict == "FAILED" and seconds <= attempt + 1.0, (verdict, seconds)
            cluster.heal(1)
            assert _probe(cluster, 0, 1, attempt)[0] == "CONNECTED"
            assert _probe(cluster, 1, 2, attempt)[0] == "CONNECTED"
