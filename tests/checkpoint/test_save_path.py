"""One save path: every entry point plans once per rank per save.

The collective ``save``, ``save_distributed`` and ``AsyncCheckpointer`` all run the one
orchestrator of :mod:`netdist.checkpoint.writing` (``run_save``), which calls
``plan_writes`` once; a counting spy stands in for ``plan_writes`` under every name a
checkpoint module knows it by, so a second planning call anywhere in a save shows up.
"""

from __future__ import annotations

import asyncio
import contextvars
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from netdist.checkpoint import (
    AsyncCheckpointer,
    ReplicaDivergenceWarning,
    ShardedArray,
    flat_shard_metadata,
    load_distributed,
    save,
    save_distributed,
    shard_state_dict,
)
from netdist.checkpoint import planner
from netdist.checkpoint.writing import run_inline
from netdist.collectives import Group
from netdist.sharding import chunk_bounds
from tests.ranks import run_ranks

OP_TIMEOUT = 10.0

FULL: dict[str, np.ndarray] = {
    "w": np.arange(11 * 4, dtype=np.float32).reshape(11, 4),  # sharded, uneven
    "step": np.array(7, np.int64),                            # replicated (0-d)
}

RANK: contextvars.ContextVar[int | None] = contextvars.ContextVar("RANK", default=None)
"""The rank whose task is running (collective saves of every rank share one loop)."""


class PlanSpy:
    """Stands in for ``plan_writes``: records the calling rank (``RANK``) of each call."""

    def __init__(self) -> None:
        self.real = planner.plan_writes
        self.calls: list[int | None] = []

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls.append(RANK.get())
        return self.real(*args, **kwargs)

    def take(self) -> list[int | None]:
        """The calls since the last ``take``."""
        calls, self.calls = self.calls, []
        return calls


@pytest.fixture
def plans(monkeypatch: pytest.MonkeyPatch) -> PlanSpy:
    spy = PlanSpy()
    patched = []
    for name, module in list(sys.modules.items()):
        if (name.startswith("netdist.checkpoint")
                and getattr(module, "plan_writes", None) is spy.real):
            monkeypatch.setattr(module, "plan_writes", spy)
            patched.append(name)
    assert "netdist.checkpoint.planner" in patched and "netdist.checkpoint.writing" in patched
    return spy


@pytest.mark.parametrize("n", [1, 2])
def test_save_distributed_plans_once_per_rank_and_save(tmp_path: Path, plans: PlanSpy,
                                                       n: int) -> None:
    meta = flat_shard_metadata(FULL, n)
    for step in (1, 2):
        for rank in range(n):
            result = save_distributed(shard_state_dict(FULL, meta, rank), tmp_path, rank, n,
                                      meta, step=step)
            assert len(plans.take()) == 1, f"rank {rank}, step {step}"
            assert result.committed == (rank == n - 1)
    # the same without a step (written in place), the other layout of the per-rank API
    for rank in range(n):
        result = save_distributed(shard_state_dict(FULL, meta, rank), tmp_path / "flat",
                                  rank, n, meta)
        assert len(plans.take()) == 1
        assert result.committed == (rank == n - 1) and result.step is None
    for directory in (tmp_path, tmp_path / "flat"):
        got = load_distributed(directory, 0, 1)
        for name, value in FULL.items():
            np.testing.assert_array_equal(got[name], value)


@pytest.mark.parametrize("n", [1, 2])
async def test_async_checkpointer_plans_once_per_rank_and_save(tmp_path: Path,
                                                               plans: PlanSpy, n: int) -> None:
    meta = flat_shard_metadata(FULL, n)
    checkpointers = [AsyncCheckpointer(tmp_path, rank, n, meta) for rank in range(n)]
    try:
        for rank, ckpt in enumerate(checkpointers):
            ckpt.reserve(shard_state_dict(FULL, meta, rank))  # stages, does not plan
        assert plans.take() == []
        for step in (1, 2):
            for rank, ckpt in enumerate(checkpointers):
                result = await ckpt.save_async(shard_state_dict(FULL, meta, rank), step=step)
                assert len(plans.take()) == 1, f"rank {rank}, step {step}"
                assert result.committed == (rank == n - 1)
    finally:
        for ckpt in checkpointers:
            await ckpt.aclose()
    got = load_distributed(tmp_path, 0, 1, step=2)
    for name, value in FULL.items():
        np.testing.assert_array_equal(got[name], value)


def collective_state(rank: int, n: int, *, diverge: bool) -> dict[str, Any]:
    lo, hi = chunk_bounds(11, n)[rank]
    return {"model": {"w": ShardedArray(FULL["w"][lo:hi]),
                      "b": np.arange(4.0) + (rank if diverge else 0)},
            "step": 7}


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("diverge", [False, True], ids=["replicas-equal", "replicas-differ"])
async def test_collective_save_plans_once_per_rank_and_save(tmp_path: Path, plans: PlanSpy,
                                                            n: int, diverge: bool) -> None:
    async def body(g: Group) -> Any:
        RANK.set(g.rank)
        return await save(collective_state(g.rank, n, diverge=diverge), tmp_path, g,
                          timeout=OP_TIMEOUT)

    for step in (0, 1):
        if diverge and n > 1:  # rank 0's copies are pinned as the writers: still one plan
            with pytest.warns(ReplicaDivergenceWarning):
                results = await run_ranks(n, body)
        else:
            results = await run_ranks(n, body)
        assert Counter(plans.take()) == {rank: 1 for rank in range(n)}, f"step {step}"
        assert [r.step for r in results] == [step] * n
        assert [r.committed for r in results] == [rank == 0 for rank in range(n)]

    got = load_distributed(tmp_path, 0, 1)
    np.testing.assert_array_equal(got["model.w"], FULL["w"])
    np.testing.assert_array_equal(got["model.b"], np.arange(4.0))


def test_run_inline_refuses_a_coroutine_that_waits() -> None:
    async def waits() -> None:
        await asyncio.sleep(0)

    with pytest.raises(RuntimeError, match="tried to wait for an event loop"):
        run_inline(waits())
