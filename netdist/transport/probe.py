"""Point-to-point measurements between ranks 0 and 1 of any ``Transport``.

``p2p_benchmark`` is what ``netdist bench p2p`` runs on every rank: ranks 0 and 1 measure
ping-pong round-trip latency and one-way throughput (into a preallocated ``out=``, the
zero-copy path); other ranks only take part in the final barrier. Both ranks must call
it with the same arguments.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from netdist.transport.base import Transport

__all__ = ["p2p_benchmark", "DEFAULT_SIZES"]

DEFAULT_SIZES = (8, 64 * 1024, 1024 * 1024, 64 * 1024 * 1024)
"""Message sizes in bytes: latency-bound, medium, large, bandwidth-bound."""

_PING_TAG = 1_000_001
_DATA_TAG = 1_000_002
_ACK_TAG = 1_000_003


def _percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


async def p2p_benchmark(transport: Transport, sizes: Sequence[int] = DEFAULT_SIZES,
                        iters: int | Sequence[int] = 20, *, warmup: int = 2,
                        timeout: float | None = None) -> list[dict[str, Any]]:
    """Measure ping-pong latency and one-way throughput between ranks 0 and 1.

    For each size (bytes; float32 payloads when divisible by 4, else uint8) rank 0 runs
    ``iters`` ping-pong round trips (rank 1 echoes) and then sends ``iters`` messages one
    way into a preallocated buffer on rank 1, which acknowledges the last one.
    ``iters`` may be one count for every size or one per size; ``warmup`` untimed
    repetitions precede each measurement. Returns, on rank 0, one dict per size::

        {"size": bytes, "iters": n, "rtt_median_us": ..., "rtt_p99_us": ...,
         "oneway_seconds": ..., "oneway_gbps": GB/s (1e9 bytes per second)}

    and ``[]`` on other ranks. Every wait is bounded by ``timeout`` (default: the
    transport's). Raises ``ValueError`` for a world size below 2 or bad arguments.
    """
    if transport.world_size < 2:
        raise ValueError("p2p_benchmark needs at least 2 ranks")
    counts = [iters] * len(sizes) if isinstance(iters, int) else list(iters)
    if len(counts) != len(sizes) or any(c < 1 for c in counts):
        raise ValueError("iters must be a positive int or one positive int per size")
    if any(s < 0 for s in sizes) or warmup < 0:
        raise ValueError("sizes and warmup must be non-negative")
    rank = transport.rank
    results: list[dict[str, Any]] = []
    if rank in (0, 1):
        peer = 1 - rank
        for size, count in zip(sizes, counts):
            dtype = np.float32 if size % 4 == 0 else np.uint8
            message = np.ones(size // np.dtype(dtype).itemsize, dtype)
            landing = np.empty_like(message)
            rtts = await _ping_pong(transport, rank, peer, message, landing, count, warmup,
                                    timeout)
            seconds = await _one_way(transport, rank, peer, message, landing, count, warmup,
                                     timeout)
            if rank == 0:
                results.append({
                    "size": size,
                    "iters": count,
                    "rtt_median_us": statistics.median(rtts) * 1e6,
                    "rtt_p99_us": _percentile(rtts, 99) * 1e6,
                    "oneway_seconds": seconds,
                    "oneway_gbps": size * count / seconds / 1e9 if seconds > 0 else 0.0,
                })
    await transport.barrier(timeout=timeout)
    return results


async def _ping_pong(transport: Transport, rank: int, peer: int, message: np.ndarray,
                     landing: np.ndarray, count: int, warmup: int,
                     timeout: float | None) -> list[float]:
    rtts: list[float] = []
    for i in range(warmup + count):
        if rank == 0:
            started = time.perf_counter()
            await transport.send(peer, message, tag=_PING_TAG, timeout=timeout)
            await transport.recv(peer, tag=_PING_TAG, out=landing, timeout=timeout)
            if i >= warmup:
                rtts.append(time.perf_counter() - started)
        else:
            await transport.recv(peer, tag=_PING_TAG, out=landing, timeout=timeout)
            await transport.send(peer, landing, tag=_PING_TAG, timeout=timeout)
    return rtts


async def _one_way(transport: Transport, rank: int, peer: int, message: np.ndarray,
                   landing: np.ndarray, count: int, warmup: int,
                   timeout: float | None) -> float:
    ack = np.zeros(1, np.uint8)
    for phase, n in (("warmup", warmup), ("timed", count)):
        if n == 0:
            continue
        if rank == 0:
            started = time.perf_counter()
            for _ in range(n):
                await transport.send(peer, message, tag=_DATA_TAG, timeout=timeout)
            await transport.recv(peer, tag=_ACK_TAG, out=ack, timeout=timeout)
            elapsed = time.perf_counter() - started
        else:
            for _ in range(n):
                await transport.recv(peer, tag=_DATA_TAG, out=landing, timeout=timeout)
            await transport.send(peer, ack, tag=_ACK_TAG, timeout=timeout)
            elapsed = 0.0
        if phase == "timed":
            return elapsed
    return 0.0  # not reached: count >= 1
