"""DiLoCo in an elastic job: one elastic step is one outer step.

::

    diloco = ElasticDiLoCo(params, sync_every=H)              # outer=OuterSGD() by default
    with netdist.elastic.connect(diloco.state, sampler=sampler) as job:
        while job.step < outer_steps:
            job.run_step(lambda ctx: diloco.step_blocking(ctx, inner_step))

Every member keeps the *global* model and the outer optimizer's momentum; they are the
``ElasticState`` (``global.<i>`` and ``outer_momentum.<i>``), so a joiner fetches them from
the donors, verified by hash. A step (``step`` on the asyncio API, ``step_blocking`` on
the blocking one):

1. copies the global model into the live parameters (the local model);
2. cuts ``ctx.batch`` (this member's sample ids) into ``sync_every`` micro-batches
   (``np.array_split``; empty ones are skipped) and calls ``inner_step(ids)`` on each:
   the user's forward, backward and inner optimizer step on the live parameters;
3. sums ``(global - local) * len(ctx.batch)`` over the members (``ctx.all_reduce``) and
   divides by ``ctx.global_count``: the outer gradient is the sample-weighted mean, so
   it does not depend on how many members there are (the elastic rule for gradients);
4. on commit only: the outer optimizer steps the global model with it (in place, the
   momentum in the state's arrays) and the local model restarts from the new global one.

Nothing changes the state outside the commit, so a discarded step runs again from the
same global model, and every member ends each step with the same bits (the all-reduce
result is identical everywhere and the outer step is elementwise NumPy). What the inner
optimizer keeps (Adam moments) is not in the state: use a stateless inner optimizer or
reset it at the start of each outer step, or add its arrays with ``state.add``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from netdist.errors import ConfigError
from netdist.parallel.diloco import param_array
from netdist.parallel.outer_optim import OuterSGD

from netdist.elastic.state import ElasticState

if TYPE_CHECKING:
    from netdist.elastic.blocking import BlockingStepContext
    from netdist.elastic.job import StepContext

__all__ = ["ElasticDiLoCo"]

_KEY = "elastic_diloco"


class ElasticDiLoCo:
    """DiLoCo where one elastic step = one outer step (see the module docstring)."""

    def __init__(self, params: Sequence[Any], *, sync_every: int = 50,
                 outer: OuterSGD | None = None) -> None:
        if sync_every < 1:
            raise ConfigError(f"sync_every must be >= 1, got {sync_every}")
        self.params = list(params)
        if not self.params:
            raise ConfigError("ElasticDiLoCo got an empty parameter list")
        arrays = self._local()
        for i, a in enumerate(arrays):
            if a.dtype not in (np.float32, np.float64):
                raise ConfigError(f"ElasticDiLoCo parameter {i}: float32 or float64 "
                                  f"parameters only, got {a.dtype}")
        self.sync_every = sync_every
        self.outer = OuterSGD() if outer is None else outer
        self.global_arrays = [np.array(a, copy=True, order="C") for a in arrays]
        """The global model (live; parameter order): identical on every member."""
        self.momentum = [np.zeros_like(g) for g in self.global_arrays]
        """The outer optimizer's momentum (live; zeros before the first outer step)."""
        self.outer.adopt_buffers(_KEY, self.momentum)
        dtypes = {a.dtype for a in arrays}
        self._wire = dtypes.pop() if len(dtypes) == 1 else np.dtype(np.float64)
        named: dict[str, np.ndarray] = {}
        named.update({f"global.{i}": g for i, g in enumerate(self.global_arrays)})
        named.update({f"outer_momentum.{i}": m for i, m in enumerate(self.momentum)})
        self.state = ElasticState(named)
        """What the job keeps in step and a joiner fetches."""

    # -- the step, in three parts --------------------------------------------------------

    def _local(self) -> list[np.ndarray]:
        return [param_array(p, i) for i, p in enumerate(self.params)]

    def _inner(self, batch: np.ndarray | None,
               inner_step: Callable[[np.ndarray], None]) -> np.ndarray:
        """Restart from global, run the inner steps; the weighted outer gradient, flat."""
        if batch is None:
            raise ValueError("ElasticDiLoCo needs the job's sampler (connect(..., "
                             "sampler=...)) to weight the members' outer gradients")
        local = self._local()
        for x, g in zip(local, self.global_arrays):
            np.copyto(x, g)
        for ids in np.array_split(np.asarray(batch), self.sync_every):
            if len(ids):
                inner_step(ids)
        local = self._local()
        for i, (x, g) in enumerate(zip(local, self.global_arrays)):
            if x.shape != g.shape or x.dtype != g.dtype:
                raise ConfigError(f"ElasticDiLoCo parameter {i} changed from {g.shape} "
                                  f"{g.dtype} to {x.shape} {x.dtype}")
        payload = np.concatenate([(g - x).reshape(-1).astype(self._wire, copy=False)
                                  for x, g in zip(local, self.global_arrays)])
        payload *= self._wire.type(len(batch))
        return payload

    def _register(self, ctx: StepContext | BlockingStepContext, total: Any) -> None:
        """On commit: the outer step with the sample-weighted mean, then local = global."""
        count = ctx.global_count
        if count <= 0:
            return  # no sample in the step: nothing moved

        def commit() -> None:
            mean = np.asarray(total) / self._wire.type(count)
            grads, offset = [], 0
            for g in self.global_arrays:
                grads.append(mean[offset:offset + g.size].reshape(g.shape)
                             .astype(g.dtype, copy=False))
                offset += g.size
            self.outer.step(_KEY, self.global_arrays, grads)
            for x, g in zip(self._local(), self.global_arrays):
                np.copyto(x, g)

        ctx.on_commit(commit)

    async def step(self, ctx: StepContext, inner_step: Callable[[np.ndarray], None]) -> None:
        """One outer step on the asyncio API (``await job.run_step(lambda ctx: ...)``)."""
        payload = self._inner(ctx.batch, inner_step)
        total = await ctx.all_reduce(payload)
        self._register(ctx, total)

    def step_blocking(self, ctx: BlockingStepContext,
                      inner_step: Callable[[np.ndarray], None]) -> None:
        """One outer step on the blocking API (``job.run_step(lambda ctx: ...)``)."""
        payload = self._inner(ctx.batch, inner_step)
        total = ctx.all_reduce(payload)
        self._register(ctx, total)
