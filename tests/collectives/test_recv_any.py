"""``Group.recv_any``: the first sender's group rank and message, nothing lost to a race,
a timeout naming the group; in-process and over real TCP."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

from netdist.collectives import Group, Work
from netdist.errors import NetdistTimeoutError
from tests.ranks import run_ranks

TRANSPORTS = {"inprocess": False, "tcp": True}


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_recv_any_returns_the_first_senders_group_rank_and_message(
        transport: str) -> None:
    async def body(g: Group) -> Any:
        # group rank 0 is transport rank 2 and group rank 2 is transport rank 0
        sub = g.new_group([2, 1, 0])
        if sub.rank == 0:
            await sub.send(np.array([10.0, 11.0]), 2, tag=7, timeout=5)
            return None
        if sub.rank == 1:  # sends only once the first message was taken
            await sub.recv(2, tag=1, timeout=5)
            await sub.send(np.array([20.0, 21.0]), 2, tag=7, timeout=5)
            return None
        first = await sub.recv_any(None, 7, timeout=5)
        await sub.send(b"go", 1, tag=1, timeout=5)
        out = np.zeros(2)
        work = await sub.recv_any([1, 0], 7, out=out, timeout=5, async_op=True)
        assert isinstance(work, Work)
        second = await work
        assert second[1] is out
        return first, second

    results = await run_ranks(3, body, tcp=TRANSPORTS[transport])
    (src1, msg1), (src2, msg2) = results[0]
    assert results[1:] == [None, None]
    assert src1 == 0 and msg1.tolist() == [10.0, 11.0]
    assert src2 == 1 and msg2.tolist() == [20.0, 21.0]


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_racing_senders_lose_no_message(transport: str) -> None:
    per_sender, size = 8, 32_768  # 256 KiB frames: polls expire while frames land

    async def body(g: Group) -> Any:
        if g.rank != 0:
            for index in range(per_sender):
                message = np.full(size, float(index))
                message[0] = g.rank
                await g.send(message, 0, tag=3, timeout=20)
                await asyncio.sleep(0)
            return None
        taken: list[tuple[int, int, int]] = []
        for _ in range((g.world_size - 1) * per_sender):
            src, message = await g.recv_any(None, 3, timeout=20)
            taken.append((src, int(message[0]), int(message[-1])))
        with pytest.raises(NetdistTimeoutError):
            await g.recv_any(None, 3, timeout=0.2)  # every message was taken already
        return taken

    results = await run_ranks(4, body, tcp=TRANSPORTS[transport])
    taken = results[0]
    assert all(src == sender for src, sender, _ in taken)
    for sender in (1, 2, 3):  # each message exactly once, in the order it was sent
        assert [i for src, _, i in taken if src == sender] == list(range(per_sender))


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_recv_any_times_out_naming_the_group_then_takes_a_late_message(
        transport: str) -> None:
    async def body(g: Group) -> Any:
        if g.rank == 2:
            await g.recv(0, tag=1, timeout=5)
            await g.send(np.array([5], np.int32), 0, tag=9, timeout=5)
            return None
        if g.rank == 1:
            return None
        with pytest.raises(NetdistTimeoutError) as info:
            await g.recv_any(None, 9, timeout=0.3)
        await g.send(b"", 2, tag=1, timeout=5)
        late = await g.recv_any([2, 1], 9, timeout=5)
        return str(info.value), g.group_id, late

    results = await run_ranks(3, body, tcp=TRANSPORTS[transport])
    message, gid, (src, late) = results[0]
    assert message.startswith(f"recv_any on group {gid:#x} (group rank 0 of 3"), message
    assert "no message on tag 9 from group ranks 1, 2 within 0.30s" in message, message
    assert src == 2 and late.dtype == np.int32 and late.tolist() == [5]


async def test_recv_any_checks_its_arguments() -> None:
    async def body(g: Group) -> None:
        for sources in ([g.rank], [], [1, 1] if g.rank != 1 else [0, 0]):
            with pytest.raises(ValueError, match="recv_any sources must be other members"):
                await g.recv_any(sources)
        with pytest.raises(ValueError, match="outside"):
            await g.recv_any([3])
        with pytest.raises(ValueError, match="tag"):
            await g.recv_any(None, 2**20)
        with pytest.raises(ValueError, match="C-contiguous"):
            await g.recv_any(None, out=np.zeros((4, 4))[:, 0])

    await run_ranks(3, body)


async def test_recv_any_into_a_tensor_and_a_size_mismatch() -> None:
    torch = pytest.importorskip("torch")
    from netdist.errors import CollectiveMismatchError

    async def body(g: Group) -> Any:
        if g.rank == 1:
            await g.send(np.arange(6, dtype=np.float32), 0, tag=4, timeout=5)
            await g.send(np.arange(3, dtype=np.float32), 0, tag=4, timeout=5)
            return None
        out = torch.zeros(3, 2).t()  # non-contiguous: filled through a copy
        src, got = await g.recv_any(None, 4, out=out, timeout=5)
        with pytest.raises(CollectiveMismatchError, match="group rank 1 sent 12 bytes"):
            await g.recv_any(None, 4, out=np.zeros(6, np.float32), timeout=5)
        return src, got is out, out.reshape(-1).tolist()

    results = await run_ranks(2, body)
    assert results[0] == (1, True, [0.0, 1.0, 2.0, 3.0, 4.0, 5.0])
