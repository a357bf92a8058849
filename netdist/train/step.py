"""One data-parallel training step: compute local gradients, average them, apply them."""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import numpy as np

from netdist.parallel.aggregators import GradientAggregator

__all__ = ["distributed_train_step"]

LossAndGrads = tuple[float, Sequence[np.ndarray]]
ComputeFn = Callable[[], LossAndGrads | Awaitable[LossAndGrads]]
ApplyFn = Callable[[list[np.ndarray]], Any]


async def distributed_train_step(compute_gradients_fn: ComputeFn, apply_gradients_fn: ApplyFn,
                                 aggregator: GradientAggregator) -> float:
    """Run ``compute -> aggregate -> apply`` once and return this rank's local loss.

    ``compute_gradients_fn()`` (plain or ``async``) returns ``(loss, grads)`` for this
    rank's batch; ``aggregator.aggregate(grads)`` averages the gradients over all ranks;
    ``apply_gradients_fn(averaged)`` (plain or ``async``) updates the model, typically by
    setting ``param.grad`` and calling ``optimizer.step()``. Every rank must call this
    the same number of times, as with any collective. Errors from the aggregator (a lost
    peer, a timeout) propagate unchanged and the model is left un-updated.
    """
    result = compute_gradients_fn()
    if inspect.isawaitable(result):
        result = await result
    try:
        loss, grads = result
    except (TypeError, ValueError) as exc:
        raise TypeError("compute_gradients_fn must return (loss, grads)") from exc
    averaged = await aggregator.aggregate(list(grads))
    applied = apply_gradients_fn(averaged)
    if inspect.isawaitable(applied):
        await applied
    return float(loss)
