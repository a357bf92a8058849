# example: quantized_all_reduce.py
import asyncio

import numpy as np

from netdist import create_local_tcp_group
from netdist.collectives import Group, QuantizedReducer
from netdist.transport.host_identity import host_key

HOSTS = ["a", "a", "b", "b"]  # 4 ranks in this process, acting as 2 hosts of 2
N = 1_000_000


async def rank_main(transport) -> tuple[str, bytes, int, float]:
    async with Group(transport, timeout=30.0) as group:
        reducer = QuantizedReducer(group, "int8", error_feedback=True)  # int8:minmax:1024
        grads = np.random.default_rng(group.rank).standard_normal(N).astype(np.float32)
        before = transport.traffic()
        await reducer.all_reduce(grads, op="mean", key="grads")        # in place
        window = transport.traffic() - before
        crossed = sum(t.sent_bytes for key, t in window.by_host.items()
                      if key != host_key(HOSTS[group.rank]))
        exact = np.mean([np.random.default_rng(r).standard_normal(N).astype(np.float32)
                         for r in range(4)], axis=0, dtype=np.float64)
        return reducer.path, grads.tobytes(), crossed, float(np.abs(grads - exact).max())


async def main() -> None:
    transports = await create_local_tcp_group(4, host_ids=HOSTS)
    try:
        results = await asyncio.gather(*(rank_main(t) for t in transports))
    finally:
        await asyncio.gather(*(t.aclose() for t in transports))
    crossed = sum(r[2] for r in results)
    print("path:", results[0][0])
    print("every rank the same bits:", len({r[1] for r in results}) == 1)
    print(f"bytes across hosts: {crossed} (float32 two-level: {2 * 4 * N}, "
          f"ratio {crossed / (2 * 4 * N):.3f})")
    print(f"largest error of the mean: {results[0][3]:.4f}")


asyncio.run(main())
