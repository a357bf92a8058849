"""PURE: the summary ``netdist launch`` prints at the end of a failed job.

When one rank fails, every other rank usually fails too, each printing a long chained
``PeerLostError`` traceback that buries the real error. The launcher knows more than any
rank: in which order the children exited, how (code or signal), whether it had already
sent them SIGTERM, whether one was stopped, and the last lines each wrote to stderr. From
that, ``summarize_failure`` names the rank that went away first and shows its own error,
then every other rank in one line, in the order they exited::

    job failed; first failure: rank 1 exited with code 1:
      rank 1 | Traceback (most recent call last):
      rank 1 |   File "train.py", line 12, in main
      rank 1 |     raise RuntimeError("boom")
      rank 1 | RuntimeError: boom
    then, in the order they exited:
      rank 2: PeerLostError: lost connection to rank 1 (exit code 1; a consequence)
      rank 0: terminated by the launcher (SIGTERM)

Who is blamed first:

1. a rank that was *stopped* (process state ``T``, e.g. SIGSTOP) when the failure was
   detected: it stopped answering and the others lost it;
2. else a rank that exited with code 0 while others were still running, before the first
   failure: a peer that leaves a job early looks lost to the others;
3. else the first rank that failed with an error of its own rather than a consequence
   (``PeerLostError`` / ``TransportClosedError``: it only lost a peer): ranks that fail
   within milliseconds of each other may be reaped in either order, and the rank that
   raised may still be shutting down when the launcher's SIGTERM reaches it.

When the blamed rank did not fail with an error of its own (cases 1 and 2), the first
rank with a real error is still shown in full right after it. No I/O here: the launcher
collects ``RankExit`` records and prints the lines.
"""

from __future__ import annotations

import re
import signal
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "RankExit",
    "summarize_failure",
    "worth_printing",
    "error_line",
    "error_block",
    "is_consequence",
    "describe_exit",
    "rank_list",
]

CONSEQUENCE_ERRORS = frozenset({"PeerLostError", "TransportClosedError"})
"""Exception types that say a rank lost a peer, not that something went wrong in it."""

_BLOCK_LINES = 10
"""At most this many lines of the blamed rank's error are shown."""

_LINE_CHARS = 300
"""One-line errors are cut to this many characters."""

_TRACEBACK = "Traceback (most recent call last):"
_CARETS = re.compile(r"^\s*[~^]+\s*$")  # Python 3.11's position markers under a frame
_CLI_ERROR = re.compile(r"^netdist [\w -]+(?: \(rank [^)]*\))?: error: (.*)$")
_LOST_LOG = re.compile(r"^netdist: rank \d+ (lost rank \d+: .*)$")  # the transport's warning
_EXCEPTION = re.compile(
    r"^(?:[A-Za-z_]\w*\.)*"  # optional module path: netdist.errors.
    r"([A-Z]\w*(?:Error|Exception|Exit|Interrupt|Warning|Group|Failure))"
    r"(?::\s?(.*))?$")


@dataclass(frozen=True, slots=True)
class RankExit:
    """How one rank of a failed job ended, as the launcher saw it."""

    rank: int
    returncode: int
    """Popen-style: the exit code, or ``-N`` when killed by signal N."""
    order: int
    """Position in the order the ranks exited (0: the first)."""
    stderr_tail: tuple[str, ...] = ()
    """The last lines the rank wrote to stderr (empty when output is not captured)."""
    after_terminate: bool = False
    """It exited after the launcher had sent its process group SIGTERM."""
    stopped: bool = False
    """It was stopped (state ``T``) when the launcher detected the failure."""


def _shorten(text: str) -> str:
    text = text.strip()
    return text if len(text) <= _LINE_CHARS else text[:_LINE_CHARS - 3] + "..."


def _match_error(line: str) -> str | None:
    """``"Type: message"`` if ``line`` is an exception line or a netdist CLI error line."""
    cli = _CLI_ERROR.match(line.strip()) or _LOST_LOG.match(line.strip())
    if cli:
        return cli.group(1)
    # ExceptionGroup tracebacks indent their members with "| "
    match = _EXCEPTION.match(re.sub(r"^[\s|]*", "", line.rstrip()))
    if match is None or (line[:1].isspace() and "|" not in line[:8]):
        return None
    name, message = match.group(1), match.group(2)
    return f"{name}: {message}" if message else name


def error_line(tail: Sequence[str]) -> str | None:
    """The last error ``tail`` reports, as ``"Type: message"`` (module path dropped).

    Recognises Python's final traceback line (``netdist.errors.PeerLostError: ...``),
    the one-line errors of netdist's CLI (``netdist worker: error: ...``) and the
    transport's warning ``netdist: rank 0 lost rank 1: <reason>`` (as ``lost rank 1:
    <reason>``). ``None`` when there is none of these.
    """
    for line in reversed(tail):
        found = _match_error(line)
        if found is not None:
            return _shorten(found)
    return None


def is_consequence(error: str | None) -> bool:
    """Whether ``error`` (from ``error_line``) only says that a peer went away."""
    if error is None:
        return False
    return error.startswith("lost rank ") or error.split(":", 1)[0].strip() in CONSEQUENCE_ERRORS


def error_block(tail: Sequence[str], limit: int = _BLOCK_LINES) -> list[str]:
    """The lines that show a rank's own error: its last traceback, trimmed to ``limit``.

    The traceback keeps its header and its last frames (where it was raised) and drops
    Python's ``^^^^`` markers. Without a traceback: the error line, else the last lines.
    """
    lines = [line.rstrip() for line in tail if not _CARETS.match(line)]
    start = max((i for i, line in enumerate(lines) if _TRACEBACK in line), default=None)
    if start is not None:
        block = [line for line in lines[start:] if line.strip()]
        if len(block) > limit:
            block = [block[0], "  ...", *block[len(block) - (limit - 2):]]
        return block
    found = error_line(lines)
    if found is not None:
        return [found]
    return [line for line in lines if line.strip()][-min(limit, 5):]


def describe_exit(returncode: int) -> str:
    """``"exited with code 3"`` or ``"was killed by signal 9 (SIGKILL)"`` (Popen codes)."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"was killed by signal {-returncode} ({name})"
    return f"exited with code {returncode}"


def rank_list(ranks: Sequence[int]) -> str:
    """``"rank 3"`` or ``"ranks 0, 1, 2"``."""
    noun = "rank" if len(ranks) == 1 else "ranks"
    return f"{noun} {', '.join(str(r) for r in ranks)}"


def _first_error(by_order: Sequence[RankExit]) -> RankExit:
    """The rank whose own error started the failure (module docstring, case 3).

    Preferred, in this order: the first rank that failed before the launcher's SIGTERM
    with an error of its own (or silently: a SIGKILL leaves no words); then one whose
    exit came after the SIGTERM but whose stderr shows an error of its own (it was still
    shutting down when a faster consequence was reaped); then the first failure.
    """
    own = [e for e in by_order if e.returncode != 0 and not e.after_terminate]
    for e in own:
        if not is_consequence(error_line(e.stderr_tail)):
            return e
    for e in by_order:
        error = error_line(e.stderr_tail)
        if e.returncode != 0 and error is not None and not is_consequence(error):
            return e
    failures = own or [e for e in by_order if e.returncode != 0] or list(by_order)
    return failures[0]


def _failed_how(e: RankExit) -> str:
    if e.after_terminate and not is_consequence(error_line(e.stderr_tail)):
        return (f"failed with its own error (then {describe_exit(e.returncode)} "
                f"after the launcher's SIGTERM)")
    return describe_exit(e.returncode)


def _blame(exits: Sequence[RankExit]) -> tuple[RankExit, str, RankExit | None]:
    """``(culprit, why, first real error)``: see the module docstring for the order."""
    by_order = sorted(exits, key=lambda e: e.order)
    own = [e for e in by_order if e.returncode != 0 and not e.after_terminate]
    failures = own or [e for e in by_order if e.returncode != 0] or by_order
    first_error = _first_error(by_order)
    stopped = [e for e in by_order if e.stopped]
    if stopped:
        culprit = stopped[0]
        others = [e.rank for e in by_order if e is not culprit]
        return (culprit, f"rank {culprit.rank} was stopped (process state T, e.g. SIGSTOP) "
                f"while {rank_list(others)} ran", first_error)
    left = [e for e in by_order if e.returncode == 0 and e.order < failures[0].order]
    if left:
        culprit = left[0]
        later = sorted(e.rank for e in by_order if e.order > culprit.order)
        verb = "was" if len(later) == 1 else "were"
        return (culprit, f"rank {culprit.rank} exited (code 0) while {rank_list(later)} "
                f"{verb} still running", first_error)
    return first_error, f"rank {first_error.rank} {_failed_how(first_error)}", None


def _terminated(e: RankExit) -> bool:
    """It died from the launcher's SIGTERM (or the SIGKILL after the grace period)."""
    return e.after_terminate and e.returncode in (-signal.SIGTERM, -signal.SIGKILL)


def _one_line(e: RankExit) -> str:
    error = error_line(e.stderr_tail)
    if error is not None:
        note = "; a consequence" if is_consequence(error) else ""
        if _terminated(e):
            how = f"then terminated by the launcher with {signal.Signals(-e.returncode).name}"
        elif e.returncode >= 0:
            how = f"exit code {e.returncode}"
        else:
            how = describe_exit(e.returncode)
        return f"rank {e.rank}: {error} ({how}{note})"
    if _terminated(e):
        return (f"rank {e.rank}: terminated by the launcher "
                f"({signal.Signals(-e.returncode).name})")
    if e.after_terminate:
        return f"rank {e.rank}: {describe_exit(e.returncode)} after the launcher's SIGTERM"
    if e.returncode == 0:
        return f"rank {e.rank}: exited with code 0"
    return f"rank {e.rank}: {describe_exit(e.returncode)}"


def _show(e: RankExit, heading: str) -> list[str]:
    if not e.stderr_tail:
        return [f"{heading} (nothing on stderr)"]
    return [f"{heading}:", *(f"  rank {e.rank} | {line}" for line in error_block(e.stderr_tail))]


def summarize_failure(exits: Sequence[RankExit]) -> list[str]:
    """The failure summary: the blamed rank and its error first, then one line per rank.

    ``exits`` holds every rank of the failed job, at least one with a non-zero code.
    Returns the lines to print (no prefix, no newline).
    """
    if not exits:
        return []
    culprit, why, first_error = _blame(exits)
    if first_error is None:
        lines = _show(culprit, f"job failed; first failure: {why}")
    else:
        lines = [f"job failed; first to go: {why}"]
        lines += _show(first_error, f"first error: rank {first_error.rank} "
                                    f"{_failed_how(first_error)}")
    shown = {culprit.rank} | ({first_error.rank} if first_error is not None else set())
    rest = [e for e in sorted(exits, key=lambda e: e.order) if e.rank not in shown]
    if rest:
        lines.append("then, in the order they exited:")
        lines += [f"  {_one_line(e)}" for e in rest]
    return lines


def worth_printing(exits: Sequence[RankExit]) -> bool:
    """Whether the summary says more than the launcher's one-line failure report.

    It does in a job of several ranks when a rank wrote to stderr, when more than one
    rank failed on its own, or when the rank to blame is not simply the first to exit
    non-zero. A one-rank job's own output, just above, already says everything.
    """
    if len(exits) < 2:
        return False
    if any(e.stderr_tail for e in exits):
        return True
    own = [e for e in exits if e.returncode != 0 and not e.after_terminate]
    if len(own) > 1:
        return True
    culprit, _, _ = _blame(exits)
    first_nonzero = min((e for e in exits if e.returncode != 0), key=lambda e: e.order,
                        default=None)
    return first_nonzero is None or culprit is not first_nonzero
