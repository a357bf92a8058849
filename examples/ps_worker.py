# example: ps_worker.py
# run: netdist launch -n 3 -- netdist ps-server --num-servers 1 -- python ps_worker.py
import asyncio

import numpy as np

import netdist
from netdist.ps import PSClient, SGDConfig, num_servers_from_env


async def main() -> None:
    async with netdist.init() as transport:          # rank 0 serves; ranks 1 and 2 run this
        async with PSClient(transport, num_servers=num_servers_from_env()) as client:
            w, = await client.init({"w": np.zeros(3)}, optimizer=SGDConfig(lr=0.5),
                                   max_staleness=0)  # 0: synchronous
            target = 1.0 if client.worker_index == 0 else 3.0
            for _ in range(3):                       # gradient of |w - target|^2 / 2
                w, = await client.step([w - target])  # SGD runs on the server
            print(f"worker {client.worker_index}: w = {w}")


asyncio.run(main())
