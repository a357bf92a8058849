"""netdist.trace.analysis.explain (``netdist trace why``): from flight-recorder dumps, which
rank stopped and where, in every shape the dumps come in."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from netdist.errors import TraceError
from netdist.trace.analysis import explain, load_flight_dir
from tests.trace import synth
from tests.trace.synth import GROUP, OTHER_GROUP, flight_dump, flight_op

WORLD = [0, 1, 2, 3]


def _explain(tmp_path: Path, dumps: list[dict[str, Any]], world_size: int | None = None) -> str:
    return explain(load_flight_dir(synth.write_dumps(tmp_path, dumps)), world_size)


def test_a_stopped_rank_is_named_with_the_collective_it_never_joined(tmp_path: Path) -> None:
    text = _explain(tmp_path, synth.sigstop_dumps(stopped=(2,), seq=42))
    assert text == (
        f"Rank 2 stopped: it left no flight-recorder dump (ranks 0, 1 and 3 did, trigger: "
        f"error). Ranks 0, 1 and 3 were in all_reduce seq 42 of group {GROUP} (in flight "
        f"for 5.20 s), waiting on rank 2; rank 2 never joined it (its last message arrived "
        f"for seq 41); ranks 0, 1 and 3 lost rank 2 (silent for 5.0 s). The last operation "
        f"rank 2 is known to have completed is all_reduce seq 41 of group {GROUP}.")
    assert "\n" not in text


def test_several_stopped_ranks_each_get_their_account(tmp_path: Path) -> None:
    text = _explain(tmp_path, synth.sigstop_dumps(stopped=(2, 3), seq=42))
    assert text == (
        f"Ranks 2 and 3 stopped: they left no flight-recorder dump (ranks 0 and 1 did, "
        f"trigger: error). "
        f"Ranks 0 and 1 were in all_reduce seq 42 of group {GROUP} (in flight for 5.20 s), "
        f"waiting on rank 2; rank 2 never joined it (its last message arrived for seq 41); "
        f"ranks 0 and 1 lost rank 2 (silent for 5.0 s). The last operation rank 2 is known "
        f"to have completed is all_reduce seq 41 of group {GROUP}. "
        f"Ranks 0 and 1 were in all_reduce seq 42 of group {GROUP} (in flight for 5.20 s); "
        f"rank 3 never joined it (its last message arrived for seq 41); ranks 0 and 1 lost "
        f"rank 3 (silent for 5.0 s). The last operation rank 3 is known to have completed "
        f"is all_reduce seq 41 of group {GROUP}.")


def test_a_rank_that_joined_and_died_inside_the_collective(tmp_path: Path) -> None:
    dumps = [flight_dump(
        r, groups={GROUP: {"ranks": WORLD, "started": 42, "completed": 41}},
        operations=[flight_op(41, group_rank=r), flight_op(42, group_rank=r, state="error",
                                                          waited_on=3)],
        peers={"3": {"lost": True, "reason": "closed the connection (EOF)",
                     "last_heard_us": None, "heard_seq": {GROUP: 42}}},
        error={"type": "PeerLostError", "message": "lost connection to rank 3", "peer": 3})
        for r in range(3)]
    assert _explain(tmp_path, dumps) == (
        f"Rank 3 stopped: it left no flight-recorder dump (ranks 0-2 did, trigger: error). "
        f"Ranks 0-2 were in all_reduce seq 42 of group {GROUP} (failed), waiting on rank 3; "
        f"rank 3 had joined it (a message of seq 42 arrived) but never finished it; ranks "
        f"0-2 lost rank 3 (closed the connection (EOF)). The last operation rank 3 is known "
        f"to have completed is all_reduce seq 41 of group {GROUP}.")


def test_without_peer_evidence_the_group_progress_still_says_where(tmp_path: Path) -> None:
    # the ring of operations was overwritten and no peer state: only groups[..] is left
    dumps = [flight_dump(r, groups={GROUP: {"ranks": WORLD, "started": 9, "completed": 8}},
                         operations=[], trigger="signal") for r in (0, 1, 3)]
    assert _explain(tmp_path, dumps) == (
        f"Rank 2 stopped: it left no flight-recorder dump (ranks 0, 1 and 3 did, trigger: "
        f"signal). Ranks 0, 1 and 3 were in collective seq 9 of group {GROUP} (in flight); "
        f"rank 2 never completed it. The last operation rank 2 is known to have completed "
        f"is collective seq 8 of group {GROUP}.")


def test_a_stopped_rank_nobody_was_waiting_for(tmp_path: Path) -> None:
    dumps = [flight_dump(r, groups={GROUP: {"ranks": WORLD, "started": 5, "completed": 5}},
                         operations=[flight_op(5, group_rank=r)], trigger="signal",
                         peers={"1": {"lost": True, "reason": "silent for 5.0 s",
                                      "last_heard_us": 1.0}})
             for r in (0, 2, 3)]
    assert _explain(tmp_path, dumps) == (
        "Rank 1 stopped: it left no flight-recorder dump (ranks 0, 2 and 3 did, trigger: "
        "signal). No rank that dumped was inside a collective with rank 1; ranks 0, 2 and "
        "3 lost rank 1 (silent for 5.0 s).")


def test_all_ranks_dumped_and_agree(tmp_path: Path) -> None:
    dumps = [flight_dump(r, groups={GROUP: {"ranks": WORLD, "started": 42, "completed": 41}},
                         operations=[flight_op(41, group_rank=r),
                                     flight_op(42, group_rank=r, state="in_flight")],
                         trigger="signal") for r in WORLD]
    assert _explain(tmp_path, dumps) == (
        f"All 4 ranks wrote a dump (trigger: signal) and none is behind another in any "
        f"group. They agree: every rank is in all_reduce seq 42 of group {GROUP} (in "
        f"flight), so no single rank stopped: the collective itself (or the network between "
        f"the ranks) is stuck.")


def test_all_ranks_dumped_idle_and_disagreeing_positions(tmp_path: Path) -> None:
    dumps = [flight_dump(r, groups={GROUP: {"ranks": WORLD, "started": 3, "completed": 3}},
                         operations=[flight_op(3, group_rank=r)], trigger="api")
             for r in WORLD]
    assert _explain(tmp_path, dumps) == (
        f"All 4 ranks wrote a dump (trigger: api) and none is behind another in any group. "
        f"They agree: every rank is in no collective (last completed: all_reduce seq 3 of "
        f"group {GROUP}).")
    dumps[3]["operations"] = []  # rank 3's ring lost: no last operation to name
    assert _explain(tmp_path / "b", dumps) == (
        f"All 4 ranks wrote a dump (trigger: api) and none is behind another in any group. "
        f"They do not agree: ranks 0-2 are in no collective (last completed: all_reduce seq 3 "
        f"of group {GROUP}); rank 3 is in no collective (none recorded).")


def test_a_rank_that_dumped_but_is_behind_is_stuck_outside(tmp_path: Path) -> None:
    dumps = []
    for r in WORLD:
        if r == 1:
            ops = [flight_op(s, group_rank=r) for s in (39, 40)]
            groups = {GROUP: {"ranks": WORLD, "started": 40, "completed": 40}}
        else:
            ops = [flight_op(s, group_rank=r) for s in (39, 40)]
            ops.append(flight_op(41, group_rank=r, state="in_flight", waited_on=1))
            groups = {GROUP: {"ranks": WORLD, "started": 41, "completed": 40}}
        dumps.append(flight_dump(r, groups=groups, operations=ops, trigger="signal"))
    assert _explain(tmp_path, dumps) == (
        f"Rank 1 is behind: it started only all_reduce seq 40 of group {GROUP}, while ranks "
        f"0, 2 and 3 reached all_reduce seq 41 of group {GROUP}; ranks 0, 2 and 3 are "
        f"waiting on it. Rank 1 is in no collective after all_reduce seq 40 of group "
        f"{GROUP}: it is stuck outside netdist's collectives (in its own code, I/O or "
        f"another library).")


def test_ranks_stuck_in_different_groups_are_a_deadlock(tmp_path: Path) -> None:
    dumps = []
    for r in WORLD:
        groups = {GROUP: {"ranks": WORLD, "started": 40 if r == 1 else 41, "completed": 40}}
        ops = [flight_op(40, group_rank=r)]
        if r == 1:  # went on to the pair group first
            groups[OTHER_GROUP] = {"ranks": [1, 3], "started": 7, "completed": 6}
            ops.append(flight_op(7, "broadcast", group=OTHER_GROUP, state="in_flight",
                                 waited_on=3))
        else:
            if r == 3:
                groups[OTHER_GROUP] = {"ranks": [1, 3], "started": 6, "completed": 6}
            ops.append(flight_op(41, group_rank=r, state="in_flight", waited_on=1))
        dumps.append(flight_dump(r, groups=groups, operations=ops, trigger="signal"))
    assert _explain(tmp_path, dumps) == (
        f"Rank 1 is behind: it started only all_reduce seq 40 of group {GROUP}, while ranks "
        f"0, 2 and 3 reached all_reduce seq 41 of group {GROUP}; ranks 0, 2 and 3 are "
        f"waiting on it. Rank 1 is stuck elsewhere, in broadcast seq 7 of group "
        f"{OTHER_GROUP} (in flight, waiting on rank 3). The last operation rank 1 completed "
        f"is all_reduce seq 40 of group {GROUP}. "
        f"Rank 3 is behind: it started only collective seq 6 of group {OTHER_GROUP}, while "
        f"rank 1 reached broadcast seq 7 of group {OTHER_GROUP}; rank 1 is waiting on it. "
        f"Rank 3 is stuck elsewhere, in all_reduce seq 41 of group {GROUP} (in flight, "
        f"waiting on rank 1). The last operation rank 3 completed is all_reduce seq 40 of "
        f"group {GROUP}. "
        f"Ranks 1 and 3 wait on each other, a deadlock: rank 1 in broadcast seq 7 of group "
        f"{OTHER_GROUP} waits on rank 3; rank 3 in all_reduce seq 41 of group {GROUP} waits "
        f"on rank 1 (the ranks called the collectives of these groups in different orders).")


# --------------------------------------------------------------------------- errors

def test_no_dumps_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(TraceError) as info:
        load_flight_dir(tmp_path)
    assert str(info.value) == (
        f"no flight-recorder dumps (flight_rank_*.json) in {tmp_path}: ranks write them on "
        f"a lost peer or a timeout in a collective, or on SIGUSR1")
    with pytest.raises(TraceError, match="^no flight-recorder dumps to explain$"):
        explain([])
    with pytest.raises(TraceError, match="^flight-recorder directory .* does not exist$"):
        load_flight_dir(tmp_path / "nope")


def test_a_truncated_dump_is_named(tmp_path: Path) -> None:
    synth.write_dumps(tmp_path, synth.sigstop_dumps())
    path = synth.flight_path(tmp_path, 1)
    whole = path.read_text()
    path.write_text(whole[:100])
    with pytest.raises(TraceError) as info:
        load_flight_dir(tmp_path)
    assert str(info.value).startswith(
        f"flight-recorder dump {path} is not valid JSON (truncated?): ")
    assert info.value.path == str(path)


def test_an_invalid_dump_is_named_with_its_problem(tmp_path: Path) -> None:
    dumps = synth.sigstop_dumps()
    del dumps[0]["groups"]
    synth.write_dumps(tmp_path, dumps)
    with pytest.raises(TraceError) as info:
        load_flight_dir(tmp_path)
    assert str(info.value) == (f"{synth.flight_path(tmp_path, 0)} is not a netdist-flight "
                               f"dump (format v1): dump: missing 'groups'")


def test_a_dump_whose_rank_is_not_its_name(tmp_path: Path) -> None:
    dump = synth.sigstop_dumps()[0]
    tmp_path.mkdir(exist_ok=True)
    synth.flight_path(tmp_path, 3).write_text(json.dumps(dump))
    with pytest.raises(TraceError) as info:
        load_flight_dir(tmp_path)
    assert str(info.value) == f"{synth.flight_path(tmp_path, 3)} holds rank 0, but its name says rank 3"


def test_world_size_argument_and_disagreeing_dumps(tmp_path: Path) -> None:
    dumps = synth.sigstop_dumps()
    text = _explain(tmp_path, dumps, world_size=5)
    assert text.startswith("Ranks 2 and 4 stopped: they left no flight-recorder dump")
    assert text.endswith(" No rank that dumped was inside a collective with rank 4.")
    loaded = load_flight_dir(tmp_path)
    loaded[1].world_size = 8
    with pytest.raises(TraceError, match=r"^the dumps disagree on the world size \(\[4, 8\]\)$"):
        explain(loaded)
    with pytest.raises(TraceError, match="^dump of rank 3 is outside world size 2$"):
        explain(load_flight_dir(tmp_path), world_size=2)
