"""p2p_benchmark: the measurement `netdist bench p2p` runs between ranks 0 and 1."""

from __future__ import annotations

import asyncio

import pytest

from netdist.transport import InProcessTransport, p2p_benchmark


async def test_reports_one_row_per_size_on_rank_0(tcp_group):
    group = await tcp_group(3)
    sizes = [8, 4096, 100_001]
    results = await asyncio.gather(*(p2p_benchmark(t, sizes, [5, 3, 2], warmup=1)
                                     for t in group))
    rows = results[0]
    assert results[1] == [] and results[2] == []
    assert [row["size"] for row in rows] == sizes
    assert [row["iters"] for row in rows] == [5, 3, 2]
    for row in rows:
        assert 0 < row["rtt_median_us"] <= row["rtt_p99_us"]
        assert row["oneway_seconds"] > 0 and row["oneway_gbps"] > 0


async def test_runs_over_the_in_process_transport():
    group = InProcessTransport.create_group(2, timeout=5.0)
    rows, other = await asyncio.gather(*(p2p_benchmark(t, [0, 64], 3) for t in group))
    assert other == [] and [row["size"] for row in rows] == [0, 64]


async def test_rejects_bad_arguments():
    (single,) = InProcessTransport.create_group(1)
    with pytest.raises(ValueError, match="at least 2 ranks"):
        await p2p_benchmark(single, [8], 1)
    a, _ = InProcessTransport.create_group(2)
    with pytest.raises(ValueError, match="iters"):
        await p2p_benchmark(a, [8, 16], [1])
