"""What the environment asks of tracing and the flight recorder (``TraceSettings``).

- ``NETDIST_TRACE=DIR``: trace every operation from the start, one file per rank in DIR.
- ``NETDIST_FLIGHT_RECORDS=N``: how many recent collectives the flight recorder keeps per
  rank (default 2000; 0 turns it off).
- ``NETDIST_FLIGHT_DIR=DIR``: where dumps go (default: the trace directory when tracing,
  else ``<tmp>/netdist-flight/<job id>``).
- ``NETDIST_TRACE_BUFFER=N``: trace records held in memory before they are spilled to a
  side file (default 262144, about 20 MiB).
- ``NETDIST_STRAGGLER_REPORT=SECONDS``: run the live straggler report
  (``netdist.trace.straggler_monitor``) and log the rank that keeps arriving last at most
  this often. Off unless set above 0, or tracing from the start (``NETDIST_TRACE``), where
  it logs at most every 60 s; 0 turns it off even then. Off by default because it sends
  one small message per rank per second to rank 0 (in lazy-connect mode, over a
  connection to rank 0 the job might not otherwise open), which changes the byte counts
  a job measures.
"""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from netdist.config import NumberSetting

__all__ = ["TraceSettings", "TRACE_VARIABLES", "DEFAULT_FLIGHT_RECORDS", "DEFAULT_TRACE_BUFFER",
           "DEFAULT_STRAGGLER_REPORT_SECONDS"]

DEFAULT_FLIGHT_RECORDS = 2000
"""Collectives the flight recorder keeps per rank, as PyTorch's Flight Recorder does."""
DEFAULT_TRACE_BUFFER = 262_144
"""Trace records (80 bytes each) kept in memory before a spill to the side file."""
DEFAULT_STRAGGLER_REPORT_SECONDS = 60.0
"""Least time between two live straggler log lines when tracing turned the report on."""

TRACE_VARIABLES: frozenset[str] = frozenset({
    "NETDIST_TRACE", "NETDIST_FLIGHT_RECORDS", "NETDIST_FLIGHT_DIR", "NETDIST_TRACE_BUFFER",
    "NETDIST_STRAGGLER_REPORT"})
"""Every variable ``TraceSettings.from_env`` reads (the launcher checks them up front)."""

_FLIGHT_RECORDS = NumberSetting("flight_records", "NETDIST_FLIGHT_RECORDS", "", 0,
                                low_inclusive=True, high=10_000_000, integer=True)
_TRACE_BUFFER = NumberSetting("trace_buffer", "NETDIST_TRACE_BUFFER", "", 1024,
                              low_inclusive=True, high=1 << 30, integer=True)
_STRAGGLER_REPORT = NumberSetting("straggler_report", "NETDIST_STRAGGLER_REPORT", "seconds",
                                  0, low_inclusive=True)


@dataclass(frozen=True)
class TraceSettings:
    """Tracing and flight-recorder settings of one process."""

    trace_dir: Path | None = None
    """Trace from the start into this directory (``NETDIST_TRACE``); ``None``: not
    tracing until ``start_trace``."""
    flight_records: int = DEFAULT_FLIGHT_RECORDS
    flight_dir: Path | None = None
    """Where flight-recorder dumps go; ``None``: ``dump_dir()`` decides."""
    trace_buffer: int = DEFAULT_TRACE_BUFFER
    straggler_report_seconds: float | None = None
    """``NETDIST_STRAGGLER_REPORT``: ``None`` when not set (see ``straggler_interval``)."""

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> TraceSettings:
        """The settings the ``NETDIST_*`` variables above ask for; ``ConfigError`` naming
        the variable for a value that is not one."""
        env = os.environ if env is None else env
        trace = (env.get("NETDIST_TRACE") or "").strip()
        flight_dir = (env.get("NETDIST_FLIGHT_DIR") or "").strip()
        return cls(
            trace_dir=Path(trace) if trace else None,
            flight_records=int(_parse(env, _FLIGHT_RECORDS, DEFAULT_FLIGHT_RECORDS)),
            flight_dir=Path(flight_dir) if flight_dir else None,
            trace_buffer=int(_parse(env, _TRACE_BUFFER, DEFAULT_TRACE_BUFFER)),
            straggler_report_seconds=_parse_optional(env, _STRAGGLER_REPORT))

    @property
    def straggler_interval(self) -> float:
        """Least seconds between two live straggler log lines; 0: the live report is off.
        ``NETDIST_STRAGGLER_REPORT`` when set, else ``DEFAULT_STRAGGLER_REPORT_SECONDS``
        when tracing from the start, else off."""
        if self.straggler_report_seconds is not None:
            return self.straggler_report_seconds
        return DEFAULT_STRAGGLER_REPORT_SECONDS if self.trace_dir is not None else 0.0

    def dump_dir(self, job_id: str) -> Path:
        """Where this rank's flight-recorder dumps go: ``flight_dir``, else the trace
        directory, else ``<tmp>/netdist-flight/<job id>`` (the id made a safe file name)."""
        if self.flight_dir is not None:
            return self.flight_dir
        if self.trace_dir is not None:
            return self.trace_dir
        safe = re.sub(r"[^A-Za-z0-9._-]+", "_", job_id).strip("._") or "job"
        return Path(tempfile.gettempdir()) / "netdist-flight" / safe


def _parse_optional(env: Mapping[str, str], setting: NumberSetting) -> float | None:
    text = (env.get(setting.variable or "") or "").strip()
    return None if not text else setting.parse(text)


def _parse(env: Mapping[str, str], setting: NumberSetting, default: float) -> float:
    text = (env.get(setting.variable or "") or "").strip()
    return default if not text else setting.parse(text)
