"""Rendezvous: the address table, duplicates, missing ranks, late coordinators."""

from __future__ import annotations

import asyncio

import pytest

from netdist.config import DistributedConfig
from netdist.errors import ConnectError, RendezvousError, RendezvousTimeoutError
from netdist.transport.rendezvous import Coordinator, PeerAddress, RendezvousClient

from tests.transport.util import free_port


def config(rank: int, world_size: int, port: int, **overrides) -> DistributedConfig:
    settings = dict(job_id="rdv", token="secret-rendezvous-token", connect_timeout=5.0)
    settings.update(overrides)
    return DistributedConfig(rank=rank, world_size=world_size,
                             coordinator=("127.0.0.1", port), **settings)


async def register(rank: int, world_size: int, port: int, listen_port: int,
                   **overrides) -> tuple[PeerAddress, ...]:
    loop = asyncio.get_running_loop()
    cfg = config(rank, world_size, port, **overrides)
    client = await RendezvousClient.connect(cfg, deadline=loop.time() + cfg.connect_timeout)
    try:
        return await client.register(PeerAddress("127.0.0.1", listen_port))
    finally:
        await client.aclose()


async def wait_registered(coordinator: Coordinator, rank: int) -> None:
    for _ in range(500):
        if rank in coordinator.registered:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"rank {rank} never registered")


async def test_every_rank_gets_the_full_table():
    coordinator = await Coordinator.start(config(0, 3, 0))
    try:
        port = coordinator.address[1]
        tables = await asyncio.gather(*(register(r, 3, port, 4000 + r) for r in (2, 0, 1)))
        expected = tuple(PeerAddress("127.0.0.1", 4000 + r) for r in range(3))
        assert all(table == expected for table in tables)
        await coordinator.wait_finished(5.0)
        assert coordinator.finished
    finally:
        await coordinator.aclose()
    await coordinator.aclose()  # idempotent


async def test_duplicate_rank_is_refused_and_the_job_still_forms():
    coordinator = await Coordinator.start(config(0, 3, 0))
    try:
        port = coordinator.address[1]
        first = asyncio.create_task(register(1, 3, port, 5001))
        await wait_registered(coordinator, 1)
        with pytest.raises(RendezvousError, match="rank 1 is already registered"):
            await register(1, 3, port, 5009)
        rest = await asyncio.gather(register(0, 3, port, 5000), register(2, 3, port, 5002))
        table = await first
        assert table == rest[0] == rest[1]
        assert table[1] == PeerAddress("127.0.0.1", 5001)
    finally:
        await coordinator.aclose()


async def test_world_size_mismatch_is_refused():
    coordinator = await Coordinator.start(config(0, 3, 0))
    try:
        with pytest.raises(RendezvousError, match="world size 4 != 3"):
            await register(1, 4, coordinator.address[1], 5001)
    finally:
        await coordinator.aclose()


async def test_missing_ranks_are_named_on_every_registered_rank():
    coordinator = await Coordinator.start(config(0, 4, 0, connect_timeout=0.5))
    try:
        port = coordinator.address[1]
        results = await asyncio.gather(register(0, 4, port, 6000), register(2, 4, port, 6002),
                                       return_exceptions=True)
        for result in results:
            assert isinstance(result, RendezvousTimeoutError)
            assert result.missing == (1, 3)
            assert "ranks 1, 3 never arrived (2 of 4 registered)" in str(result)
    finally:
        await coordinator.aclose()


async def test_ranks_wait_for_a_coordinator_that_starts_late():
    port = free_port()
    early = [asyncio.create_task(register(r, 3, port, 7000 + r)) for r in (1, 2)]
    await asyncio.sleep(0.3)  # rank 0 starts late: the others keep retrying meanwhile
    assert not any(task.done() for task in early)
    coordinator = await Coordinator.start(config(0, 3, port))
    try:
        tables = await asyncio.gather(register(0, 3, port, 7000), *early)
        assert len({table for table in tables}) == 1
    finally:
        await coordinator.aclose()


async def test_unreachable_coordinator_gives_up_at_the_connect_timeout():
    port = free_port()
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(ConnectError, match=f"cannot connect to 127.0.0.1:{port}"):
        await RendezvousClient.connect(config(1, 2, port, connect_timeout=0.3),
                                       deadline=started + 0.3)
    assert loop.time() - started < 2.0


async def test_garbage_on_the_coordinator_port_does_not_disturb_the_rendezvous():
    coordinator = await Coordinator.start(config(0, 2, 0))
    try:
        port = coordinator.address[1]
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"\x00" * 64)
        await writer.drain()
        assert await asyncio.wait_for(reader.read(), 5.0) == b""
        writer.close()
        await writer.wait_closed()
        tables = await asyncio.gather(register(0, 2, port, 8000), register(1, 2, port, 8001))
        assert tables[0] == tables[1]
    finally:
        await coordinator.aclose()


async def test_wrong_token_at_the_coordinator_is_an_authentication_error():
    from netdist.errors import AuthenticationError
    coordinator = await Coordinator.start(config(0, 2, 0))
    try:
        with pytest.raises(AuthenticationError, match="token mismatch"):
            await register(1, 2, coordinator.address[1], 5001, token="wrong-rendezvous-token")
    finally:
        await coordinator.aclose()
