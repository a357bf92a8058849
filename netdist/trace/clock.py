"""PURE: one rank's clock offset to the job's reference clock, from ping-pong samples.

Trace timestamps from different ranks are compared (which rank arrived last at a
collective, and by how much), so every rank records times on one job-wide clock: its own
``time.monotonic_ns()`` plus the offset to the reference rank's clock (the rank that
hosts the rendezvous). The offset is estimated at rendezvous the way NTP does it: the rank
sends at ``t_send``, the reference answers with its own time ``t_ref``, the answer
arrives at ``t_recv``; assuming the two legs take equally long, ``t_ref`` was read at
``(t_send + t_recv) / 2`` local time. The sample with the shortest round trip wins, and
half its round trip bounds the error (the legs cannot be more unequal than that).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["ClockAlignment", "estimate_alignment", "CLOCK_SAMPLES"]

CLOCK_SAMPLES = 8
"""Round trips a rank makes to the rendezvous to align its clock (the best one counts)."""


@dataclass(frozen=True, slots=True)
class ClockAlignment:
    """How this rank's monotonic clock maps onto the job's reference clock."""

    offset_ns: int = 0
    """Add to ``time.monotonic_ns()`` to get the reference rank's clock."""
    error_ns: int = 0
    """Bound on the offset's error: half the best round trip (0: not measured)."""
    reference_rank: int = 0
    """The rank whose clock is the reference (the rendezvous host)."""
    samples: int = 0
    """Round trips the estimate came from (0: not aligned, offset assumed 0)."""

    def describe(self) -> dict[str, float | int]:
        """The fields trace files and dumps record (microseconds)."""
        return {"offset_us": self.offset_ns / 1000.0, "error_us": self.error_ns / 1000.0,
                "reference_rank": self.reference_rank, "samples": self.samples}


def estimate_alignment(samples: Sequence[tuple[int, int, int]],
                       reference_rank: int = 0) -> ClockAlignment:
    """The offset from ``(t_send, t_ref, t_recv)`` samples (nanoseconds): the one with the
    shortest round trip, its error half that round trip. ``ValueError`` for no samples or
    a sample whose answer arrived before it was sent."""
    if not samples:
        raise ValueError("clock alignment needs at least one sample")
    for t_send, _, t_recv in samples:
        if t_recv < t_send:
            raise ValueError(f"clock sample ({t_send}, _, {t_recv}): received before it "
                             "was sent")
    best = min(samples, key=lambda sample: sample[2] - sample[0])
    t_send, t_ref, t_recv = best
    round_trip = t_recv - t_send
    return ClockAlignment(offset_ns=t_ref - (t_send + t_recv) // 2,
                          error_ns=(round_trip + 1) // 2, reference_rank=reference_rank,
                          samples=len(samples))
