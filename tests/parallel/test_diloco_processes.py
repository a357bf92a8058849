"""DiLoCo on a torch model in real processes over TCP, through the blocking API.

Two ``tests.parallel._diloco_torch`` ranks (``netdist.connect()``, AdamW inner steps,
Streaming DiLoCo with 2 fragments whose exchanges run on the progress thread behind the
next inner step) must end with exactly the parameters of the same training written out
in one process (``reference``): the mean of two outer gradients is ``(a + b) / 2`` in
either order, so the comparison is bitwise.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests import ranks

torch = pytest.importorskip("torch")

from tests.parallel._diloco_torch import STEPS, reference  # noqa: E402


def test_torch_diloco_over_tcp_equals_the_single_process_reference(tmp_path: Path) -> None:
    procs = ranks.start_ranks(2, "tests.parallel._diloco_torch", [str(tmp_path)],
                              job_prefix="diloco")
    done = ranks.finish_ranks(procs, timeout=120)
    for d in done:
        assert d.returncode == 0 and "DONE" in d.stdout, d.stdout + d.stderr
    want_global, want_local = reference(2)
    n = len(want_global)
    for rank in range(2):
        saved = np.load(tmp_path / f"rank_{rank}.npz")
        arrays = [saved[f"arr_{i}"] for i in range(2 * n)]
        for got, want in zip(arrays[:n], want_global):
            np.testing.assert_array_equal(got, want)
        for got, want in zip(arrays[n:], want_local[rank]):
            np.testing.assert_array_equal(got, want)
        # fragment 0 launches after steps 3, 9, 15, 21; fragment 1 after 6, 12, 18
        assert sorted(saved["launched"].tolist()) == [3, 6, 9, 12, 15, 18, 21]
    assert STEPS == 23
