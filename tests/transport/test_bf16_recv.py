"""``Transport.recv`` without ``out=`` on bfloat16: what comes back, with and without
``ml_dtypes`` (the behaviour ``Transport.recv``'s docstring states).

With ``ml_dtypes`` (this environment): a real ``ml_dtypes.bfloat16`` array, on every
transport. Without it (a child process that blocks the import): the raw bits as
``BFLOAT16_RAW``, which NumPy refuses to compute with, while ``Group.recv`` turns the same
message into a ``TypeError`` naming the dtype and the extra to install.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from netdist.types import BFLOAT16

REPO = Path(__file__).resolve().parents[2]

BITS = [0x3F80, 0x4000, 0xC040, 0x7F80, 0x0001]
"""1.0, 2.0, -3.0, +inf and the smallest subnormal, as bfloat16 bit patterns."""


async def test_bf16_arrives_as_a_real_bf16_array_with_ml_dtypes(make_group):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    a, b = await make_group(2)
    sent = np.array(BITS, np.uint16).view(BFLOAT16).reshape(5, 1)
    await a.send(1, sent, tag=2)
    got = await b.recv(0, tag=2)
    assert got.dtype == np.dtype(ml_dtypes.bfloat16) and got.shape == (5, 1)
    assert got.view(np.uint16).ravel().tolist() == BITS
    assert got.astype(np.float32)[:4, 0].tolist() == [1.0, 2.0, -3.0, float("inf")]


_WITHOUT_ML_DTYPES = """
import sys
sys.modules["ml_dtypes"] = None  # as if it were not installed
import asyncio, json
import numpy as np
from netdist.collectives import Group
from netdist.transport import InProcessTransport, local_tcp_group
from netdist.types import BFLOAT16, BFLOAT16_RAW

BITS = %r

async def one(a, b):
    sent = np.array(BITS, np.uint16).view(BFLOAT16)
    await a.send(1, sent, tag=2)
    got = await b.recv(0, tag=2)
    try:
        got + got
        arithmetic = "allowed"
    except TypeError:
        arithmetic = "refused"
    ga, gb = Group(a), Group(b)
    await ga.send(sent, 1, tag=3)
    try:
        await gb.recv(0, tag=3)
        group = "no error"
    except TypeError as exc:
        group = str(exc)
    await ga.aclose()
    await gb.aclose()
    return {"raw": got.dtype == BFLOAT16_RAW, "bits": got.view(np.uint16).tolist(),
            "arithmetic": arithmetic, "group": group}

async def main():
    results = {"torch_imported": "torch" in sys.modules,
               "inprocess": await one(*InProcessTransport.create_group(2))}
    async with local_tcp_group(2) as (a, b):
        results["tcp"] = await one(a, b)
    print(json.dumps(results))

asyncio.run(main())
""" % (BITS,)


def test_bf16_arrives_as_raw_bits_without_ml_dtypes_and_group_recv_explains():
    env = dict(os.environ, PYTHONPATH=str(REPO))
    done = subprocess.run([sys.executable, "-c", _WITHOUT_ML_DTYPES], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    results = json.loads(done.stdout)
    assert results.pop("torch_imported") is False  # Group.recv's error needs torch absent
    hint = ("recv: received bfloat16 data [5], which NumPy cannot represent without "
            "ml_dtypes: pip install 'netdist[bf16]' (or receive into a torch.bfloat16 "
            "tensor with out=)")
    for kind in ("inprocess", "tcp"):
        assert results[kind] == {"raw": True, "bits": BITS, "arithmetic": "refused",
                                 "group": hint}, kind
