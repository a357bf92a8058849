"""Synthetic trace files and flight-recorder dumps that follow trace format v1 exactly.

The tests build jobs whose answers are known by construction: a rank that arrives a fixed
time late at every collective, a ring of sends and receives with known sizes and times, a
rank that stopped (SIGSTOP) at a known collective.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

GROUP = "0x00000000000000a1"
"""The world group's id in the synthetic jobs."""
OTHER_GROUP = "0x00000000000000b2"
"""A second group (ranks 0 and 1)."""

OPS = ("all_reduce", "all_gather", "broadcast", "reduce_scatter")
BASE_US = 1_000_000.0
PERIOD_US = 200_000.0
DONE_AFTER_LAST_US = 2_000.0
MESSAGE_BYTES = 65_536
MOVE_US = 500.0
WAIT_US = 100.0


def jitter_us(rank: int, seq: int) -> float:
    """A small deterministic spread of arrivals (under 0.5 ms): without a late rank, the
    last one rotates (rank r is last when (r + seq) % 4 == 3)."""
    return ((rank + seq) % 4) * 100.0 + rank * 7.0


def arrival_us(rank: int, seq: int, late_rank: int | None, late_us: float) -> float:
    late = late_us if rank == late_rank else 0.0
    return BASE_US + seq * PERIOD_US + jitter_us(rank, seq) + late


def rank_trace(rank: int, world: int = 4, *, collectives: int = 50, late_rank: int | None = 2,
               late_us: float = 50_000.0, messages: int = 3) -> dict[str, Any]:
    """The per-rank file of ``rank``: metadata, one collective per seq on the world group
    (ops in turn), ``messages`` ring messages to rank+1 and from rank-1, a connection
    event and a counter."""
    events: list[dict[str, Any]] = [
        {"ph": "M", "name": "process_name", "pid": rank, "tid": 0,
         "args": {"name": f"rank {rank} (host{rank})"}},
        {"ph": "M", "name": "thread_name", "pid": rank, "tid": 1,
         "args": {"name": "collectives"}},
        {"ph": "i", "s": "p", "cat": "connection", "name": "connect", "pid": rank, "tid": 2,
         "ts": BASE_US - 10_000.0, "args": {"peer": (rank + 1) % world, "reason": "startup"}},
        {"ph": "C", "name": "bytes_in_flight", "pid": rank, "tid": 0, "ts": BASE_US,
         "args": {"series": 0}},
    ]
    for seq in range(collectives):
        arrive = arrival_us(rank, seq, late_rank, late_us)
        done = max(arrival_us(r, seq, late_rank, late_us) for r in range(world)) \
            + DONE_AFTER_LAST_US
        events.append({
            "ph": "X", "cat": "collective", "name": OPS[seq % len(OPS)], "pid": rank,
            "tid": 1, "ts": arrive, "dur": done - arrive,
            "args": {"group": GROUP, "group_size": world, "group_rank": rank, "seq": seq,
                     "bytes": 4096, "route": "ring", "state": "ok", "waited_on": -1}})
    dst, src = (rank + 1) % world, (rank - 1) % world
    for m in range(messages):
        start = BASE_US + 50_000.0 + m * 10_000.0
        events.append({  # to rank+1: leaves at `start`, blocked WAIT_US on flow control
            "ph": "X", "cat": "p2p", "name": "send", "pid": rank, "tid": 2000 + dst,
            "ts": start, "dur": WAIT_US + MOVE_US,
            "args": {"peer": dst, "tag": 7, "bytes": MESSAGE_BYTES, "wait_us": WAIT_US,
                     "move_us": MOVE_US}})
        events.append({  # from rank-1: posted at `start`, first byte after WAIT_US
            "ph": "X", "cat": "p2p", "name": "recv", "pid": rank, "tid": 1000 + src,
            "ts": start, "dur": WAIT_US + MOVE_US,
            "args": {"peer": src, "tag": 7, "bytes": MESSAGE_BYTES, "wait_us": WAIT_US,
                     "move_us": MOVE_US}})
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {
            "format": "netdist-trace", "version": 1, "rank": rank, "world_size": world,
            "job_id": "job-synth", "host": f"host{rank}", "pid": 1000 + rank,
            "clock": {"offset_us": 12.5 * rank, "error_us": 30.0, "reference_rank": 0},
            "started_unix": 1764950000.0, "events": len(events), "dropped": 0,
        },
    }


def trace_path(directory: Path, rank: int) -> Path:
    return directory / f"rank_{rank:05d}.trace.json"


def write_trace_dir(directory: Path, world: int = 4, ranks: list[int] | None = None,
                    **kwargs: Any) -> Path:
    """Write the per-rank files of ``ranks`` (default: all) of a ``world``-rank job."""
    directory.mkdir(parents=True, exist_ok=True)
    for rank in range(world) if ranks is None else ranks:
        trace_path(directory, rank).write_text(json.dumps(rank_trace(rank, world, **kwargs)))
    return directory


# --------------------------------------------------------------------------- flight dumps

def flight_op(seq: int, op: str = "all_reduce", *, group: str = GROUP, group_rank: int = 0,
              state: str = "ok", started_us: float | None = None,
              waited_on: int = -1) -> dict[str, Any]:
    started = BASE_US + seq * PERIOD_US if started_us is None else started_us
    return {"group": group, "seq": seq, "op": op, "group_rank": group_rank, "bytes": 4096,
            "route": "ring", "started_us": started,
            "ended_us": None if state == "in_flight" else started + 1_000.0,
            "state": state, "waited_on": waited_on}


def flight_dump(rank: int, world: int = 4, *, groups: dict[str, dict[str, Any]],
                operations: list[dict[str, Any]], peers: dict[str, Any] | None = None,
                trigger: str = "error", error: dict[str, Any] | None = None,
                now_us: float | None = None) -> dict[str, Any]:
    return {
        "format": "netdist-flight", "version": 1, "rank": rank, "world_size": world,
        "job_id": "job-synth", "host": f"host{rank}", "pid": 1000 + rank,
        "written_unix": 1764950100.0,
        "now_us": BASE_US + 50 * PERIOD_US if now_us is None else now_us,
        "clock": {"offset_us": 0.0, "error_us": 30.0, "reference_rank": 0},
        "trigger": trigger, "error": error, "capacity": 2000, "recorded": len(operations),
        "groups": groups, "peers": peers or {}, "operations": operations,
    }


def flight_path(directory: Path, rank: int) -> Path:
    return directory / f"flight_rank_{rank:05d}.json"


def write_dumps(directory: Path, dumps: list[dict[str, Any]]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    for dump in dumps:
        flight_path(directory, dump["rank"]).write_text(json.dumps(dump))
    return directory


def sigstop_dumps(world: int = 4, stopped: tuple[int, ...] = (2,), seq: int = 42,
                  ) -> list[dict[str, Any]]:
    """The dumps of a job whose ``stopped`` ranks froze after completing ``seq - 1``:
    every other rank entered all_reduce ``seq``, is in flight, waits on the first stopped
    rank and has lost the stopped ones (heard last for ``seq - 1``)."""
    dumps = []
    for rank in range(world):
        if rank in stopped:
            continue
        ops = [flight_op(s, group_rank=rank) for s in range(seq - 3, seq)]
        ops.append(flight_op(seq, group_rank=rank, state="in_flight", waited_on=stopped[0],
                             started_us=BASE_US + seq * PERIOD_US))
        peers = {str(p): {"lost": True, "reason": "silent for 5.0 s",
                          "last_heard_us": BASE_US + (seq - 1) * PERIOD_US,
                          "heard_seq": {GROUP: seq - 1}} for p in stopped}
        dumps.append(flight_dump(
            rank, world, groups={GROUP: {"ranks": list(range(world)), "started": seq,
                                         "completed": seq - 1}},
            operations=ops, peers=peers,
            error={"type": "PeerLostError", "message": f"lost connection to rank {stopped[0]}",
                   "peer": stopped[0]},
            now_us=BASE_US + seq * PERIOD_US + 5_200_000.0))
    return dumps
