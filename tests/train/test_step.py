"""distributed_train_step with sync and async callbacks."""

from __future__ import annotations

import numpy as np
import pytest

from netdist.parallel.aggregators import GradientAggregator, LocalAggregator
from netdist.train.step import distributed_train_step


async def test_sync_callbacks_with_local_aggregator():
    applied = []
    grads = [np.array([1.0, 2.0]), np.array([[3.0]])]

    def compute():
        return 0.5, grads

    def apply(avg):
        applied.append(avg)

    agg = LocalAggregator()
    assert isinstance(agg, GradientAggregator)
    loss = await distributed_train_step(compute, apply, agg)
    assert loss == 0.5 and isinstance(loss, float)
    assert applied[0][0] is grads[0] and applied[0][1] is grads[1]
    assert agg.bytes_sent == 0 and agg.steps == 1


async def test_async_callbacks_and_ordering():
    events = []

    class Recording:
        bytes_sent = 0

        async def aggregate(self, grads):
            events.append("aggregate")
            return [g * 2 for g in grads]

    async def compute():
        events.append("compute")
        return np.float64(1.25), (np.ones(3),)

    async def apply(avg):
        events.append(("apply", avg[0].tolist()))

    loss = await distributed_train_step(compute, apply, Recording())
    assert loss == 1.25
    assert events == ["compute", "aggregate", ("apply", [2.0, 2.0, 2.0])]


async def test_bad_compute_result_and_aggregator_errors_propagate():
    with pytest.raises(TypeError, match=r"\(loss, grads\)"):
        await distributed_train_step(lambda: 3.0, lambda g: None, LocalAggregator())

    class Failing:
        bytes_sent = 0

        async def aggregate(self, grads):
            raise RuntimeError("peer gone")

    applied = []
    with pytest.raises(RuntimeError, match="peer gone"):
        await distributed_train_step(lambda: (1.0, [np.zeros(1)]), applied.append, Failing())
    assert applied == []


async def test_local_aggregator_rejects_non_float():
    with pytest.raises(TypeError, match="floating"):
        await LocalAggregator().aggregate([np.arange(3)])
