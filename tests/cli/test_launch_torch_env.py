"""torch.distributed's rendezvous variables next to netdist's, without collisions.

Under ``netdist launch`` torch code finds ``MASTER_ADDR`` / ``MASTER_PORT`` (a port that is
not netdist's coordinator); under torchrun (``TORCHELASTIC_RUN_ID`` set) netdist's
coordinator takes ``MASTER_PORT + 1``, since torchrun's store listens on ``MASTER_PORT``.
Each test holds a real listening socket where torch's store would be and runs a real
netdist all-reduce beside it.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cli.test_launch import BOUND, REPO_ROOT, by_rank, run_launch

pytestmark = pytest.mark.slow

ALL_REDUCE = r'''
import asyncio
import numpy as np
import netdist
from netdist.collectives import Group

async def reduce_once():
    async with netdist.init() as transport:
        group = Group(transport)
        return float((await group.all_reduce(np.ones(2)))[0])
'''

STORE_AND_REDUCE = ALL_REDUCE + r'''
store = None
if RANK == 0:  # where torch's TCPStore would listen: it must stay free for it
    store = socket.create_server((os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])))
total = asyncio.run(reduce_once())
print(json.dumps({k: os.environ.get(k) for k in ("MASTER_ADDR", "MASTER_PORT",
                                                   "NETDIST_COORDINATOR")} | {"sum": total}))
'''


def test_launch_gives_torch_its_own_master_port(tmp_path: Path) -> None:
    result, _ = run_launch(tmp_path, ["-n", "2"], "import socket\n" + STORE_AND_REDUCE)
    assert result.returncode == 0, result.stderr
    envs = [json.loads(lines[-1]) for lines in by_rank(result.stdout).values()]
    assert len(envs) == 2 and envs[0] == envs[1]
    env = envs[0]
    host, port = env["NETDIST_COORDINATOR"].rsplit(":", 1)
    assert env["MASTER_ADDR"] == host == "127.0.0.1"
    assert env["MASTER_PORT"] != port and 1 <= int(env["MASTER_PORT"]) <= 65535
    assert env["sum"] == 2.0


def test_launch_keeps_a_master_port_the_user_set(tmp_path: Path) -> None:
    body = "print(os.environ['MASTER_ADDR'], os.environ['MASTER_PORT'])\n"
    result, _ = run_launch(tmp_path, ["-n", "2"], body,
                           env={"MASTER_ADDR": "10.1.2.3", "MASTER_PORT": "23456"})
    assert result.returncode == 0, result.stderr
    assert [lines for lines in by_rank(result.stdout).values()] == [["10.1.2.3 23456"]] * 2


def _store_port_with_a_free_successor() -> socket.socket:
    """A listening socket on port p (torchrun's store) such that p + 1 is free now."""
    for _ in range(50):
        store = socket.create_server(("127.0.0.1", 0))
        port = store.getsockname()[1]
        try:
            socket.create_server(("127.0.0.1", port + 1)).close()
        except OSError:
            store.close()
            continue
        return store
    raise RuntimeError("no port pair found")


def test_under_torchrun_netdist_never_takes_the_stores_port() -> None:
    store = _store_port_with_a_free_successor()
    with store:
        port = store.getsockname()[1]
        env = {k: v for k, v in os.environ.items() if not k.startswith("NETDIST_")}
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2",
                   TORCHELASTIC_RUN_ID="simulated", NETDIST_TOKEN=secrets.token_hex(16),
                   PYTHONPATH=str(REPO_ROOT))
        code = ALL_REDUCE + "print(asyncio.run(reduce_once()))\n"
        procs = [subprocess.Popen([sys.executable, "-c", code], env=dict(env, RANK=str(r)),
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for r in range(2)]
        outputs = [proc.communicate(timeout=BOUND) for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0], outputs
    assert [out.strip() for out, _ in outputs] == ["2.0", "2.0"]
