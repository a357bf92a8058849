"""One data-parallel training step: compute local gradients, average them, apply them.

With ``overlap=True`` the gradients' all-reduce overlaps with backward (PyTorch DDP's
gradient buckets): the compute function runs in a worker thread and reports each
gradient as soon as it is final; a bucket is launched on the event loop as soon as all of
its gradients are final, so by the time backward ends most buckets are already on the
wire or done. NumPy releases the GIL in its large kernels, so backward on the worker
thread and the transport on the loop's thread run at the same time.
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import threading
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import numpy as np

from netdist.errors import CollectiveError
from netdist.parallel.aggregators import GradientAggregator, OverlapAggregator, OverlapSession

__all__ = ["distributed_train_step", "GradReady"]

T = TypeVar("T")
LossAndGrads = tuple[float, Sequence[np.ndarray]]
ComputeFn = Callable[..., LossAndGrads | Awaitable[LossAndGrads]]
ApplyFn = Callable[[list[np.ndarray]], Any]

_THREAD_NAME = "netdist-backward"


class GradReady:
    """The ``ready`` callback ``distributed_train_step(overlap=True)`` hands to compute.

    ``ready(p)`` marks one gradient final: ``p`` is one of the step's ``params`` (a
    ``netdist.train.Parameter``, anything with an ndarray ``.grad``, or the gradient
    array itself) or its index in ``params``. Its signature is the nn kit's
    ``on_grad_ready`` hook, so ``model.backward(ctx, g, on_grad_ready=ready)`` wires a
    ``Sequential`` straight to the aggregator. Callable from any thread.
    """

    __slots__ = ("_params", "_index", "_session")

    def __init__(self, params: Sequence[Any], session: OverlapSession | None) -> None:
        self._params = list(params)
        self._index = {id(p): i for i, p in enumerate(self._params)}
        self._session = session

    def __call__(self, which: Any) -> None:
        """Report ``which`` (a parameter of the step, or its index) as final."""
        i = self._resolve(which)
        if self._session is not None:
            self._session.ready(i, _grad_of(self._params[i], i))

    def _resolve(self, which: Any) -> int:
        if isinstance(which, (int, np.integer)) and not isinstance(which, bool):
            i = int(which)
            if not 0 <= i < len(self._params):
                raise CollectiveError(f"ready({i}): the step has {len(self._params)} "
                                      "parameters")
            return i
        i = self._index.get(id(which), -1)
        if i < 0:
            name = getattr(which, "name", type(which).__name__)
            raise CollectiveError(f"ready() got {name!r}, which is not one of the step's "
                                  f"{len(self._params)} params")
        return i


def _grad_of(param: Any, i: int) -> np.ndarray:
    """The gradient array of ``params[i]``: the array itself, or its ``.grad``."""
    grad = param if isinstance(param, np.ndarray) else getattr(param, "grad", None)
    if not isinstance(grad, np.ndarray):
        raise TypeError(f"params[{i}] ({type(param).__name__}) has no ndarray gradient; "
                        "pass Parameters, objects with an ndarray .grad, or the arrays")
    return grad


async def distributed_train_step(compute_gradients_fn: ComputeFn, apply_gradients_fn: ApplyFn,
                                 aggregator: GradientAggregator, *, overlap: bool = False,
                                 params: Sequence[Any] | None = None) -> float:
    """Run ``compute -> aggregate -> apply`` once and return this rank's local loss.

    ``compute_gradients_fn()`` (plain or ``async``) returns ``(loss, grads)`` for this
    rank's batch; ``aggregator.aggregate(grads)`` averages the gradients over all ranks;
    ``apply_gradients_fn(averaged)`` (plain or ``async``) updates the model, typically by
    setting ``param.grad`` and calling ``optimizer.step()``. Every rank must call this
    the same number of times, as with any collective. Errors from the aggregator (a lost
    peer, a timeout) propagate unchanged and the model is left un-updated.

    ``overlap=True`` overlaps the all-reduce with backward. ``params`` is then required:
    the parameters whose gradients ``compute`` returns, in the same order (see
    ``GradReady``). ``compute_gradients_fn(ready)`` is called with a ``GradReady`` and
    must report each gradient once it is final (``model.backward(ctx, g,
    on_grad_ready=ready)``); a plain function runs in a worker thread while the event
    loop moves the buckets, an ``async`` one on the loop. Gradients it does not report
    are taken from the ``grads`` it returns, which must be the same arrays as the params'
    gradients. The averages are bitwise those of ``overlap=False``. An aggregator without
    ``begin`` (``TopKAggregator``, the parameter-server aggregators, ``LocalAggregator``)
    falls back to aggregating after backward, still computing in the worker thread.

    Failures with ``overlap=True``: a collective's error is raised here; a backward still
    running stops at its next ``ready`` (which raises), and the step returns only after
    the worker thread has ended. An exception from backward closes the aggregator's
    session (nothing more is launched, buckets in flight are cancelled) and is raised
    unchanged; the step is then lost on every rank (see ``OverlapSession``). If the
    step itself is cancelled, the session is closed and the worker thread ends at its
    next ``ready`` or when backward returns.
    """
    if not overlap:
        result = compute_gradients_fn()
        if inspect.isawaitable(result):
            result = await result
        loss, grads = _unpack(result)
        averaged = await aggregator.aggregate(list(grads))
    else:
        if params is None:
            raise TypeError("distributed_train_step(overlap=True) needs params=: the "
                            "parameters whose gradients compute_gradients_fn returns")
        loss, averaged = await _overlapped(compute_gradients_fn, aggregator, list(params))
    applied = apply_gradients_fn(averaged)
    if inspect.isawaitable(applied):
        await applied
    return float(loss)


def _unpack(result: Any) -> tuple[Any, Sequence[np.ndarray]]:
    try:
        loss, grads = result
    except (TypeError, ValueError) as exc:
        raise TypeError("compute_gradients_fn must return (loss, grads)") from exc
    return loss, grads


async def _overlapped(compute: ComputeFn, aggregator: GradientAggregator,
                      params: list[Any]) -> tuple[Any, list[np.ndarray]]:
    """compute(ready) with the aggregator's session open, then finish it."""
    if not isinstance(aggregator, OverlapAggregator):
        loss, grads = _unpack(await _run_compute(compute, GradReady(params, None)))
        return loss, await aggregator.aggregate(list(grads))
    session = aggregator.begin([_grad_of(p, i) for i, p in enumerate(params)])
    try:
        loss, grads = _unpack(await _run_compute(compute, GradReady(params, session)))
    except BaseException:
        await session.aclose()
        if session.error is not None:  # the network failed first; backward saw it in ready()
            raise session.error from None
        raise
    return loss, await session.finish(grads)


async def _run_compute(compute: ComputeFn, ready: GradReady) -> Any:
    """``compute(ready)``: awaited on the loop if it is async, else in a worker thread."""
    if inspect.iscoroutinefunction(compute):
        return await compute(ready)
    result = await _in_thread(compute, ready)
    if inspect.isawaitable(result):
        return await result
    return result


async def _in_thread(fn: Callable[..., T], *args: Any) -> T:
    """Run ``fn(*args)`` on a fresh thread (joined before returning) and await it.

    A thread of its own rather than the loop's default executor, so a step leaves no
    thread behind: the thread has ended when this returns or raises. Cancelling the
    caller does not stop the thread (Python cannot); it ends when ``fn`` returns.
    """
    loop = asyncio.get_running_loop()
    done: asyncio.Future[T] = loop.create_future()
    context = contextvars.copy_context()

    def settle(result: Any, error: BaseException | None) -> None:
        if done.done():  # the awaiting task was cancelled
            return
        if error is None:
            done.set_result(result)
        else:
            done.set_exception(error)

    def main() -> None:
        try:
            result = context.run(fn, *args)
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting task
            _call_soon(loop, settle, None, exc)
        else:
            _call_soon(loop, settle, result, None)

    thread = threading.Thread(target=main, name=_THREAD_NAME, daemon=True)
    thread.start()
    try:
        return await done
    finally:
        if not done.cancelled():
            thread.join()  # it has posted its outcome: only its return is left


def _call_soon(loop: asyncio.AbstractEventLoop, fn: Callable[..., None], *args: Any) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:
        pass  # the loop closed while we computed: nobody is waiting any more
