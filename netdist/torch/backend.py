"""torch's collective API over netdist's ``Group``, as a whole group or as a CPU backend.

netdist enters a torch process group in one of two ways (``netdist.torch.create_process_group``
picks by the backend string):

- ``ProcessGroupNetdist``, a ``ProcessGroup``: the whole group, when netdist is its only
  backend (``"netdist"``, ``"cpu:netdist"``). torch calls its Python methods directly and
  hands back its ``NetdistWork`` handles themselves.
- ``NetdistBackend`` (``netdist.torch.device_backend``), a per-device ``Backend`` like
  torch's own ``ProcessGroupGloo``: the CPU backend of a group that also has another
  device's backend (``"cpu:netdist,cuda:nccl"``). torch builds that ``ProcessGroup`` and
  dispatches each call by its tensors' device: CPU tensors here, CUDA tensors to NCCL.

Both run the calls of ``NetdistOps``, defined once here.

Each call checks its tensors on the caller's thread, starts exactly one coroutine on the
job's progress thread and returns a ``NetdistWork`` at once. The coroutine issues its
netdist collective(s) before it first yields, so the collectives' tags are taken in call
order on every rank, which is what makes several ``async_op=True`` calls in flight match
up across ranks (torch's rule: every rank issues the same calls in the same order).

Semantics follow Gloo's on CPU (torch's reference for this device):

- reductions: SUM, PRODUCT, MIN, MAX, BAND, BOR, BXOR (integers and bool), and AVG, which
  Gloo lacks (netdist's MEAN: sum, then one division; on integer dtypes NCCL's average,
  the wrapped sum divided with truncation toward zero; bool is refused, as by NCCL).
  Results are bitwise identical on every rank. PREMUL_SUM is NCCL's and is refused. A
  dtype an op is undefined for raises ``TypeError`` on the caller's thread, naming the op
  as torch does (``AVG``, not netdist's ``MEAN``);
- data movement (broadcast, gathers, scatters, all-to-all, send/recv) moves the tensors'
  bytes, so every dtype moves (bfloat16, float16, complex, bool, all integer types);
- ``barrier`` first waits for this group's earlier operations, as Gloo's does;
- ``monitored_barrier`` names every rank that did not arrive within its timeout
  (``Group.monitored_barrier``);
- a receive from any source (``dist.recv(t)`` without ``src``) takes the first message
  that arrives from any member on that tag (``Group.recv_any``);
- user tags of ``send``/``recv`` are taken modulo ``2**19`` (netdist's group p2p tags are
  ``< 2**20``; the upper half is held back for the backend).

The protocols are ``Group``'s: this module only adapts torch's calls to them (staging
tensors, ``Work`` handles, torch's errors).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Coroutine, Sequence
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from netdist.collectives.group import Group
from netdist.errors import CollectiveMismatchError
from netdist.progress.job import Job
from netdist.torch.array_views import Staged, ViewCache, as_array, as_bytes, check_cpu, stage
from netdist.torch.error_types import to_torch_error
from netdist.torch.store_keys import CoordinatorRecord
from netdist.torch.work_handle import ENDED, NetdistWork
from netdist.types import ReduceOp, check_reduce_dtype

__all__ = ["NetdistOps", "ProcessGroupNetdist", "BACKEND_NAME", "USER_TAG_LIMIT"]

BACKEND_NAME = "netdist"

USER_TAG_LIMIT = 2**19
"""``send``/``recv`` tags are taken modulo this; tags above it are held back for the backend."""

_REDUCE_OPS: dict[Any, ReduceOp] = {
    dist.ReduceOp.SUM: ReduceOp.SUM,
    dist.ReduceOp.PRODUCT: ReduceOp.PROD,
    dist.ReduceOp.MIN: ReduceOp.MIN,
    dist.ReduceOp.MAX: ReduceOp.MAX,
    dist.ReduceOp.BAND: ReduceOp.BAND,
    dist.ReduceOp.BOR: ReduceOp.BOR,
    dist.ReduceOp.BXOR: ReduceOp.BXOR,
    dist.ReduceOp.AVG: ReduceOp.MEAN,
}


def reduce_op(opts: Any, what: str, *arrays: np.ndarray) -> ReduceOp:
    """netdist's ``ReduceOp`` for the torch options' ``reduceOp``, checked against the
    dtype of each of ``arrays`` here, on the caller's thread: an op undefined for the
    dtype (AVG of bool, BAND of floats) raises ``TypeError`` naming torch's call and
    torch's op (``allreduce AVG``), not netdist's names for them. This is on every call's
    path, so the verdict per (op, dtype) is cached (``_defined``)."""
    red = opts.reduceOp
    kind = getattr(red, "op", red)
    try:
        op = _REDUCE_OPS[kind]
    except KeyError:
        raise ValueError(f"{what}: the netdist backend does not support {kind} "
                         "(PREMUL_SUM is NCCL's)") from None
    for array in arrays:
        if not _defined(op, array.dtype):
            check_reduce_dtype(op, array.dtype, what, name=kind.name)  # raises, naming both
    return op


@functools.cache
def _defined(op: ReduceOp, dtype: np.dtype[Any]) -> bool:
    """Whether ``op`` is defined for ``dtype`` (``check_reduce_dtype``'s verdict)."""
    try:
        check_reduce_dtype(op, dtype, "")
    except TypeError:
        return False
    return True


def _one(tensors: Sequence[Any], what: str) -> Any:
    if len(tensors) != 1:
        raise ValueError(f"{what}: the netdist backend takes exactly one tensor (or list) "
                         f"per call, got {len(tensors)}")
    return tensors[0]


def _same_bytes(tensors: Sequence[torch.Tensor]) -> bool:
    sizes = {t.numel() * t.element_size() for t in tensors}
    return len(sizes) <= 1


def _rows(tensor: torch.Tensor, splits: Sequence[int], n: int, what: str) -> list[int]:
    """Row counts of ``tensor`` along dim 0 for each member (equal split when empty)."""
    rows = tensor.shape[0] if tensor.dim() else 1
    if not splits:
        if rows % n:
            raise ValueError(f"{what}: dim 0 of size {rows} does not split evenly over "
                             f"{n} ranks; pass split sizes")
        return [rows // n] * n
    if len(splits) != n or sum(splits) != rows or min(splits) < 0:
        raise ValueError(f"{what}: split sizes {list(splits)} must be {n} non-negative "
                         f"numbers adding up to dim 0 ({rows})")
    return [int(s) for s in splits]


def _row_views(tensor: torch.Tensor, rows: list[int]) -> list[np.ndarray]:
    flat = as_bytes(tensor)
    total = sum(rows)
    row_bytes = flat.nbytes // total if total else 0
    views, start = [], 0
    for count in rows:
        views.append(flat[start:start + count * row_bytes])
        start += count * row_bytes
    return views


class NetdistOps:
    """torch's collective calls (``allreduce``, ``broadcast``, ``send``...) over a netdist
    ``Group``, for ``ProcessGroupNetdist`` and ``NetdistBackend`` to inherit beside the
    torch base class that says how torch reaches them."""

    def __init__(self, job: Job, group: Group, *, timeout: timedelta, owns_job: bool,
                 store_record: CoordinatorRecord | None = None) -> None:
        super().__init__(group.rank, group.world_size)  # type: ignore[call-arg]
        self._job = job
        self._store_record = store_record
        self._progress = job.progress
        self._group = group
        self._seconds = timeout.total_seconds()
        self._owns_job = owns_job
        self._pending: set[Any] = set()
        self._views = ViewCache()

    # -- identity --------------------------------------------------------------------

    @property
    def job(self) -> Job:
        """The netdist ``Job`` (transport and progress thread) this group runs on."""
        return self._job

    @property
    def store_record(self) -> CoordinatorRecord | None:
        """Where this group's job met: the coordinator record rank 0 published in torch's
        store for this attempt (``.as_dict()``: address, torchrun run id and restart
        count, generation, nonce). A subgroup shares its default group's."""
        return self._store_record

    @property
    def netdist_group(self) -> Group:
        """netdist's ``Group`` for these ranks (use it on ``job.progress`` only)."""
        return self._group

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return BACKEND_NAME

    def name(self) -> str:
        return BACKEND_NAME

    def size(self) -> int:
        return self._group.world_size

    def rank(self) -> int:
        return self._group.rank

    def __repr__(self) -> str:
        return (f"<{type(self).__name__} rank {self._group.rank} of {self._group.world_size} "
                f"(transport ranks {list(self._group.ranks)})>")

    # -- plumbing --------------------------------------------------------------------

    def _timeout(self, opts: Any = None) -> float:
        value = getattr(opts, "timeout", None)
        if isinstance(value, timedelta) and value.total_seconds() > 0:
            return value.total_seconds()
        return self._seconds

    def _start(self, op: str, body: Coroutine[Any, Any, Any],
               outputs: list[torch.Tensor], staged: Sequence[Staged] = (),
               source: Callable[[], int] | None = None, asyncop: bool = True) -> NetdistWork:
        """Run the coroutine ``body`` (a ``Group`` call, or an adapter around one) on the
        progress thread; copy staged tensors back when it is done.

        ``asyncop`` is the torch options' ``asyncOp`` (False for a blocking call).
        """

        copies = [item for item in staged if item.work is not item.tensor]

        async def run() -> None:
            await body
            for item in copies:
                item.finish()

        coro = run() if copies else body
        if not asyncop and not self._pending:
            # a blocking call with nothing of this group in flight: run it right here
            # (driving the loop when it is free), skipping the thread-safe hand-off; with
            # earlier calls still queued it must queue behind them to keep tag order
            try:
                self._progress.run(coro)
            except BaseException as exc:  # noqa: BLE001 - a torch error, now
                raise to_torch_error(exc) from exc
            return NetdistWork(ENDED, self._progress, op, outputs, source)
        try:
            future = self._progress.submit(coro)
        except BaseException as exc:  # noqa: BLE001 - a closed job: a torch error
            coro.close()  # never started: no "never awaited" warning
            if coro is not body:
                body.close()
            raise to_torch_error(exc) from exc
        self._pending.add(future)
        future.add_done_callback(self._pending.discard)
        return NetdistWork(future, self._progress, op, outputs, source)

    def _reduce_view(self, tensor: torch.Tensor, op: str) -> tuple[np.ndarray, list[Staged]]:
        """``tensor`` as an array to reduce in place, and the staging to copy back (none
        for a contiguous tensor, whose view is cached for the next call: ``ViewCache``)."""
        array = self._views.lookup(tensor)
        if array is not None:
            return array, []
        staged = stage(tensor, op)
        array = as_array(staged.work, op)
        if staged.work is tensor:
            self._views.store(tensor, array)
            return array, []
        return array, [staged]

    # -- reductions ------------------------------------------------------------------

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> NetdistWork:
        opts = opts if opts is not None else c10d.AllreduceOptions()
        tensor = _one(tensors, "allreduce")
        array, staged = self._reduce_view(tensor, "allreduce")
        op = reduce_op(opts, "allreduce", array)
        group, timeout = self._group, self._timeout(opts)
        if not opts.asyncOp and not self._pending and not staged:
            # a small blocking all-reduce may finish on this thread through shared memory
            # without an event-loop iteration (Group.all_reduce_eager)
            try:
                with self._progress.holding() as held:
                    started = group.all_reduce_eager(array, op, timeout=timeout) if held else None
                if started is not None:
                    if started.rest is not None:  # begun here, finished on the loop
                        self._progress.run(started.rest)
                    return NetdistWork(ENDED, self._progress, "allreduce", [tensor])
            except BaseException as exc:  # noqa: BLE001 - a torch error, now
                raise to_torch_error(exc) from exc

        return self._start("allreduce", group.all_reduce(array, op, timeout=timeout), [tensor],
                           staged, asyncop=opts.asyncOp)

    def allreduce_coalesced(self, tensors: list[torch.Tensor],
                            opts: Any = None) -> NetdistWork:
        opts = opts if opts is not None else c10d.AllreduceCoalescedOptions()
        for t in tensors:
            check_cpu(t, "allreduce_coalesced")
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for t in tensors:
            by_dtype.setdefault(t.dtype, []).append(t)
        flats = [torch.cat([t.detach().reshape(-1) for t in ts]) for ts in by_dtype.values()]
        arrays = [as_array(f, "allreduce_coalesced") for f in flats]
        op = reduce_op(opts, "allreduce_coalesced", *arrays)
        group, timeout = self._group, self._timeout(opts)

        async def body() -> None:
            works = [await group.all_reduce(a, op, timeout=timeout, async_op=True)
                     for a in arrays]
            for work in works:
                await work
            with torch.no_grad():
                for flat, ts in zip(flats, by_dtype.values()):
                    offset = 0
                    for t in ts:
                        t.copy_(flat[offset:offset + t.numel()].view_as(t))
                        offset += t.numel()

        return self._start("allreduce_coalesced", body(), list(tensors))

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> NetdistWork:
        opts = opts if opts is not None else c10d.ReduceOptions()
        tensor = _one(tensors, "reduce")
        staged = stage(tensor, "reduce")
        array = as_array(staged.work, "reduce")
        op = reduce_op(opts, "reduce", array)
        root, group, timeout = opts.rootRank, self._group, self._timeout(opts)

        return self._start("reduce", group.reduce(array, root, op, timeout=timeout), [tensor],
                           [staged] if self.rank() == root else ())

    def reduce_scatter(self, outputs: list[torch.Tensor],
                       input_lists: list[list[torch.Tensor]],
                       opts: Any = None) -> NetdistWork:
        opts = opts if opts is not None else c10d.ReduceScatterOptions()
        out = _one(outputs, "reduce_scatter")
        inputs = _one(input_lists, "reduce_scatter")
        n = self.size()
        if len(inputs) != n:
            raise ValueError(f"reduce_scatter needs {n} input tensors, got {len(inputs)}")
        for t in inputs:
            check_cpu(t, "reduce_scatter")
        staged = stage(out, "reduce_scatter")
        flat = torch.cat([t.detach().reshape(-1) for t in inputs])
        sizes = [t.numel() for t in inputs]
        me = self.rank()
        if sizes[me] != out.numel():
            raise ValueError(f"reduce_scatter: the output has {out.numel()} elements but "
                             f"input {me} has {sizes[me]}")
        array, target = as_array(flat, "reduce_scatter"), as_array(staged.work, "reduce_scatter")
        op = reduce_op(opts, "reduce_scatter", array)
        group, timeout = self._group, self._timeout(opts)
        even = len(set(sizes)) == 1

        async def body() -> None:
            if even:
                await group.reduce_scatter(array, op, out=target.reshape(-1), timeout=timeout)
            else:  # uneven chunks: reduce everything, keep this rank's part
                await group.all_reduce(array, op, timeout=timeout)
                lo = sum(sizes[:me])
                target.reshape(-1)[...] = array[lo:lo + sizes[me]]

        return self._start("reduce_scatter", body(), [out], [staged])

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor,
                              opts: Any = None) -> NetdistWork:
        return self._reduce_scatter_tensors("reduce_scatter_tensor", [output], [input], opts)

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs: list[torch.Tensor],
                                        inputs: list[torch.Tensor],
                                        opts: Any = None) -> NetdistWork:
        return self._reduce_scatter_tensors("reduce_scatter_tensor_coalesced", outputs,
                                            inputs, opts)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def _reduce_scatter_tensors(self, what: str, outputs: list[torch.Tensor],
                                inputs: list[torch.Tensor], opts: Any) -> NetdistWork:
        opts = opts if opts is not None else c10d.ReduceScatterOptions()
        n = self.size()
        if len(outputs) != len(inputs):
            raise ValueError(f"{what}: {len(outputs)} outputs for {len(inputs)} inputs")
        staged, pairs = [], []
        for out, inp in zip(outputs, inputs):
            check_cpu(inp, what)
            if inp.numel() != n * out.numel():
                raise ValueError(f"{what}: the input has {inp.numel()} elements; it must "
                                 f"have world size ({n}) x the output's {out.numel()}")
            if inp.dtype != out.dtype:
                raise ValueError(f"{what}: input dtype {inp.dtype} != output dtype {out.dtype}")
            s = stage(out, what)
            staged.append(s)
            src = inp if inp.is_contiguous() else inp.contiguous()
            pairs.append((as_array(src, what).reshape(-1), as_array(s.work, what).reshape(-1)))
        op = reduce_op(opts, what, *(a for a, _ in pairs))
        group, timeout = self._group, self._timeout(opts)

        async def body() -> None:
            works = [await group.reduce_scatter(a, op, out=o, timeout=timeout, async_op=True)
                     for a, o in pairs]
            for work in works:
                await work

        return self._start(what, body(), list(outputs), staged, asyncop=opts.asyncOp)

    # -- data movement ---------------------------------------------------------------

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> NetdistWork:
        opts = opts if opts is not None else c10d.BroadcastOptions()
        tensor = _one(tensors, "broadcast")
        staged = stage(tensor, "broadcast")
        data = as_bytes(staged.work)
        root, group, timeout = opts.rootRank, self._group, self._timeout(opts)

        return self._start("broadcast", group.broadcast(data, root, timeout=timeout), [tensor],
                           [staged], asyncop=opts.asyncOp)

    def allgather(self, output_lists: list[list[torch.Tensor]],
                  inputs: list[torch.Tensor], opts: Any = None) -> NetdistWork:
        opts = opts if opts is not None else c10d.AllgatherOptions()
        outs = _one(output_lists, "allgather")
        inp = _one(inputs, "allgather")
        return self._all_gather_lists("allgather", [outs], [inp], opts)

    def allgather_coalesced(self, output_lists: list[list[torch.Tensor]],
                            inputs: list[torch.Tensor], opts: Any = None) -> NetdistWork:
        """``output_lists[r][i]`` receives rank ``r``'s ``inputs[i]`` (torch's layout)."""
        opts = opts if opts is not None else c10d.AllgatherOptions()
        n = self.size()
        if len(output_lists) != n or any(len(row) != len(inputs) for row in output_lists):
            raise ValueError(f"all_gather_coalesced needs {n} output lists of "
                             f"{len(inputs)} tensors (one per input)")
        per_input = [[output_lists[r][i] for r in range(n)] for i in range(len(inputs))]
        return self._all_gather_lists("allgather_coalesced", per_input, inputs, opts)

    def _all_gather_lists(self, what: str, output_lists: list[list[torch.Tensor]],
                          inputs: list[torch.Tensor], opts: Any) -> NetdistWork:
        n = self.size()
        if len(output_lists) != len(inputs):
            raise ValueError(f"{what}: {len(output_lists)} output lists for "
                             f"{len(inputs)} inputs")
        jobs = []
        for outs, inp in zip(output_lists, inputs):
            check_cpu(inp, what)
            if len(outs) != n:
                raise ValueError(f"{what} needs {n} output tensors, got {len(outs)}")
            for t in outs:
                check_cpu(t, what)
            mine = as_bytes(inp.contiguous())
            jobs.append((mine, outs, _same_bytes([*outs, inp])))
        group, timeout = self._group, self._timeout(opts)

        async def body() -> None:
            started = []
            for mine, outs, even in jobs:
                buffer = np.empty(mine.nbytes * n if even else 0, np.uint8)
                work = await group.all_gather(mine, out=buffer if even else None,
                                              timeout=timeout, async_op=True)
                started.append((work, outs))
            for work, outs in started:
                gathered = await work
                offset = 0
                with torch.no_grad():
                    for t in outs:
                        size = t.numel() * t.element_size()
                        if size:
                            piece = torch.from_numpy(gathered[offset:offset + size])
                            t.view(-1).view(torch.uint8).copy_(piece) if t.is_contiguous() \
                                else t.copy_(piece.view(t.dtype).view(t.shape))
                        offset += size

        return self._start(what, body(), [t for outs in output_lists for t in outs])

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor,
                          opts: Any = None) -> NetdistWork:
        return self._all_gather_tensors("all_gather_into_tensor", [output], [input], opts)

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs: list[torch.Tensor],
                                    inputs: list[torch.Tensor],
                                    opts: Any = None) -> NetdistWork:
        return self._all_gather_tensors("all_gather_into_tensor_coalesced", outputs, inputs,
                                        opts)

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def _all_gather_tensors(self, what: str, outputs: list[torch.Tensor],
                            inputs: list[torch.Tensor], opts: Any) -> NetdistWork:
        opts = opts if opts is not None else c10d.AllgatherOptions()
        n = self.size()
        if len(outputs) != len(inputs):
            raise ValueError(f"{what}: {len(outputs)} outputs for {len(inputs)} inputs")
        staged, pairs = [], []
        for out, inp in zip(outputs, inputs):
            check_cpu(inp, what)
            if out.numel() != n * inp.numel() or out.dtype != inp.dtype:
                raise ValueError(f"{what}: the output ({out.dtype}, {out.numel()} elements) "
                                 f"must be world size ({n}) x the input ({inp.dtype}, "
                                 f"{inp.numel()} elements)")
            s = stage(out, what)
            staged.append(s)
            pairs.append((as_bytes(inp.contiguous()), as_bytes(s.work)))
        group, timeout = self._group, self._timeout(opts)

        async def body() -> None:
            works = [await group.all_gather(mine, out=full, timeout=timeout, async_op=True)
                     for mine, full in pairs]
            for work in works:
                await work

        return self._start(what, body(), list(outputs), staged, asyncop=opts.asyncOp)

    def gather(self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor],
               opts: Any = None) -> NetdistWork:
        opts = opts if opts is not None else c10d.GatherOptions()
        inp = _one(inputs, "gather")
        check_cpu(inp, "gather")
        root = opts.rootRank
        outs: list[torch.Tensor] = []
        if self.rank() == root:
            outs = _one(output_lists, "gather")
            if len(outs) != self.size():
                raise ValueError(f"gather needs {self.size()} output tensors on the root, "
                                 f"got {len(outs)}")
        mine = as_bytes(inp.contiguous())
        group, timeout = self._group, self._timeout(opts)

        async def body() -> None:
            arrays = await group.gather(mine, root, timeout=timeout)
            if arrays is not None:
                _copy_into(outs, arrays, "gather")

        return self._start("gather", body(), outs)

    def gather_single(self, output: torch.Tensor, input: torch.Tensor,
                      opts: Any = None) -> NetdistWork:
        opts = opts if opts is not None else c10d.GatherOptions()
        n = self.size()
        is_root = self.rank() == opts.rootRank
        if is_root and output.numel() != n * input.numel():
            raise ValueError(f"gather_into_tensor: the output has {output.numel()} elements; "
                             f"it must have world size ({n}) x the input's {input.numel()}")
        chunks = list(output.reshape(-1).chunk(n)) if is_root else []
        return self.gather([chunks], [input], opts)

    gather_into_tensor = gather_single

    def scatter(self, outputs: list[torch.Tensor], input_lists: list[list[torch.Tensor]],
                opts: Any = None) -> NetdistWork:
        opts = opts if opts is not None else c10d.ScatterOptions()
        out = _one(outputs, "scatter")
        check_cpu(out, "scatter")
        root = opts.rootRank
        payloads = None
        if self.rank() == root:
            inputs = _one(input_lists, "scatter")
            if len(inputs) != self.size():
                raise ValueError(f"scatter needs {self.size()} input tensors on the root, "
                                 f"got {len(inputs)}")
            payloads = [as_bytes(t.contiguous()) for t in inputs]
        group, timeout = self._group, self._timeout(opts)

        async def body() -> None:
            received = await group.scatter(payloads, root, timeout=timeout)
            _copy_into([out], [received], "scatter")

        return self._start("scatter", body(), [out])

    def alltoall(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                 opts: Any = None) -> NetdistWork:
        opts = opts if opts is not None else c10d.AllToAllOptions()
        n = self.size()
        if len(outputs) != n or len(inputs) != n:
            raise ValueError(f"all_to_all needs {n} input and {n} output tensors, got "
                             f"{len(inputs)} and {len(outputs)}")
        staged = [stage(t, "all_to_all") for t in outputs]
        sends = [as_bytes(t.contiguous()) for t in inputs]
        recvs = [as_bytes(s.work) for s in staged]
        return self._all_to_all("all_to_all", sends, recvs, outputs, staged, opts)

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor,
                          output_split_sizes: list[int], input_split_sizes: list[int],
                          opts: Any = None) -> NetdistWork:
        opts = opts if opts is not None else c10d.AllToAllOptions()
        n = self.size()
        check_cpu(input, "all_to_all_single")
        staged = stage(output, "all_to_all_single")
        source = input if input.is_contiguous() else input.contiguous()
        sends = _row_views(source, _rows(source, input_split_sizes, n, "all_to_all_single"))
        recvs = _row_views(staged.work, _rows(staged.work, output_split_sizes, n,
                                              "all_to_all_single"))
        return self._all_to_all("all_to_all_single", sends, recvs, [output], [staged], opts)

    alltoall_base = all_to_all_single

    def _all_to_all(self, what: str, sends: list[np.ndarray], recvs: list[np.ndarray],
                    outputs: list[torch.Tensor], staged: list[Staged],
                    opts: Any) -> NetdistWork:
        group, timeout = self._group, self._timeout(opts)

        return self._start(what, group.all_to_all(sends, recvs, timeout=timeout), outputs, staged)

    # -- point to point --------------------------------------------------------------

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> NetdistWork:
        tensor = _one(tensors, "send")
        check_cpu(tensor, "send")
        data = as_bytes(tensor.contiguous())
        group, user_tag = self._group, tag % USER_TAG_LIMIT

        return self._start("send", group.send(data, dst, user_tag), [tensor])

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> NetdistWork:
        tensor = _one(tensors, "recv")
        staged = stage(tensor, "recv")
        out = as_bytes(staged.work)
        group, user_tag = self._group, tag % USER_TAG_LIMIT

        async def body() -> None:
            received = await group.recv(src, user_tag, out=out)
            _check_size(received, out, src, "recv")

        return self._start("recv", body(), [tensor], [staged], source=lambda: src)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> NetdistWork:
        tensor = _one(tensors, "recv")
        staged = stage(tensor, "recv")
        out = as_bytes(staged.work)
        group, user_tag, seconds = self._group, tag % USER_TAG_LIMIT, self._seconds
        found: list[int] = []

        async def body() -> None:
            src, _ = await group.recv_any(None, user_tag, out=out, timeout=seconds)
            found.append(src)

        return self._start("recv", body(), [tensor], [staged], source=lambda: found[0])

    # -- synchronisation -------------------------------------------------------------

    def barrier(self, opts: Any = None) -> NetdistWork:
        opts = opts if opts is not None else c10d.BarrierOptions()
        prior = list(self._pending)
        group, timeout = self._group, self._timeout(opts)

        async def body() -> None:
            work = await group.barrier(timeout=timeout, async_op=True)
            if prior:  # like Gloo: the barrier also waits for this group's earlier work
                await asyncio.gather(*(asyncio.wrap_future(f) for f in prior),
                                     return_exceptions=True)
            await work

        return self._start("barrier", body(), [])

    def monitored_barrier(self, opts: Any = None, wait_all_ranks: bool = False) -> None:
        """Rank 0 waits up to the options' timeout for every rank and names those that did
        not come.

        torch's ``ProcessGroup`` passes ``BarrierOptions`` (``dist.monitored_barrier``'s
        ``timeout`` as ``opts.timeout``); a bare ``timedelta`` is taken as the timeout.
        """
        seconds = (opts.total_seconds() if isinstance(opts, timedelta)
                   else self._timeout(opts))
        group = self._group

        self._start("monitored_barrier",
                    group.monitored_barrier(timeout=seconds, wait_all_ranks=wait_all_ranks),
                    []).wait()

    # -- lifecycle -------------------------------------------------------------------

    def shutdown(self) -> None:
        """Close the job (BYE to every peer) if this group owns it."""
        if self._owns_job:
            self._job.close()

    def abort(self) -> None:
        """Close the job at once, telling peers this rank aborted."""
        if self._owns_job:
            self._job.close(RuntimeError("torch.distributed aborted the process group"))


# torch's stubs declare ProcessGroup's calls as pybind overloads, one per C++ signature;
# NetdistOps implements the one torch's frontends call (as pyproject's mypy section says)
class ProcessGroupNetdist(NetdistOps, dist.ProcessGroup):  # type: ignore[misc]
    """A ``torch.distributed`` process group whose collectives are netdist's: the whole
    group when netdist is its only backend (``init_process_group("netdist")``, a
    ``new_group`` of such a group, ``new_group(backend="netdist")``); made by
    ``netdist.torch.create_process_group``, not constructed directly.

    torch calls these methods from Python, so every ``Work`` torch returns is the
    ``NetdistWork`` itself (``is_completed()``, ``exception()``, the source rank of a
    receive from any source); a per-device ``NetdistBackend`` cannot offer that.
    """

    def __init__(self, job: Job, group: Group, *, timeout: timedelta, owns_job: bool,
                 store_record: CoordinatorRecord | None = None) -> None:
        super().__init__(job, group, timeout=timeout, owns_job=owns_job,
                         store_record=store_record)
        self._torch_name = ""
        self._torch_desc = ""

    # torch sets its group name and description after creation; C++ callers reach them
    # through getGroupName / getGroupDesc (there is no C++ backend to keep them)
    def _set_group_name(self, name: str) -> None:
        self._torch_name = name

    def _set_group_desc(self, desc: str) -> None:
        self._torch_desc = desc

    @property
    def group_name(self) -> str:
        return self._torch_name

    @property
    def group_desc(self) -> str:
        return self._torch_desc

    def getGroupName(self) -> str:  # noqa: N802 - torch's name
        return self._torch_name

    def getGroupDesc(self) -> str:  # noqa: N802 - torch's name
        return self._torch_desc

    @property
    def _device_types(self) -> list[torch.device]:
        return [torch.device("cpu")]

    def _get_backend(self, device: Any) -> ProcessGroupNetdist:
        return self

    supports_coalescing = False
    supports_splitting = False


def _copy_into(outs: Sequence[torch.Tensor], arrays: Sequence[np.ndarray], what: str) -> None:
    with torch.no_grad():
        for index, (t, array) in enumerate(zip(outs, arrays)):
            size = t.numel() * t.element_size()
            if array.nbytes != size:
                raise CollectiveMismatchError(
                    f"{what}: rank {index} sent {array.nbytes} bytes into a tensor of "
                    f"{size} bytes ({t.dtype}, shape {tuple(t.shape)})")
            if size:
                piece = torch.from_numpy(np.ascontiguousarray(array).view(np.uint8))
                t.copy_(piece.view(t.dtype).view(t.shape))


def _check_size(received: np.ndarray, out: np.ndarray, src: int, what: str) -> None:
    if received.nbytes != out.nbytes:
        raise CollectiveMismatchError(f"{what}: rank {src} sent {received.nbytes} bytes into "
                                      f"a tensor of {out.nbytes} bytes")
