"""PURE: one rank's ``Counters`` as Prometheus text, and the settings of its endpoint.

``format_prometheus(counters)`` writes the text exposition format, version 0.0.4 (what
every Prometheus server and agent scrapes): per metric a ``# HELP`` and a ``# TYPE`` line,
then its samples, every line ending in a line feed. Counters end in ``_total``; per-peer
metrics carry the labels ``rank`` and ``peer`` (transport ranks), per-rank ones ``rank``::

    # HELP netdist_sent_bytes_total Payload bytes of data messages sent to the peer.
    # TYPE netdist_sent_bytes_total counter
    netdist_sent_bytes_total{rank="0",peer="1"} 4096

``MetricsSettings`` reads the endpoint's variables (``netdist.trace.metrics_server``
serves the text over HTTP):

- ``NETDIST_METRICS_PORT=N``: serve ``GET /metrics``; off when unset. ``0`` binds any
  free port (the address is logged). ``N > 0`` is the port of the lowest rank of each
  host; the next rank on that host takes ``N + 1``, and so on, so several ranks of one
  host never collide.
- ``NETDIST_METRICS_HOST=HOST``: the address to bind, default ``127.0.0.1``. The endpoint
  has no authentication: only this setting exposes it beyond the host.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from netdist.config import NumberSetting
from netdist.trace.counters import Counters, PeerCounters

__all__ = ["format_prometheus", "CONTENT_TYPE", "MetricsSettings", "DEFAULT_METRICS_HOST",
           "METRICS_PORT_ENV", "METRICS_HOST_ENV"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
"""The HTTP ``Content-Type`` of ``format_prometheus``'s text."""

METRICS_PORT_ENV = "NETDIST_METRICS_PORT"
METRICS_HOST_ENV = "NETDIST_METRICS_HOST"
DEFAULT_METRICS_HOST = "127.0.0.1"
"""Loopback: a scraper on another host needs ``NETDIST_METRICS_HOST`` set explicitly."""

_PORT = NumberSetting("metrics_port", METRICS_PORT_ENV, "", 0, low_inclusive=True,
                      high=65535, integer=True)

_PeerValue = Callable[[PeerCounters], "int | float | bool | None"]

_PEER_METRICS: tuple[tuple[str, str, str, _PeerValue], ...] = (
    ("netdist_sent_bytes_total", "counter",
     "Payload bytes of data messages sent to the peer.", lambda p: p.sent_bytes),
    ("netdist_sent_messages_total", "counter",
     "Data messages sent to the peer whole.", lambda p: p.sent_messages),
    ("netdist_received_bytes_total", "counter",
     "Payload bytes of data messages received from the peer.", lambda p: p.received_bytes),
    ("netdist_received_messages_total", "counter",
     "Data messages received from the peer whole.", lambda p: p.received_messages),
    ("netdist_wire_sent_bytes_total", "counter",
     "Bytes written to the socket to the peer (headers, handshake and heartbeats "
     "included).", lambda p: p.wire_sent_bytes),
    ("netdist_wire_received_bytes_total", "counter",
     "Bytes read from the socket from the peer.", lambda p: p.wire_received_bytes),
    ("netdist_collective_waits_total", "counter",
     "Collectives of this rank whose last wait was for the peer.",
     lambda p: p.collective_waits),
    ("netdist_wait_seconds_total", "counter",
     "Seconds spent in the collectives whose last wait was for the peer.",
     lambda p: p.wait_seconds),
    ("netdist_link_stalls_total", "counter",
     "TCP segments retransmitted on the connection to the peer (kernel tcp_info).",
     lambda p: p.stalls),
    ("netdist_peer_lost", "gauge",
     "1 when this rank's transport knows the peer is gone, else 0.", lambda p: p.lost),
)
"""Per-peer metrics: name, type, help, value (``None``: no sample for that peer)."""

_RankValue = Callable[[Counters], "int | float | bool"]

_RANK_METRICS: tuple[tuple[str, str, str, _RankValue], ...] = (
    ("netdist_collectives_total", "counter",
     "Collective calls this rank's flight recorder saw.", lambda c: c.collectives),
    ("netdist_flight_dumps_total", "counter",
     "Flight-recorder dumps this rank wrote.", lambda c: c.flight_dumps),
    ("netdist_tracing", "gauge", "1 while this rank records a trace, else 0.",
     lambda c: c.tracing),
    ("netdist_world_size", "gauge", "Ranks in the job.", lambda c: c.world_size),
)


def format_prometheus(counters: Counters) -> str:
    """``counters`` in the Prometheus text format 0.0.4 (see the module docstring).

    A metric with no sample (``netdist_link_stalls_total`` where no link statistics are
    known, any per-peer metric of a one-rank job) is left out, help and type included.
    """
    lines: list[str] = []
    rank = str(counters.rank)
    for name, kind, text, peer_value in _PEER_METRICS:
        samples = []
        for peer, entry in counters.peers.items():
            value = peer_value(entry)
            if value is not None:
                samples.append(_sample(name, (("rank", rank), ("peer", str(peer))), value))
        _family(lines, name, kind, text, samples)
    for name, kind, text, rank_value in _RANK_METRICS:
        _family(lines, name, kind, text, [_sample(name, (("rank", rank),),
                                                  rank_value(counters))])
    return "".join(line + "\n" for line in lines)


def _family(lines: list[str], name: str, kind: str, text: str, samples: list[str]) -> None:
    if samples:
        lines.append(f"# HELP {name} {_escape_help(text)}")
        lines.append(f"# TYPE {name} {kind}")
        lines.extend(samples)


def _sample(name: str, labels: Sequence[tuple[str, str]], value: int | float | bool) -> str:
    label_text = ",".join(f'{key}="{_escape_label(val)}"' for key, val in labels)
    return f"{name}{{{label_text}}} {_number(value)}"


def _number(value: int | float | bool) -> str:
    """A sample value as Prometheus parses it (Go's ``ParseFloat`` plus ``+Inf``...)."""
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, int):
        return str(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


def _escape_label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


@dataclass(frozen=True)
class MetricsSettings:
    """Whether and where a rank serves ``/metrics`` (see the module docstring)."""

    port: int | None = None
    """``NETDIST_METRICS_PORT``: ``None`` off, ``0`` any free port, else the base port."""
    host: str = DEFAULT_METRICS_HOST
    """``NETDIST_METRICS_HOST``: the address to bind."""

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> MetricsSettings:
        """The settings the variables ask for; ``ConfigError`` naming the variable for a
        port that is not an integer in 0..65535."""
        env = os.environ if env is None else env
        text = (env.get(METRICS_PORT_ENV) or "").strip()
        host = (env.get(METRICS_HOST_ENV) or "").strip() or DEFAULT_METRICS_HOST
        return cls(port=int(_PORT.parse(text)) if text else None, host=host)

    def port_for(self, local_index: int) -> int:
        """The port the ``local_index``-th rank of its host binds: 0 stays 0 (any free
        port), a base port ``N`` becomes ``N + local_index``."""
        if self.port is None:
            raise ValueError("metrics are off (NETDIST_METRICS_PORT is not set)")
        return 0 if self.port == 0 else self.port + local_index
