"""PURE: what ``scontrol show job --oneliner`` and ``sinfo`` say, as plain data.

The test cluster (``tests.scheduler.slurm_cluster``) polls these to wait for the real
state of nodes and jobs; parsing lives here so it can be tested on captured output.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["SlurmJob", "parse_job", "parse_node_states", "FINISHED_STATES"]

FINISHED_STATES = frozenset({
    "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "BOOT_FAIL",
    "DEADLINE", "OUT_OF_MEMORY",
})
"""Job states from which a job never runs again (unless requeued); ``COMPLETING`` is not
one: its tasks or epilog are still being cleaned up."""


@dataclass(frozen=True, slots=True)
class SlurmJob:
    """One job as ``scontrol show job`` reports it."""

    job_id: int
    name: str
    state: str
    """``PENDING``, ``RUNNING``, ``COMPLETING``, ``COMPLETED``, ``FAILED``, ..."""
    reason: str
    """Why it is pending or how it ended (``BeginTime``, ``NonZeroExitCode``, ``None``)."""
    exit_code: int
    """The batch script's (or srun's) exit status."""
    exit_signal: int
    """The signal that ended it, 0 if none."""
    restarts: int
    """How often it was requeued: ``SLURM_RESTART_COUNT`` of its current run."""
    nodes: str
    """Its node list (``n[1-2]``), ``(null)`` while pending."""

    @property
    def finished(self) -> bool:
        return self.state in FINISHED_STATES


def _field(line: str, key: str) -> str:
    match = re.search(rf"(?:^|\s){key}=(\S*)", line)
    if match is None:
        raise ValueError(f"scontrol output has no {key}=: {line[:200]!r}")
    return match.group(1)


def parse_job(line: str) -> SlurmJob:
    """A job from one line of ``scontrol show job --oneliner``."""
    code, _, signal = _field(line, "ExitCode").partition(":")
    return SlurmJob(job_id=int(_field(line, "JobId")), name=_field(line, "JobName"),
                    state=_field(line, "JobState"), reason=_field(line, "Reason"),
                    exit_code=int(code), exit_signal=int(signal or 0),
                    restarts=int(_field(line, "Restarts")), nodes=_field(line, "NodeList"))


def parse_node_states(text: str) -> dict[str, str]:
    """Node name -> state from ``sinfo --noheader --Node --format='%N %T'``."""
    states: dict[str, str] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2:
            states[parts[0]] = parts[1]
        elif parts:
            raise ValueError(f"unexpected sinfo line {line!r} (expected 'NODE STATE')")
    return states
