"""Who went away first: the origin of a lost peer, carried in a rank's last frame.

When rank S loses rank W and then closes its transport (it aborts, or leaves after the
loss), its peers would otherwise only see S go away and blame S. Instead S's last frame
to each of them is an ERROR frame naming the origin (docs/PROTOCOL.md section 7)::

    ERROR {reason: "rank 0 aborted because rank 5 was lost: rank 5 closed the connection (EOF)",
           rank: 0, origin: 5, origin_reason: "rank 5 closed the connection (EOF)",
           seen_by: 0, code: "aborted"}

and a receiver raises ``PeerLostError(rank=S, origin_rank=W)`` whose message leads with
W. A rank failing on its own error names itself as the origin; a rank that closes
cleanly with nothing lost sends BYE (it left the job). Receivers that predate these keys
still read ``reason``; unknown or ill-typed keys are ignored.

PURE: no I/O, so every message can be tested without sockets.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

__all__ = [
    "Departure",
    "LossOrigin",
    "Farewell",
    "MAX_REASON_CHARS",
    "one_line",
    "describe_failure",
    "farewell_fields",
    "read_farewell",
]

MAX_REASON_CHARS = 400
"""Reasons are cut to this many characters so a farewell always fits one small header."""


class Departure(enum.Enum):
    """How the sender of a farewell is leaving (the ERROR frame's ``code``)."""

    ABORTED = "aborted"
    """It is failing: an exception, or a loss it could not go on without."""
    CLOSED = "closed"
    """It closed its transport normally, but only after losing the origin."""


@dataclass(frozen=True, slots=True)
class LossOrigin:
    """The rank that went away first, what happened to it, and who saw it happen."""

    rank: int
    reason: str
    """One line, leading with the rank: "rank 5 closed the connection (EOF)"."""
    seen_by: int
    """The rank that observed it first hand (equal to ``rank`` when it failed itself)."""


@dataclass(frozen=True, slots=True)
class Farewell:
    """What a peer's last frame (ERROR) told us: the origin and how the sender left."""

    sender: int
    origin: LossOrigin
    how: Departure

    def message(self) -> str:
        """The receiver's one-line error text, leading with the origin."""
        origin, sender = self.origin, self.sender
        if origin.rank == sender:
            return origin.reason
        aborted = self.how is Departure.ABORTED
        if origin.seen_by == sender:
            then = "aborted" if aborted else "then closed its transport"
            return f"{origin.reason} — seen by rank {sender}, which {then}"
        first = ("" if origin.seen_by == origin.rank
                 else f" (first seen by rank {origin.seen_by})")
        verb = "aborted" if aborted else "closed its transport"
        return f"{origin.reason}{first} — rank {sender} {verb} in turn"


def one_line(text: str, limit: int = MAX_REASON_CHARS) -> str:
    """``text`` on one line (whitespace runs collapsed), cut to ``limit`` characters."""
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[:limit - 3] + "..."


def describe_failure(rank: int, error: BaseException | str) -> str:
    """The origin reason of a rank failing on its own: "rank 2 aborted: RuntimeError: boom"."""
    if isinstance(error, str):
        detail = error or "no reason given"
    elif isinstance(error, KeyboardInterrupt):
        detail = "interrupted (KeyboardInterrupt)"
    else:
        try:
            text = str(error)
        except Exception:  # noqa: BLE001 - a broken __str__ must not stop the close
            text = "<unprintable>"
        detail = f"{type(error).__name__}: {text}" if text else type(error).__name__
    return one_line(f"rank {rank} aborted: {detail}")


def farewell_fields(sender: int, origin: LossOrigin, how: Departure) -> dict[str, Any]:
    """The ERROR header rank ``sender`` sends its peers when it leaves because of ``origin``."""
    if origin.rank == sender:
        reason = origin.reason
    else:
        verb = "aborted" if how is Departure.ABORTED else "closed its transport"
        reason = f"rank {sender} {verb} because rank {origin.rank} was lost: {origin.reason}"
    return {"reason": one_line(reason), "rank": sender, "origin": origin.rank,
            "origin_reason": one_line(origin.reason), "seen_by": origin.seen_by,
            "code": how.value}


def _rank_field(fields: dict[str, Any], key: str) -> int | None:
    value = fields.get(key)
    return value if type(value) is int and value >= 0 else None


def read_farewell(fields: dict[str, Any], sender: int) -> Farewell:
    """Interpret the ERROR frame rank ``sender`` sent after the handshake.

    A frame with a well-formed ``origin`` names the rank that went away first; any other
    ERROR (an older sender, a bare ``reason``) makes ``sender`` itself the origin.
    Ill-typed keys are ignored, never raised on: the frame is the peer's last word.
    """
    raw_reason = fields.get("reason")
    reason = one_line(raw_reason) if isinstance(raw_reason, str) and raw_reason else ""
    origin_rank = _rank_field(fields, "origin")
    origin_reason = fields.get("origin_reason")
    code = fields.get("code")
    how = Departure.CLOSED if code == Departure.CLOSED.value else Departure.ABORTED
    if origin_rank is None or not isinstance(origin_reason, str) or not origin_reason:
        text = (f"rank {sender} reported an error and dropped the connection: "
                f"{reason or 'no reason given'}")
        return Farewell(sender, LossOrigin(sender, text, sender), Departure.ABORTED)
    seen_by = _rank_field(fields, "seen_by")
    origin = LossOrigin(origin_rank, one_line(origin_reason),
                        sender if seen_by is None else seen_by)
    return Farewell(sender, origin, how)
