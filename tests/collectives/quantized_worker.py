"""One rank of the 4-process quantized all-reduce test (``test_quantized.py``):

    python -m tests.collectives.quantized_worker ELEMENTS

Hosts are told apart by ``NETDIST_HOST_ID``. Runs one float32 ``Group.all_reduce`` and
one int8 ``QuantizedReducer.all_reduce`` of the same data and prints ``PATH <path>``,
``HASH <sha256 of the quantized result>``, ``CROSS <quantized> <float32>`` (payload
bytes this rank sent to ranks on the other host during each call, from
``Transport.traffic()``) and ``OK <rank>``.
"""

from __future__ import annotations

import asyncio
import hashlib
import sys

import numpy as np

from netdist.collectives import Group, QuantizedReducer
from netdist.transport.bootstrap import init
from netdist.transport.traffic import Traffic


def _crossing(window: Traffic) -> int:
    keys = window.host_keys
    assert keys is not None
    mine = keys[window.rank]
    return sum(t.sent_bytes for key, t in window.by_host.items() if key != mine)


async def main(elements: int) -> int:
    async with init() as transport:
        async with Group(transport) as group:
            reducer = QuantizedReducer(group, "int8", timeout=60)
            print(f"PATH {reducer.path}", flush=True)
            data = np.random.default_rng(group.rank).standard_normal(elements)
            data = data.astype(np.float32)
            await group.all_reduce(np.ones(1 << 16, np.float32))  # connections, arenas
            await reducer.all_reduce(np.ones(1 << 12, np.float32))
            before = transport.traffic()
            await group.all_reduce(data.copy())
            middle = transport.traffic()
            result = await reducer.all_reduce(data.copy())
            after = transport.traffic()
            print(f"HASH {hashlib.sha256(result.tobytes()).hexdigest()}", flush=True)
            print(f"CROSS {_crossing(after - middle)} {_crossing(middle - before)}",
                  flush=True)
    print(f"OK {transport.rank}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main(int(sys.argv[1]))))
