"""Bounded memory: a resharding load holds the rank's share and little else.

A 2 GiB checkpoint saved by 2 ranks is loaded by rank 1 of 4 in a fresh process; its peak
RSS (``VmHWM``, or ``ru_maxrss`` where /proc is missing) may grow by at most 1.2x the 512 MiB share over the interpreter
baseline measured after imports. Reads go with ``pread`` straight into the destination
arrays (no mmap: mapped file pages would count as resident).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from netdist.checkpoint import flat_shard_metadata, save_distributed, shard_state_dict
from netdist.checkpoint.metadata import ShardMetadata, TensorShardSpec

REPO = Path(__file__).resolve().parents[2]
TENSORS = 16
ROWS, COLS = 4096, 8192  # 16 x 128 MiB float32 = 2 GiB in all, 1 GiB per saving rank

LOADER = r"""
import json, resource, sys
import numpy as np
from netdist.checkpoint import load_distributed

def peak_rss():
    # VmHWM is this process image's own peak; ru_maxrss also counts the peak of the
    # parent that forked us (Linux carries it across execve), so prefer VmHWM.
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

baseline = peak_rss()
got = load_distributed(sys.argv[1], 1, 4)
peak = peak_rss()
share = sum(a.nbytes for a in got.values())
checks = {name: [float(a[0, 0]), float(a[-1, -1]), list(a.shape)] for name, a in got.items()}
print(json.dumps({"baseline": baseline, "peak": peak, "share": share, "checks": checks}))
"""


def _value(tensor: int, row: int) -> float:
    return float(tensor * 100_000 + row)


@pytest.mark.slow
def test_resharding_load_peak_rss_is_bounded(tmp_path: Path) -> None:
    root = tmp_path / "big"
    specs = {f"t{i:02d}": TensorShardSpec.even((ROWS, COLS), 2, 0, "float32")
             for i in range(TENSORS)}
    meta = ShardMetadata(2, specs)
    try:
        for rank in range(2):
            lo = rank * ROWS // 2
            local = {}
            for i in range(TENSORS):
                rows = np.arange(lo, lo + ROWS // 2, dtype=np.float32) + i * 100_000
                local[f"t{i:02d}"] = np.repeat(rows[:, None], COLS, axis=1)
            save_distributed(local, root, rank, 2, meta)
            del local
        env = dict(os.environ,
                   PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
        proc = subprocess.run([sys.executable, "-c", LOADER, str(root)], capture_output=True,
                              text=True, timeout=300, env=env)
        assert proc.returncode == 0, proc.stderr
        report = json.loads(proc.stdout)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    share = report["share"]
    assert share == 2**31 // 4
    growth = report["peak"] - report["baseline"]
    assert growth <= 1.2 * share, (
        f"peak RSS grew by {growth / 2**20:.0f} MiB for a {share / 2**20:.0f} MiB share")
    # rank 1 of 4 holds rows 1024..2047 of every tensor
    for i in range(TENSORS):
        first, last, shape = report["checks"][f"t{i:02d}"]
        assert shape == [ROWS // 4, COLS]
        assert first == _value(i, ROWS // 4) and last == _value(i, ROWS // 2 - 1)


def test_flat_metadata_of_the_memory_layout() -> None:
    meta = flat_shard_metadata({"t": np.zeros((ROWS, 2))}, 4)
    local = shard_state_dict({"t": np.zeros((ROWS, 2))}, meta, 1)
    assert local["t"].shape == (ROWS // 4, 2)
