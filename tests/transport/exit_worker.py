"""One rank of the exit-after-send job (``test_exit_delivery.py``), run in a namespace.

    python -m tests.transport.exit_worker MODE RANK COORDINATOR_HOST PORT NBYTES OWN_HOST

Rank 0 hands ``NBYTES`` of a fixed pattern to rank 1 with MODE (``send``: one
``Transport.send``; ``broadcast``: ``Group.broadcast``; ``torch``: torch's
``dist.broadcast`` then ``destroy_process_group``) and leaves at once: the process
exits right after the call returned, as a script ending there would. Rank 1 prints
``RECEIVED <nbytes> <sha256>`` and exits 0; any failure ends with a non-zero status and
the error on stderr.
"""

from __future__ import annotations

import asyncio
import hashlib
import sys

import numpy as np


def pattern(nbytes: int) -> np.ndarray:
    """The bytes rank 0 sends: reproducible, not compressible, not all zero."""
    return np.random.default_rng(20261127).integers(0, 256, nbytes, dtype=np.uint8)


def report(array: np.ndarray) -> None:
    data = np.ascontiguousarray(array).view(np.uint8)
    print(f"RECEIVED {data.nbytes} {hashlib.sha256(data.tobytes()).hexdigest()}", flush=True)


async def with_netdist(mode: str, rank: int, host: str, port: int, nbytes: int,
                       own: str) -> None:
    import netdist
    from netdist.collectives import Group

    config = netdist.DistributedConfig.from_env(
        {}, rank=rank, world_size=2, coordinator=(host, port),
        token="exit-test-token-0123456789abcdef", job_id="exit-test", advertise_addr=own,
        timeout=120.0)
    async with netdist.init(config) as transport:
        if mode == "send":
            if rank == 0:
                await transport.send(1, pattern(nbytes))
            else:
                report(await transport.recv(0, out=np.empty(nbytes, np.uint8)))
        else:
            group = Group(transport)
            data = pattern(nbytes) if rank == 0 else np.zeros(nbytes, np.uint8)
            await group.broadcast(data, src=0)
            if rank == 1:
                report(data)


def with_torch(rank: int, host: str, port: int, nbytes: int) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    import netdist.torch  # noqa: F401  registers the backend

    dist.init_process_group("netdist", init_method=f"tcp://{host}:{port}", rank=rank,
                            world_size=2, timeout=datetime.timedelta(seconds=120))
    data = (torch.from_numpy(pattern(nbytes)) if rank == 0
            else torch.zeros(nbytes, dtype=torch.uint8))
    dist.broadcast(data, src=0)
    if rank == 1:
        report(data.numpy())
    dist.destroy_process_group()


def main() -> None:
    mode, rank, host, port, nbytes, own = (sys.argv[1], int(sys.argv[2]), sys.argv[3],
                                           int(sys.argv[4]), int(sys.argv[5]), sys.argv[6])
    if mode == "torch":
        with_torch(rank, host, port, nbytes)
    else:
        asyncio.run(with_netdist(mode, rank, host, port, nbytes, own))


if __name__ == "__main__":
    main()
