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
