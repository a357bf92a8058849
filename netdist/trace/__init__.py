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

See docs/tracing.md.
"""

from netdist.trace.control import dump_flight_record, recorder_of, start_trace, stop_trace
from netdist.trace.counters import Counters, PeerCounters, counters
from netdist.trace.recorder import Recorder
from netdist.trace.settings import TraceSettings

__all__ = ["Counters", "PeerCounters", "Recorder", "TraceSettings", "counters",
           "dump_flight_record", "recorder_of", "start_trace", "stop_trace"]
