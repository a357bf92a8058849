"""Dump every live flight recorder of this process on ``SIGUSR1``.

A job that hangs without failing writes no error dump; ``kill -USR1 <pid>`` on each rank
(or ``netdist launch``'s ranks all at once) asks every rank where it is. The handler is
installed the first time a TCP transport is made in the main thread, and only if nobody
installed one for ``SIGUSR1`` before (the application's own handler wins). A process has
one signal table, so the recorders to dump are kept in one module-level weak set: the
only process-wide state in netdist, as the signal itself is process-wide.
"""

from __future__ import annotations

import signal
import threading
import weakref
from types import FrameType

from netdist.trace.recorder import Recorder

__all__ = ["install_dump_signal", "DUMP_SIGNAL"]

DUMP_SIGNAL = getattr(signal, "SIGUSR1", None)
"""The signal that dumps the flight recorders (``None`` where the platform has none)."""

_recorders: weakref.WeakSet[Recorder] = weakref.WeakSet()
_installed = False


def install_dump_signal(recorder: Recorder) -> None:
    """Let ``SIGUSR1`` dump ``recorder`` (installing the handler if nobody has one)."""
    global _installed
    if recorder.settings.flight_records == 0 or DUMP_SIGNAL is None:
        return
    _recorders.add(recorder)
    if _installed or threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(DUMP_SIGNAL) is not signal.SIG_DFL:
        return
    signal.signal(DUMP_SIGNAL, _dump_all)
    _installed = True


def _dump_all(signum: int, frame: FrameType | None) -> None:
    for recorder in list(_recorders):
        recorder.dump("signal")
