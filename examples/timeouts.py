# example: timeouts.py
import asyncio

import numpy as np

from netdist import InProcessTransport
from netdist.collectives import Group
from netdist.errors import NetdistTimeoutError


async def main() -> None:
    transports = InProcessTransport.create_group(3)
    groups = [Group(t, timeout=0.5) for t in transports]        # every collective: 0.5 s at most
    outcome = await asyncio.gather(groups[0].all_reduce(np.ones(4)),     # rank 2 never calls
                                   groups[1].all_reduce(np.ones(4)), return_exceptions=True)
    print([type(e).__name__ for e in outcome], issubclass(NetdistTimeoutError, TimeoutError))


asyncio.run(main())
