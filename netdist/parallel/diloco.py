"""DiLoCo, Streaming DiLoCo and LocalSGD: synchronise a model every H steps, not every step.

Over slow links (between sites, clouds, across the internet) averaging gradients every
step leaves the accelerators idle: 100 Mbit/s moves a 100 MB gradient in 8 s. These
modes let every worker take ``H`` optimizer steps on its own data (the *inner* steps,
with any optimizer: netdist's, torch's, your own), then exchange once:

- ``DiLoCo`` (Douillard et al. 2023): every rank keeps a copy of the *global* model.
  After ``H`` inner steps the *outer gradient* ``global - local`` is averaged over the
  ranks (``ReduceOp.MEAN``, optionally quantized to int8 or 4 bits:
  ``netdist.collectives.QuantizedReducer``) and an outer optimizer (``OuterSGD``: SGD
  with Nesterov momentum, lr 0.7, momentum 0.9) applies it to the global model; the
  local model then restarts from the new global one. The averaged outer gradient is
  bitwise identical on every rank and so are the global model and the outer momentum,
  so the outer step needs no further exchange and every rank computes the same bits.
- Streaming (Douillard et al. 2025): with ``fragments=F`` the model is cut into ``F``
  contiguous fragments (``netdist.parallel.fragments``) synchronised at staggered steps,
  each once every ``H`` steps. With ``fragment_sync_delay=d`` a fragment's exchange is
  launched on the event loop and left running behind the next ``d`` inner steps; when it
  is collected, the new global fragment is merged into the local one as ``local = a *
  local + (1 - a) * global`` (``fragment_mixing=a``; ``0`` replaces the local fragment).
- ``LocalSGD``: the parameters themselves are averaged every ``H`` steps (no outer
  optimizer, no global copy).

Using it: call ``await diloco.step()`` after every inner optimizer step, and ``await
diloco.finish()`` once at the end (it collects exchanges still in flight). From ordinary
synchronous code (torch training loops) build it on a job's progress thread, ``diloco =
job.make(DiLoCo, job.group, model.parameters(), config)``, and call ``diloco.step()``:
the exchange then runs on the progress thread while the caller computes the next inner
steps, which is what hides it. On the caller's own event loop an exchange only moves
while the caller awaits something; inner steps computed on that loop do not hide it.

Parameters are NumPy arrays, CPU torch tensors (``model.parameters()``) or netdist
``Parameter`` objects, updated in place, float32 or float64 (quantization: float32).
Every rank must pass the same shapes in the same order and call ``step`` the same number
of times: the schedule is the same pure function of the step count everywhere, so the
collectives are issued in the same order.

``records`` keeps one ``SyncRecord`` per completed exchange: how long it took on the
loop, how long ``step`` waited for it (``exposed_s``; what streaming hides is the
difference) and the payload bytes this rank handed to the collective.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from netdist.collectives.group import Group
from netdist.errors import ConfigError, NetdistError
from netdist.parallel.fragments import FragmentSchedule, split_fragments
from netdist.parallel.outer_optim import OuterOptimizer, OuterSGD
from netdist.tensors import as_array, is_tensor
from netdist.types import ReduceOp

if TYPE_CHECKING:
    from netdist.compression.quantize import Quantization

__all__ = ["DiLoCo", "DiLoCoConfig", "LocalSGD", "SyncRecord", "param_array"]


@dataclass(frozen=True, slots=True)
class DiLoCoConfig:
    """How often and how a ``DiLoCo`` (or ``LocalSGD``) synchronises."""

    sync_every: int = 50
    """Inner steps between two synchronisations of a fragment (DiLoCo's H)."""
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    nesterov: bool = True
    quantization: Quantization | str | None = None
    """Quantize the exchanged values (``"int8"``, ``"int4"``, ``Quantization(...)``);
    None: exchange them in the parameters' dtype."""
    error_feedback: bool = False
    """Keep what quantization dropped and add it to the next exchange."""
    fragments: int = 1
    """Streaming: cut the model into this many fragments synchronised at staggered steps."""
    fragment_sync_delay: int = 0
    """Streaming: inner steps a fragment's exchange runs behind before it is collected
    (``< sync_every // fragments``)."""
    fragment_mixing: float = 0.0
    """Streaming: weight of the local fragment when the new global one is merged in."""
    timeout: float | None = None
    """Bound on each exchange (None: the group's)."""

    def __post_init__(self) -> None:
        FragmentSchedule(self.sync_every, self.fragments, self.fragment_sync_delay)
        if not 0 <= self.fragment_mixing < 1:
            raise ConfigError(f"fragment_mixing must be in [0, 1), got {self.fragment_mixing}")
        if self.timeout is not None and not (math.isfinite(self.timeout) and self.timeout > 0):
            raise ConfigError(f"timeout must be a finite number of seconds > 0, got "
                              f"{self.timeout}")
        if isinstance(self.quantization, str):
            from netdist.compression.quantize import Quantization

            object.__setattr__(self, "quantization", Quantization.parse(self.quantization))
        if self.error_feedback and self.quantization is None:
            raise ConfigError("error_feedback needs a quantization")

    @property
    def schedule(self) -> FragmentSchedule:
        return FragmentSchedule(self.sync_every, self.fragments, self.fragment_sync_delay)


@dataclass(frozen=True, slots=True)
class SyncRecord:
    """One completed exchange of one fragment."""

    fragment: int
    launched_after: int
    """The inner step after which the exchange started."""
    completed_after: int
    """The inner step after which it was collected and applied."""
    exchange_s: float
    """Seconds from the exchange's start to its end, on the event loop."""
    exposed_s: float
    """Seconds ``step`` waited for it: the part no inner step hid."""
    payload_bytes: int
    """Bytes this rank handed to the collective (quantized size when quantized)."""


@dataclass
class _Fragment:
    """One fragment's parameters, its global copy and its exchange in flight."""

    index: int
    indices: tuple[int, ...]
    global_copy: list[np.ndarray]
    buffer: np.ndarray
    offsets: list[int]
    pending: asyncio.Future[tuple[float, int]] | None = None
    launched_after: int = 0

    def views(self) -> list[np.ndarray]:
        """The exchange buffer cut into one view per parameter, each of its shape."""
        return [self.buffer[o:o + g.size].reshape(g.shape)
                for o, g in zip(self.offsets, self.global_copy)]


def param_array(param: Any, index: int) -> np.ndarray:
    """The live NumPy array behind one parameter (a view for tensors and Parameters)."""
    if isinstance(param, np.ndarray):
        return param
    if is_tensor(param):
        return as_array(param, f"DiLoCo parameter {index}", writeable=True)
    data = getattr(param, "data", None)
    if isinstance(data, np.ndarray):
        return data
    raise TypeError(f"DiLoCo parameter {index}: needs a numpy.ndarray, a CPU torch tensor or "
                    f"an object with a .data ndarray (netdist Parameter), got "
                    f"{type(param).__name__}")


@dataclass
class _Counters:
    inner_step: int = 0
    outer_steps: int = 0
    bytes_sent: int = 0
    records: list[SyncRecord] = field(default_factory=list)


class DiLoCo:
    """Synchronise ``params`` every ``sync_every`` inner steps; see the module docstring."""

    def __init__(self, group: Group, params: Iterable[Any],
                 config: DiLoCoConfig | None = None, *, outer: OuterOptimizer | None = None,
                 fragments: Sequence[Sequence[int]] | None = None) -> None:
        self.group = group
        self.config = config or DiLoCoConfig()
        self._params = list(params)
        if not self._params:
            raise ConfigError("DiLoCo got an empty parameter list")
        arrays = [param_array(p, i) for i, p in enumerate(self._params)]
        for i, a in enumerate(arrays):
            if a.dtype not in (np.float32, np.float64):
                raise ConfigError(f"DiLoCo parameter {i}: float32 or float64 parameters "
                                  f"only, got {a.dtype}")
            if self.config.quantization is not None and a.dtype != np.float32:
                raise ConfigError(f"DiLoCo parameter {i}: quantized exchanges take float32 "
                                  f"parameters, got {a.dtype}")
        self.outer: OuterOptimizer = outer or OuterSGD(
            self.config.outer_lr, self.config.outer_momentum, self.config.nesterov)
        self.schedule = self.config.schedule
        groups = self._fragment_indices(arrays, fragments)
        self._fragments = [self._make_fragment(p, idx, arrays) for p, idx in enumerate(groups)]
        self._reducer: Any = None
        if self.config.quantization is not None:
            from netdist.collectives.quantized import QuantizedReducer

            self._reducer = QuantizedReducer(group, self.config.quantization,
                                             error_feedback=self.config.error_feedback,
                                             timeout=self.config.timeout)
        self._counters = _Counters()

    # -- set-up ---------------------------------------------------------------------

    def _fragment_indices(self, arrays: list[np.ndarray],
                          fragments: Sequence[Sequence[int]] | None) -> list[tuple[int, ...]]:
        if fragments is None:
            return split_fragments([a.size for a in arrays], self.config.fragments)
        groups = [tuple(int(i) for i in f) for f in fragments]
        flat = sorted(i for g in groups for i in g)
        if flat != list(range(len(arrays))):
            raise ConfigError(f"fragments must list every parameter index 0..{len(arrays) - 1} "
                              f"exactly once, got {groups}")
        if len(groups) != self.config.fragments:
            raise ConfigError(f"{len(groups)} fragments given, config.fragments is "
                              f"{self.config.fragments}")
        return groups

    def _make_fragment(self, index: int, indices: tuple[int, ...],
                       arrays: list[np.ndarray]) -> _Fragment:
        chosen = [arrays[i] for i in indices]
        dtypes = {a.dtype for a in chosen}
        if len(dtypes) > 1:
            raise ConfigError(f"fragment {index}: parameters of one fragment share a dtype, "
                              f"got {sorted(str(d) for d in dtypes)}")
        offsets = list(np.cumsum([0] + [a.size for a in chosen[:-1]]))
        total = sum(a.size for a in chosen)
        return _Fragment(index, indices,
                         [np.array(a, copy=True) for a in chosen],
                         np.empty(total, dtype=chosen[0].dtype), [int(o) for o in offsets])

    # -- what a subclass changes --------------------------------------------------------

    def _fill(self, frag: _Fragment, local: list[np.ndarray]) -> None:
        """Write the values to exchange into ``frag.buffer``: the outer gradient."""
        for view, g, x in zip(frag.views(), frag.global_copy, local):
            np.subtract(g, x, out=view)

    def _apply(self, frag: _Fragment, local: list[np.ndarray]) -> None:
        """Use the averaged buffer: outer step on the global copy, then merge into local."""
        self.outer.step(f"fragment{frag.index}", frag.global_copy, frag.views())
        a = self.config.fragment_mixing
        for x, g in zip(local, frag.global_copy):
            if a == 0:
                np.copyto(x, g)
            else:
                x *= x.dtype.type(a)
                x += x.dtype.type(1 - a) * g

    # -- the loop -------------------------------------------------------------------------

    @property
    def inner_step(self) -> int:
        """Inner steps taken so far (calls of ``step``)."""
        return self._counters.inner_step

    @property
    def outer_steps(self) -> int:
        """Fragment exchanges completed so far."""
        return self._counters.outer_steps

    @property
    def bytes_sent(self) -> int:
        """Payload bytes this rank handed to the exchanges so far."""
        return self._counters.bytes_sent

    @property
    def records(self) -> list[SyncRecord]:
        """One ``SyncRecord`` per completed exchange, oldest first."""
        return self._counters.records

    @property
    def fragments(self) -> list[tuple[int, ...]]:
        """Parameter indices of each fragment."""
        return [f.indices for f in self._fragments]

    @property
    def pending(self) -> list[int]:
        """Fragments whose exchange is in flight."""
        return [f.index for f in self._fragments if f.pending is not None]

    async def step(self) -> list[SyncRecord]:
        """Count one inner step; collect and launch the exchanges the schedule says.

        Returns the records of the exchanges completed by this call (usually none).
        """
        c = self._counters
        c.inner_step += 1
        done = []
        for p in self.schedule.completed_after(c.inner_step):
            if self.schedule.delay > 0:
                done.append(await self._complete(self._fragments[p], c.inner_step))
        for p in self.schedule.launched_after(c.inner_step):
            frag = self._fragments[p]
            self._launch(frag, c.inner_step)
            if self.schedule.delay == 0:
                done.append(await self._complete(frag, c.inner_step))
        return done

    async def finish(self) -> list[SyncRecord]:
        """Collect every exchange still in flight (at the end of training), in fragment order."""
        return [await self._complete(f, self._counters.inner_step)
                for f in self._fragments if f.pending is not None]

    async def sync_now(self) -> list[SyncRecord]:
        """Synchronise every fragment now, outside the schedule (every rank must call it)."""
        done = await self.finish()
        for frag in self._fragments:
            self._launch(frag, self._counters.inner_step)
            done.append(await self._complete(frag, self._counters.inner_step))
        return done

    def _launch(self, frag: _Fragment, step: int) -> None:
        if frag.pending is not None:
            raise NetdistError(f"DiLoCo fragment {frag.index}: an exchange launched after "
                               f"step {frag.launched_after} is still in flight")
        self._fill(frag, self._local(frag))
        frag.launched_after = step
        frag.pending = asyncio.ensure_future(self._exchange(frag))

    async def _exchange(self, frag: _Fragment) -> tuple[float, int]:
        started = time.perf_counter()
        if self._reducer is not None:
            before = self._reducer.bytes_sent
            await self._reducer.all_reduce(frag.buffer, ReduceOp.MEAN, key=f"fragment{frag.index}")
            sent = self._reducer.bytes_sent - before
        else:
            await self.group.all_reduce(frag.buffer, ReduceOp.MEAN, timeout=self.config.timeout)
            sent = frag.buffer.nbytes
        return time.perf_counter() - started, sent

    async def _complete(self, frag: _Fragment, step: int) -> SyncRecord:
        if frag.pending is None:
            raise NetdistError(f"DiLoCo fragment {frag.index}: the schedule collects an "
                               f"exchange after step {step}, but none is in flight (was the "
                               "step count changed, by load_state_dict, between a launch and "
                               "its collection?)")
        waited = time.perf_counter()
        try:
            exchange_s, sent = await frag.pending
        finally:
            frag.pending = None
        exposed = time.perf_counter() - waited
        self._apply(frag, self._local(frag))
        record = SyncRecord(frag.index, frag.launched_after, step, exchange_s, exposed, sent)
        c = self._counters
        c.outer_steps += 1
        c.bytes_sent += sent
        c.records.append(record)
        return record

    def _local(self, frag: _Fragment) -> list[np.ndarray]:
        arrays = []
        for i, g in zip(frag.indices, frag.global_copy):
            a = param_array(self._params[i], i)
            if a.shape != g.shape or a.dtype != g.dtype:
                raise ConfigError(f"DiLoCo fragment {frag.index}: a parameter changed from "
                                  f"{g.shape} {g.dtype} to {a.shape} {a.dtype}")
            arrays.append(a)
        return arrays

    # -- state --------------------------------------------------------------------------

    def global_arrays(self) -> list[np.ndarray]:
        """The global model's arrays (live; parameter order): what every rank holds alike."""
        by_param: dict[int, np.ndarray] = {}
        for frag in self._fragments:
            for i, g in zip(frag.indices, frag.global_copy):
                by_param[i] = g
        return [by_param[i] for i in range(len(self._params))]

    def state_dict(self) -> dict[str, Any]:
        """The global model, the outer optimizer and the step count (copies).

        Only between exchanges: with one in flight the global model is about to change.
        """
        if self.pending:
            raise NetdistError(f"DiLoCo.state_dict: fragments {self.pending} have exchanges "
                               "in flight; call it after finish() or between exchanges")
        return {"inner_step": self._counters.inner_step,
                "global": [g.copy() for g in self.global_arrays()],
                "outer": self.outer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state_dict``'s result and start the local model from the global one
        (how a joining worker catches up)."""
        if self.pending:
            raise NetdistError(f"DiLoCo.load_state_dict: fragments {self.pending} have "
                               "exchanges in flight")
        arrays = self.global_arrays()
        saved = list(state["global"])
        if [np.shape(s) for s in saved] != [a.shape for a in arrays]:
            raise ConfigError(f"DiLoCo state holds shapes {[np.shape(s) for s in saved]}, "
                              f"this model {[a.shape for a in arrays]}")
        for a, s in zip(arrays, saved):
            np.copyto(a, s)
        self.outer.load_state_dict(state["outer"])
        self._counters.inner_step = int(state["inner_step"])
        for frag in self._fragments:
            for x, g in zip(self._local(frag), frag.global_copy):
                np.copyto(x, g)


class LocalSGD(DiLoCo):
    """Average the parameters themselves every ``sync_every`` steps (no outer optimizer).

    The result is exactly the MEAN all-reduce of the parameters (quantized when the
    config says so), identical on every rank. Streaming settings apply as for DiLoCo.
    """

    def __init__(self, group: Group, params: Iterable[Any], config: DiLoCoConfig | None = None,
                 *, fragments: Sequence[Sequence[int]] | None = None) -> None:
        super().__init__(group, params, config, fragments=fragments)

    def _fill(self, frag: _Fragment, local: list[np.ndarray]) -> None:
        for view, x in zip(frag.views(), local):
            np.copyto(view, x)

    def _apply(self, frag: _Fragment, local: list[np.ndarray]) -> None:
        a = self.config.fragment_mixing
        for x, g, avg in zip(local, frag.global_copy, frag.views()):
            np.copyto(g, avg)
            if a == 0:
                np.copyto(x, avg)
            else:
                x *= x.dtype.type(a)
                x += x.dtype.type(1 - a) * avg
