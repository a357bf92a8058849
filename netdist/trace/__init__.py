"""Seeing what every rank does: the trace, the flight recorder and their analysis.

- ``NETDIST_TRACE=DIR`` (or ``start_trace`` / ``stop_trace`` at run time) writes one Trace
  Event Format file per rank: every collective, every TCP send and receive, subsystem
  spans and connection events, on a clock aligned across ranks at rendezvous.
- The flight recorder is always on: the last ``NETDIST_FLIGHT_RECORDS`` collectives of
  each rank, dumped as JSON when a collective fails on a lost peer or a deadline, on
  ``SIGUSR1`` and on ``dump_flight_record``.
- ``counters(transport)``: bytes, messages, waits and TCP retransmissions per peer, also
  served in Prometheus' text format under ``NETDIST_METRICS_PORT``.
- ``netdist trace merge | summary | why`` read them (``netdist.trace.analysis``).
- ``NETDIST_STRAGGLER_REPORT=SECONDS`` (or tracing from the start): rank 0 logs the rank
  that keeps arriving last, live; ``straggler_report(transport)`` is its latest verdict
  (``netdist.trace.straggler_monitor``).

Names resolve lazily (``netdist._lazy``): importing a PURE module such as
``netdist.trace.analysis`` does not import the recorder, and with it ``socket``.

See docs/tracing.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

_EXPORTS: dict[str, str] = {
    "Counters": "netdist.trace.counters",
    "PeerCounters": "netdist.trace.counters",
    "counters": "netdist.trace.counters",
    "Recorder": "netdist.trace.recorder",
    "TraceSettings": "netdist.trace.settings",
    "dump_flight_record": "netdist.trace.control",
    "recorder_of": "netdist.trace.control",
    "start_trace": "netdist.trace.control",
    "stop_trace": "netdist.trace.control",
    "Straggler": "netdist.trace.stragglers",
    "StragglerWindow": "netdist.trace.stragglers",
    "straggler_report": "netdist.trace.straggler_monitor",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from netdist.trace.control import dump_flight_record, recorder_of, start_trace, stop_trace
    from netdist.trace.counters import Counters, PeerCounters, counters
    from netdist.trace.recorder import Recorder
    from netdist.trace.settings import TraceSettings
    from netdist.trace.straggler_monitor import straggler_report
    from netdist.trace.stragglers import Straggler, StragglerWindow
else:
    from netdist._lazy import attach as _attach

    __getattr__, __dir__ = _attach(__name__, _EXPORTS)
