# example: collectives.py
import asyncio

import numpy as np

from netdist import ReduceOp, create_local_tcp_group
from netdist.collectives import Group


async def rank_main(transport) -> str:
    async with Group(transport, timeout=10.0) as g:               # world group: ranks 0, 1, 2
        r = g.rank
        x = np.arange(4.0) + 10 * r
        await g.all_reduce(x, op=ReduceOp.SUM)                     # in place
        shard = await g.reduce_scatter(np.ones(7) * (r + 1))       # 7 elements: chunks of 3, 2, 2
        whole = await g.all_gather(np.full(r + 1, r))              # uneven shards: 1 + 2 + 3 rows
        b = np.full(2, float(r))
        await g.broadcast(b, src=2)
        got = await g.scatter([np.array([i * i]) for i in range(3)] if r == 0 else None, src=0)
        work = await g.all_reduce(np.array([r]), op="max", async_op=True)  # runs on meanwhile
        pair = g.new_group([0, 2])                                 # every rank calls it, same order
        info = await pair.all_gather_object({"rank": r}) if pair.is_member else "not a member"
        peak = await work                                          # the async all_reduce's result
        return f"rank {r}: {x} {shard} {whole} {b} {got} max={peak[0]} pair={info}"


async def main() -> None:
    transports = await create_local_tcp_group(3)   # 3 TcpTransports over 127.0.0.1, one process
    try:
        for line in await asyncio.gather(*(rank_main(t) for t in transports)):
            print(line)
    finally:
        await asyncio.gather(*(t.aclose() for t in transports))


asyncio.run(main())
