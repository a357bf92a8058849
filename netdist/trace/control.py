"""Start and stop a trace, dump the flight recorder: the calls users make at run time.

Each takes what the user holds: a transport, a ``Group`` (its transport's recorder), or a
blocking-API ``Job`` / proxy (the transport behind it). A rank traces on its own; to
trace a whole job over a window, every rank calls ``start_trace`` and ``stop_trace`` (at
the same step, so the files cover the same collectives), then ``netdist trace merge``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from netdist.trace.recorder import Recorder

__all__ = ["recorder_of", "start_trace", "stop_trace", "dump_flight_record"]


def recorder_of(holder: Any) -> Recorder:
    """The recorder of ``holder``: a transport, a group, a ``Job`` or a blocking proxy of
    one of them. ``TypeError`` naming the type for anything else."""
    seen = holder
    for _ in range(4):  # proxy -> job -> proxy -> transport at most
        holder = getattr(holder, "target", holder)
        recorder = getattr(holder, "recorder", None)
        if isinstance(recorder, Recorder):
            return recorder
        holder = getattr(holder, "transport", None)
        if holder is None:
            break
    raise TypeError(f"no netdist recorder in a {type(seen).__name__}: pass a transport, "
                    "a Group or a Job")


def start_trace(holder: Any, directory: str | os.PathLike[str] | None = None) -> Path:
    """Start tracing this rank into ``directory`` (default ``NETDIST_TRACE``); the
    directory. Tracing already on into the same directory goes on."""
    return recorder_of(holder).start_trace(directory)


def stop_trace(holder: Any) -> Path | None:
    """Stop tracing this rank and write its ``rank_NNNNN.trace.json``; the file (``None``
    if it was not tracing). Closing the transport does the same."""
    return recorder_of(holder).stop_trace()


def dump_flight_record(holder: Any, directory: str | os.PathLike[str] | None = None
                       ) -> Path | None:
    """Write this rank's flight recorder now (``flight_rank_NNNNN.json`` in
    ``directory``, default ``NETDIST_FLIGHT_DIR``); the file, or ``None`` if it could
    not be written (logged)."""
    return recorder_of(holder).dump("api", directory=directory)
