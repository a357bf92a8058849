"""``GradientSync``: average a torch model's gradients with netdist's own aggregators.

::

    import netdist
    from netdist.parallel.aggregators import AllReduceAggregator
    from netdist.torch.gradient_sync import GradientSync

    with netdist.connect() as job:
        sync = GradientSync(job, model, job.make(AllReduceAggregator, job.group),
                            overlap=True)
        for x, y in batches:
            optimizer.zero_grad()              # set_to_none=True (torch's default) is fine
            loss_fn(model(x), y).backward()    # overlap=True: buckets travel during backward
            sync.sync()                        # every param.grad is now the average
            optimizer.step()

The aggregator runs on the job's progress thread (build it with ``job.make(...)``; a bare
aggregator made elsewhere is wrapped with ``job.blocking``). ``sync()`` hands the
gradients to it after backward and blocks until every ``param.grad`` holds the average,
written in place. With ``overlap=True`` and an aggregator that can overlap
(``AllReduceAggregator``, ``Fp16AllReduceAggregator``: they have ``begin``), a
``register_post_accumulate_grad_hook`` on every parameter reports each gradient to the
step's ``OverlapSession`` as soon as autograd has finished accumulating it, so a bucket's
all-reduce starts while backward is still computing earlier layers (DDP's reducer);
``sync()`` then only waits for the last buckets. Aggregators without ``begin``
(``TopKAggregator``, the parameter-server aggregators) are used after backward, exactly
as with ``overlap=False``.

Gradients are read from ``param.grad`` at the moment they are reported, never cached
across steps, so ``optimizer.zero_grad(set_to_none=True)`` (which makes autograd
allocate fresh gradient tensors on the next backward) needs nothing special. A
trainable parameter that got no gradient in a step (an unused branch) gets a zero
gradient before the exchange, so every rank issues the same collectives; this differs
from DDP, which raises unless ``find_unused_parameters=True``.

One backward per ``sync()`` in overlap mode: each gradient is reported once per step,
so gradient accumulation over several backward passes needs ``overlap=False`` (or
``with sync.paused():`` around all but the last backward).

Parameter servers. The rank-0 ``netdist.ps.ParameterServer`` is an aggregator like the
others: ``sync()`` leaves the average in every ``.grad`` and the local optimizer steps.
With an aggregator that returns *parameters* (``returns_parameters``:
``netdist.ps.ServerOptimizerAggregator`` over a ``PSClient`` or ``ColocatedPS``, in any
mode: synchronous, bounded staleness, asynchronous) the optimizer runs on the servers
instead::

    ps = job.make(ColocatedPS, job.group, num_servers=1)
    updates = job.make(ServerOptimizerAggregator, ps, optimizer=SGDConfig(lr=0.05),
                       max_staleness=2)
    sync = GradientSync(job, model, updates)   # registers the model with the servers
    for x, y in batches:
        model.zero_grad()
        loss_fn(model(x), y).backward()
        sync.sync()                            # push .grad, pull the new parameters
    ps.close()                                 # a server rank waits for every worker

Building the ``GradientSync`` calls the aggregator's ``init`` with the parameters (every
rank must build it: the first worker's values become every rank's model), and
``sync()`` pushes the gradients and writes the servers' new parameters into the
parameters in place; there is no local ``optimizer.step()`` (``.grad`` keeps this
rank's own gradient). Under a staleness bound ``sync()`` may wait for slower ranks.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from netdist.progress.proxy import Blocking, unwrap

__all__ = ["GradientSync"]


class GradientSync:
    """Averages the gradients of ``model`` across a netdist job's ranks, in place.

    ``model`` is a ``torch.nn.Module`` or an iterable of parameters; the trainable ones
    (``requires_grad``, each shared parameter once, in registration order) are
    synchronised. Every rank must build its ``GradientSync`` over parameters of the same
    shapes and dtypes in the same order. ``aggregator`` defaults to
    ``job.make(AllReduceAggregator, job.group)`` (ring all-reduce, mean). See the module
    docstring for ``overlap``.

    ``grad_as_bucket_view=True`` (``AllReduceAggregator`` only, DDP's
    ``gradient_as_bucket_view``): every ``param.grad`` is a view into the aggregator's
    all-reduce buckets, so backward accumulates into the buckets and nothing is copied
    before or after the all-reduce. A forward pre-hook re-binds the (zeroed) views to
    gradients that ``zero_grad(set_to_none=True)`` reset to None; a gradient that backward
    allocated elsewhere anyway (zero_grad between forward and backward) is copied into its
    view once and the view re-bound. Do not use the aggregator for other layouts meanwhile:
    that re-plans its buckets and the views stop being the buckets.

    An aggregator with ``returns_parameters`` (``netdist.ps.ServerOptimizerAggregator``)
    runs the optimizer on parameter servers: building the ``GradientSync`` calls its
    ``init(parameters)``, and ``sync()`` writes the new parameters into the model (see
    the module docstring).
    """

    def __init__(self, job: Any, model: torch.nn.Module | Iterable[torch.nn.Parameter],
                 aggregator: Any = None, *, overlap: bool = False,
                 grad_as_bucket_view: bool = False) -> None:
        if isinstance(model, torch.nn.Module):
            candidates = list(model.parameters())  # parameters() already skips duplicates
        else:
            candidates = list(model)
        seen: set[int] = set()
        params: list[torch.nn.Parameter] = []
        for p in candidates:
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"expected torch parameters, got {type(p).__name__}")
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                params.append(p)
        for i, p in enumerate(params):
            if p.device.type != "cpu":
                raise ValueError(f"parameter {i} is on {p.device}; netdist aggregators "
                                 "average CPU tensors (move the model to the CPU)")
        if aggregator is None:
            from netdist.parallel.aggregators import AllReduceAggregator
            aggregator = job.make(AllReduceAggregator, job.group)
        elif not isinstance(aggregator, Blocking):
            aggregator = job.blocking(aggregator)
        self.job = job
        self.aggregator: Blocking = aggregator
        """The aggregator, as a blocking proxy on the job's progress thread."""
        self.params: tuple[torch.nn.Parameter, ...] = tuple(params)
        self.updates_parameters = bool(getattr(unwrap(aggregator), "returns_parameters",
                                               False))
        """True if the aggregator returns new parameters (the optimizer runs on parameter
        servers): ``sync()`` writes them into the parameters; no local optimizer step."""
        if self.updates_parameters and grad_as_bucket_view:
            raise ValueError("grad_as_bucket_view needs an all-reduce aggregator, not one "
                             "that returns parameters")
        self.overlap = bool(overlap) and hasattr(unwrap(aggregator), "begin")
        """True if gradients are reported during backward (``overlap=True`` and the
        aggregator has ``begin``)."""
        if self.updates_parameters and hasattr(unwrap(aggregator), "init"):
            aggregator.init(list(params))  # the servers' initial values, into the model
        self.steps = 0
        self._like = [torch.empty_like(p, memory_format=torch.contiguous_format).detach()
                      for p in params]
        self._session: Any = None
        self._lock = threading.Lock()
        self._paused = False
        self._handles: list[Any] = []
        self._views: list[torch.Tensor] | None = None
        if grad_as_bucket_view:
            if not isinstance(model, torch.nn.Module):
                raise TypeError("grad_as_bucket_view needs the model (a torch.nn.Module): "
                                "the views are bound to .grad by a forward pre-hook")
            self._views = list(aggregator.bucket_views(self._like))
            self._handles.append(model.register_forward_pre_hook(self._bind_views))
        if self.overlap:
            for i, p in enumerate(params):
                self._handles.append(p.register_post_accumulate_grad_hook(self._hook(i)))

    # -- overlap: reporting gradients as autograd finishes them ---------------------------

    def _hook(self, i: int) -> Any:
        def on_grad_final(param: torch.Tensor) -> None:
            if self._paused:
                return
            self._current_session().ready(i, self._bound_grad(i))
        return on_grad_final

    def _current_session(self) -> Any:
        """This step's session, opened by the first gradient that becomes final."""
        with self._lock:
            if self._session is None:
                self._session = self.aggregator.begin(self._like)
            return self._session

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Backward passes inside this block report nothing (gradient accumulation)."""
        self._paused = True
        try:
            yield
        finally:
            self._paused = False

    # -- the step ------------------------------------------------------------------------

    def _bind_views(self, *_: object) -> None:
        """Forward pre-hook (``grad_as_bucket_view``): a parameter whose ``.grad`` is None
        (``zero_grad(set_to_none=True)``) gets its zeroed bucket view back, so the coming
        backward accumulates straight into the bucket."""
        if self._views is None:
            return
        for p, view in zip(self.params, self._views):
            if p.grad is None:
                view.zero_()
                p.grad = view

    def _bound_grad(self, i: int) -> torch.Tensor:
        """Parameter ``i``'s gradient (zeros if it has none); with bucket views, moved
        into its view (one copy) if backward left it elsewhere, and the view re-bound."""
        p = self.params[i]
        if self._views is None:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            return p.grad
        view = self._views[i]
        if p.grad is None:
            view.zero_()
            p.grad = view
        elif p.grad.data_ptr() != view.data_ptr() or p.grad.stride() != view.stride():
            view.copy_(p.grad)
            p.grad = view
        return view

    def _grads(self) -> list[torch.Tensor]:
        """Every parameter's gradient (see ``_bound_grad``)."""
        return [self._bound_grad(i) for i in range(len(self.params))]

    def sync(self) -> None:
        """Block until every parameter's ``.grad`` holds the average over all ranks
        (or, with ``updates_parameters``, every parameter holds the servers' new value).

        Call it after ``loss.backward()`` and before ``optimizer.step()``, on every rank.
        A collective's error (``PeerLostError``, a timeout) is raised here; the
        gradients then hold a mix of averaged and local values: treat the step as lost.
        """
        with self._lock:
            session, self._session = self._session, None
        grads = self._grads()
        if session is not None:
            try:
                results = session.finish(grads)
            except BaseException:
                with contextlib.suppress(Exception):
                    session.aclose()
                raise
        else:
            results = self.aggregator.aggregate(grads)
        targets = self.params if self.updates_parameters else grads
        with torch.no_grad():
            for t, r in zip(targets, results):
                if r is not t:  # a fresh result (not written in place)
                    t.copy_(r)
        self.steps += 1

    def close(self) -> None:
        """Remove the hooks and abandon a step begun but not synced. Idempotent."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        with self._lock:
            session, self._session = self._session, None
        if session is not None:
            session.aclose()

    def __enter__(self) -> GradientSync:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        mode = "overlapped" if self.overlap else "after backward"
        return (f"<GradientSync {len(self.params)} parameters, {mode}, "
                f"{type(unwrap(self.aggregator)).__name__}, {self.steps} steps>")
