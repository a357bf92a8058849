"""Constants and checks shared by the collective tests (ranks run through ``tests.ranks``)."""

from __future__ import annotations

import numpy as np

SMALL = 1 << 40
"""small_message_bytes forcing the latency-optimal algorithms."""
RING = 0
"""small_message_bytes forcing the ring / chain algorithms."""


def assert_bitwise_equal(arrays: list[np.ndarray]) -> None:
    first = arrays[0]
    for index, other in enumerate(arrays[1:], 1):
        assert other.dtype == first.dtype and other.shape == first.shape
        assert other.tobytes() == first.tobytes(), f"rank {index} differs from rank 0"


def assert_survivors_failed_naming(results: list[tuple[int | None, str]], victim: int) -> None:
    """Every rank but ``victim`` (SIGKILLed) exited 3 after printing an ``ERROR`` line that
    names the all-reduce and the victim, as a lost peer or a timeout (``mp_worker``)."""
    code, out = results[victim]
    assert code == -9, f"victim should have been SIGKILLed:\n{out}"
    for rank, (code, out) in enumerate(results):
        if rank == victim:
            continue
        assert code == 3, f"rank {rank} did not fail as expected ({code}):\n{out}"
        error = next(line for line in out.splitlines() if line.startswith("ERROR"))
        assert "all_reduce" in error and f"rank {victim}" in error, error
        assert "PeerLostError" in error or "NetdistTimeoutError" in error, error
