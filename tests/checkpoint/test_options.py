"""Checkpoint options are enums: members and their strings work, anything else is a
``ConfigError`` naming the argument, the function and the allowed values."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from netdist.checkpoint import (
    RANK_OBJECT_POLICIES,
    RankObjects,
    ReplicaCheck,
    StateLayout,
    TiedTensors,
    consolidate,
    load_distributed,
    reshard_checkpoint,
    save,
    save_distributed,
)
from netdist.checkpoint.options import LOAD_RANK_OBJECTS, RESHARD_RANK_OBJECTS, parse_option
from netdist.checkpoint.restore import check_rank_objects
from netdist.errors import ConfigError
from tests.checkpoint.test_consolidate import _full, _save
from tests.ranks import run_ranks


def test_members_are_their_strings() -> None:
    assert [p.value for p in RankObjects] == ["error", "like", "modulo", "rank0", "drop"]
    assert RankObjects.MODULO == "modulo" and ReplicaCheck.WARN == "warn"
    assert TiedTensors.DROP == "drop"
    assert RANK_OBJECT_POLICIES == ("error", "like", "modulo", "rank0")
    assert set(LOAD_RANK_OBJECTS) ^ set(RESHARD_RANK_OBJECTS) == {RankObjects.LIKE,
                                                                   RankObjects.DROP}


@pytest.mark.parametrize("value", ["modulo", RankObjects.MODULO])
def test_a_load_takes_a_member_or_its_string(value: RankObjects | str) -> None:
    assert check_rank_objects(value) is RankObjects.MODULO


@pytest.mark.parametrize(("value", "where"), [("drop", "load"), ("Modulo", "load"),
                                              (RankObjects.DROP, "load_distributed"),
                                              (3, "load")])
def test_a_load_refuses_other_policies_naming_the_allowed_ones(value: object,
                                                               where: str) -> None:
    with pytest.raises(ConfigError) as info:
        check_rank_objects(value, where)  # type: ignore[arg-type]
    assert str(info.value) == (
        f"{where}: rank_objects must be one of 'error', 'like', 'modulo', 'rank0' (or the "
        f"RankObjects members), got {value!r}")
    assert isinstance(info.value, ValueError)


def test_parse_option_without_a_subset_takes_every_member() -> None:
    assert parse_option("copy", TiedTensors, "tied", "consolidate") is TiedTensors.COPY
    with pytest.raises(ConfigError, match=r"^consolidate: tied must be one of 'copy', "
                                          r"'drop' \(or the TiedTensors members\), "
                                          r"got 'keep'$"):
        parse_option("keep", TiedTensors, "tied", "consolidate")


def test_load_distributed_validates_before_reading(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="load_distributed: rank_objects must be one of"):
        load_distributed(tmp_path / "missing", 0, 1, rank_objects="drop")


def test_reshard_checkpoint_takes_members_and_names_its_own_policies(tmp_path: Path) -> None:
    layout = StateLayout({"t": "object", "k": "cursor"}, {}, {"cursor": (0, 10, 20)})
    _save(_full(), tmp_path / "ck", 3, 0, state=layout)
    with pytest.raises(ConfigError) as info:
        reshard_checkpoint(tmp_path / "ck", tmp_path / "a", 2, rank_objects="like")
    assert str(info.value) == (
        "reshard_checkpoint: rank_objects must be one of 'error', 'modulo', 'rank0', 'drop' "
        "(or the RankObjects members), got 'like'")
    assert not (tmp_path / "a").exists()
    dropped = reshard_checkpoint(tmp_path / "ck", tmp_path / "b", 2,
                                 rank_objects=RankObjects.DROP)
    assert dropped.state is not None and dropped.state.rank_objects == {}
    first = reshard_checkpoint(tmp_path / "ck", tmp_path / "c", 2, rank_objects="rank0")
    assert first.state is not None and first.state.rank_objects == {"cursor": (0, 0)}


def test_consolidate_refuses_an_unknown_tied_policy(tmp_path: Path) -> None:
    save_distributed({"w": np.zeros(3, np.float32)}, tmp_path / "ck", 0, 1)
    with pytest.raises(ConfigError, match="consolidate: tied must be one of 'copy', 'drop'"):
        consolidate(tmp_path / "ck", tmp_path / "out.safetensors", tied="keep")
    assert not (tmp_path / "out.safetensors").exists()
    out = consolidate(tmp_path / "ck", tmp_path / "out.safetensors", tied=TiedTensors.DROP)
    assert out == tmp_path / "out.safetensors" and out.is_file()


async def test_save_names_the_replica_check_values(tmp_path: Path) -> None:
    errors = await run_ranks(1, lambda g: save({"w": np.zeros(2)}, tmp_path, g,
                                               check_replicated="sometimes"),
                             return_exceptions=True)
    assert str(errors[0]) == (
        "save: check_replicated must be one of 'off', 'warn', 'error' (or the ReplicaCheck "
        "members), got 'sometimes'; True and False stand for 'error' and 'off'")
    assert isinstance(errors[0], ConfigError) and not tmp_path.joinpath("step_000000").exists()
