"""Child process of test_strangers.py: a 2-rank job under a low descriptor limit.

    python strangers_worker.py LIMIT MAX_UNAUTHENTICATED FD_RESERVE CKPT_DIR LOOP

1. lowers RLIMIT_NOFILE, soft and hard, to LIMIT (so the transport cannot raise it);
2. connects two TcpTransports in this process over 127.0.0.1 and prints one JSON line:
   ``{"pid", "job_id", "port"}`` (rank 0's peer listener);
3. waits for a line on stdin (the parent floods rank 0 with strangers meanwhile);
4. with the strangers still connected, saves a checkpoint collectively, loads it back,
   runs an all_reduce, and prints one JSON line: ``{"ok", "step", "equal", "reduced",
   "stats"}`` (rank 0's admission counters) or ``{"ok": false, "error"}``.

Every wait is bounded; the job closes its transports before exiting.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import resource
import sys
from typing import Any

import numpy as np


async def _job(limits: Any, ckpt_dir: str) -> dict[str, Any]:
    from netdist.checkpoint import load, save
    from netdist.collectives import Group
    from netdist.transport.local_tcp import create_local_tcp_group

    # eager: the flood hits connections that are already established (a connection
    # made on first use meets the admission bounds like any other newcomer)
    transports = await create_local_tcp_group(2, admission=limits, timeout=30.0,
                                              connect_timeout=30.0, connect="eager")
    groups = [Group(t) for t in transports]
    try:
        print(json.dumps({"pid": os.getpid(), "job_id": transports[0].config.job_id,
                          "port": transports[0].listen_address[1]}), flush=True)
        loop = asyncio.get_running_loop()
        line = await asyncio.wait_for(loop.run_in_executor(None, sys.stdin.readline), 60)
        if not line:
            return {"ok": False, "error": "parent closed stdin"}
        states = [{"w": np.arange(1000, dtype=np.float32) + 0.5, "step": np.int64(7)}
                  for _ in groups]
        saved = await asyncio.gather(*(save(s, ckpt_dir, g, step=1, timeout=30.0)
                                       for s, g in zip(states, groups)))
        like = [{"w": np.zeros(1000, np.float32), "step": np.int64(0)} for _ in groups]
        await asyncio.gather(*(load(ckpt_dir, g, like=l, timeout=30.0)
                               for l, g in zip(like, groups)))
        equal = all(np.array_equal(l["w"], s["w"]) for l, s in zip(like, states))
        arrays = [np.full(4, rank + 1, np.int64) for rank in range(2)]
        await asyncio.gather(*(g.all_reduce(a, timeout=30.0) for a, g in zip(arrays, groups)))
        return {"ok": True, "step": [str(r.path) for r in saved][0], "equal": equal,
                "reduced": [a.tolist() for a in arrays],
                "stats": dataclasses.asdict(transports[0].admission.stats())}
    finally:
        for g in groups:
            await g.aclose()
        for t in transports:
            await t.aclose()


def main() -> int:
    limit, max_unauth, reserve = (int(x) for x in sys.argv[1:4])
    ckpt_dir, loop_kind = sys.argv[4], sys.argv[5]
    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))
    from netdist.config import AdmissionLimits

    limits = AdmissionLimits(max_unauthenticated=max_unauth, fd_reserve=reserve,
                             handshake_timeout=120.0, refusal_log_interval=3600.0)
    if loop_kind == "uvloop":
        import uvloop

        runner = uvloop.run
    else:
        runner = asyncio.run
    try:
        result = runner(_job(limits, ckpt_dir))
    except Exception as exc:  # report, do not hide: the parent asserts on it
        result = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    print(json.dumps(result), flush=True)
    return 0 if result.get("ok") else 1


if __name__ == "__main__":
    sys.exit(main())
