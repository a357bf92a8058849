"""Bruck's all-gather: ``ceil(log2 n)`` rounds for any ``n``, each forwarding every block
gathered so far, for small shards and for byte strings of any length (the object
collectives, the shape exchange of ``all_gather``).
"""

from __future__ import annotations

import numpy as np

from netdist.collectives.channel import Channel, CollectiveMismatchError
from netdist.collectives.plan import bruck_allgather_plan
from netdist.transport.mailbox import byte_view

__all__ = ["bruck_all_gather", "bruck_all_gather_blobs"]


async def bruck_all_gather(chan: Channel, out_flat: np.ndarray,
                           chunks: tuple[tuple[int, int], ...]) -> None:
    """Bruck all-gather into ``out_flat``; this rank's chunk must already be in place.

    Each round packs the blocks it forwards into one message (small data, so the copy is
    cheap) and unpacks the received blocks into their final positions.
    """
    rank = chan.rank
    for index, rnd in enumerate(chan.plan(bruck_allgather_plan, rank, chan.world_size)):
        if len(rnd.send_blocks) == 1:
            a, b = chunks[rnd.send_blocks[0]]
            payload = out_flat[a:b]
        else:
            payload = np.concatenate([out_flat[chunks[c][0]:chunks[c][1]]
                                      for c in rnd.send_blocks])
        expected = sum(chunks[c][1] - chunks[c][0] for c in rnd.recv_blocks)
        incoming = (await chan.exchange(rnd.send_to, payload, rnd.recv_from)).reshape(-1)
        if incoming.size != expected or incoming.dtype != out_flat.dtype:
            raise CollectiveMismatchError(
                f"{chan.op}: group rank {rnd.recv_from} sent {incoming.dtype.name}"
                f"[{incoming.size}] in round {index} but {out_flat.dtype.name}[{expected}] "
                "was expected from the agreed shard sizes")
        offset = 0
        for c in rnd.recv_blocks:
            a, b = chunks[c]
            out_flat[a:b] = incoming[offset:offset + b - a]
            offset += b - a


async def bruck_all_gather_blobs(chan: Channel, blob: bytes) -> list[bytes]:
    """All-gather one byte string per rank (any lengths) with Bruck's algorithm.

    Messages are a 8-byte-per-block length table followed by the blocks, so no separate
    size exchange is needed.
    """
    n = chan.world_size
    blobs: list[bytes | None] = [None] * n
    blobs[chan.rank] = blob
    for index, rnd in enumerate(chan.plan(bruck_allgather_plan, chan.rank, n)):
        parts = [blobs[c] for c in rnd.send_blocks]
        lengths = np.array([len(p) for p in parts], dtype="<u8")  # type: ignore[arg-type]
        message = lengths.tobytes() + b"".join(parts)  # type: ignore[arg-type]
        incoming = bytes(byte_view(await chan.exchange(
            rnd.send_to, np.frombuffer(message, np.uint8), rnd.recv_from)))
        count = len(rnd.recv_blocks)
        table = np.frombuffer(incoming[:8 * count], dtype="<u8")
        if table.size != count or 8 * count + int(table.sum()) != len(incoming):
            raise CollectiveMismatchError(
                f"{chan.op}: malformed all-gather message from group rank {rnd.recv_from} "
                f"in round {index}")
        offset = 8 * count
        for c, length in zip(rnd.recv_blocks, table.tolist(), strict=True):
            blobs[c] = incoming[offset:offset + length]
            offset += length
    return blobs  # type: ignore[return-value]
