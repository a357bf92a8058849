"""One rank of the backend tests: runs every op of the ``netdist`` (or ``gloo``) backend
on small tensors with exact, integer-valued contents and writes what it got as JSON.

Run as ``python backend_worker.py SCENARIO BACKEND RANK WORLD PORT OUT_DIR``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta
from typing import Any

if os.environ.get("HIDE_ML_DTYPES") == "1":
    sys.modules["ml_dtypes"] = None  # type: ignore[assignment] - as if not installed

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import netdist.torch  # noqa: E402,F401 - registers the backend

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8,
          torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool, torch.complex64]
REDUCE_OPS = ["SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "AVG"]


def _values(t: torch.Tensor) -> list[Any]:
    if t.is_complex():
        return [[z.real, z.imag] for z in t.reshape(-1).tolist()]
    return t.reshape(-1).tolist()


def _supported(op: str, dtype: torch.dtype, backend: str) -> bool:
    bitwise = op in ("BAND", "BOR", "BXOR")
    if bitwise and (dtype.is_floating_point or dtype.is_complex):
        return False
    if op == "AVG" and (backend == "gloo" or dtype is torch.bool):
        return False  # netdist averages integers as NCCL does; bool has no average
    if dtype.is_complex and op not in ("SUM", "AVG"):
        return False
    if dtype is torch.bool and op in ("PRODUCT", "SUM", "BXOR", "AVG"):
        return False  # Gloo rejects these for bool; bool SUM/PRODUCT mean or/and in netdist
    return True


def ops(rank: int, world: int, backend: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for dtype in DTYPES:
        if backend == "gloo" and dtype is torch.int16:
            continue  # Gloo has no int16 at all; the test compares netdist's with int32's
        name = str(dtype).removeprefix("torch.")
        base = torch.tensor([rank + 1, 2, rank % 2, 3]).to(dtype)
        for op in REDUCE_OPS:
            if _supported(op, dtype, backend):
                t = base.clone()
                try:  # Gloo refuses some dtype/op pairs up front, on every rank alike
                    dist.all_reduce(t, op=getattr(dist.ReduceOp, op))
                except RuntimeError as exc:
                    out[f"all_reduce/{op}/{name}"] = {"refused": str(exc).splitlines()[0]}
                    continue
                out[f"all_reduce/{op}/{name}"] = _values(t)
        t = base.clone() if rank == 1 else torch.zeros(4).to(dtype)
        dist.broadcast(t, src=1)
        out[f"broadcast/{name}"] = _values(t)
        gathered = [torch.zeros(4).to(dtype) for _ in range(world)]
        dist.all_gather(gathered, base)
        out[f"all_gather/{name}"] = [_values(g) for g in gathered]
        flat = torch.zeros(4 * world).to(dtype)
        dist.all_gather_into_tensor(flat, base)
        out[f"all_gather_into_tensor/{name}"] = _values(flat)
        if dtype is not torch.bool:
            chunks = [torch.full((2,), rank * 10 + i).to(dtype) for i in range(world)]
            mine = torch.zeros(2).to(dtype)
            dist.reduce_scatter(mine, chunks)
            out[f"reduce_scatter/{name}"] = _values(mine)
            whole = torch.arange(2 * world).to(dtype) + rank
            mine = torch.zeros(2).to(dtype)
            dist.reduce_scatter_tensor(mine, whole)
            out[f"reduce_scatter_tensor/{name}"] = _values(mine)
        if dtype is not torch.bool and not dtype.is_complex:  # Gloo: no complex reduce
            t = base.clone()
            dist.reduce(t, dst=0, op=dist.ReduceOp.MAX)
            if rank == 0:
                out[f"reduce/{name}"] = _values(t)
        send = (torch.arange(world) % 2 == rank % 2) if dtype is torch.bool else \
            (torch.arange(world) + 10 * rank).to(dtype)
        recv = torch.zeros(world).to(dtype)
        dist.all_to_all_single(recv, send)
        out[f"all_to_all_single/{name}"] = _values(recv)
        outs = [torch.zeros(1).to(dtype) for _ in range(world)]
        dist.all_to_all(outs, [torch.tensor([10 * rank + j]).to(dtype) for j in range(world)])
        out[f"all_to_all/{name}"] = [_values(o) for o in outs]
        if not (backend == "gloo" and dtype.is_complex):  # Gloo: no complex gather
            got = [torch.zeros(4).to(dtype) for _ in range(world)] if rank == 0 else None
            dist.gather(base, got, dst=0)
            if rank == 0:
                out[f"gather/{name}"] = [_values(g) for g in got]
        mine = torch.zeros(4).to(dtype)
        dist.scatter(mine, [base.clone() + i for i in range(world)] if rank == 0 and
                     dtype is not torch.bool else ([base.clone()] * world if rank == 0
                                                   else None), src=0)
        out[f"scatter/{name}"] = _values(mine)
        peer_out = torch.zeros(4).to(dtype)
        if rank == 0:
            dist.send(base, dst=1, tag=7)
        elif rank == 1:
            dist.recv(peer_out, src=0, tag=7)
            out[f"send_recv/{name}"] = _values(peer_out)
    # uneven all_to_all_single along dim 0 (rank r sends r + j + 1 rows to rank j)
    sizes_out = [rank + j + 1 for j in range(world)]
    sizes_in = [j + rank + 1 for j in range(world)]
    send = torch.cat([torch.full((s, 2), 100 * rank + j) for j, s in enumerate(sizes_out)])
    recv = torch.zeros(sum(sizes_in), 2, dtype=send.dtype)
    dist.all_to_all_single(recv, send, sizes_in, sizes_out)
    out["all_to_all_single/uneven"] = recv.tolist()
    # non-contiguous tensors are staged and copied back
    t = torch.arange(8, dtype=torch.float32).reshape(2, 4).t() + rank
    dist.all_reduce(t)
    out["all_reduce/non_contiguous"] = t.tolist()
    # object collectives through torch's own helpers (pickle over the byte ops)
    objs: list[Any] = [None] * world
    dist.all_gather_object(objs, {"rank": rank, "name": f"r{rank}"})
    out["all_gather_object"] = objs
    box = [{"from": rank}] if rank == 1 else [None]
    dist.broadcast_object_list(box, src=1)
    out["broadcast_object_list"] = box
    # async work, futures (what DDP comm hooks chain on), batch_isend_irecv, subgroups
    works = [dist.all_reduce(torch.full((3,), float(rank + i)), async_op=True) for i in range(4)]
    out["async"] = [w.get_future().wait()[0].tolist() for w in works]
    right, left = (rank + 1) % world, (rank - 1) % world
    got_left = torch.zeros(2)
    reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.full((2,), float(rank)), right),
                                   dist.P2POp(dist.irecv, got_left, left)])
    for req in reqs:
        req.wait()
    out["batch_isend_irecv"] = got_left.tolist()
    evens = dist.new_group([r for r in range(world) if r % 2 == 0])
    odds = dist.new_group([r for r in range(world) if r % 2 == 1])
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, group=evens if rank % 2 == 0 else odds)
    out["subgroup"] = t.tolist()
    subgroup, _ = dist.new_subgroups(group_size=1)
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, group=subgroup)
    out["new_subgroups"] = t.tolist()
    dist.barrier()
    dist.monitored_barrier(timeout=timedelta(seconds=30))
    return out


def main() -> None:
    scenario, backend = sys.argv[1], sys.argv[2]
    rank, world, port, out_dir = int(sys.argv[3]), int(sys.argv[4]), sys.argv[5], sys.argv[6]
    timeout = timedelta(seconds=float(os.environ.get("TEST_PG_TIMEOUT", "60")))
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timeout)
    result: dict[str, Any] = {}
    if scenario == "ops":
        result = ops(rank, world, backend)
    elif scenario in ("peer_dies", "peer_stalls"):
        result = failure(scenario, rank, out_dir)
    elif scenario == "bf16":
        result = bf16(rank, world)
    elif scenario == "ddp_peer_dies":
        result = ddp_failure(rank, out_dir)
    elif scenario == "small":
        result = small(rank)
    elif scenario == "int_avg":
        result = int_avg(rank, world, backend)
    with open(os.path.join(out_dir, f"{scenario}-{backend}-{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


def bf16(rank: int, world: int) -> dict[str, Any]:
    """bfloat16 reductions against torch's own bf16 arithmetic in rank order."""
    def data(r: int) -> torch.Tensor:
        return torch.randn(4096, generator=torch.Generator().manual_seed(r)).to(torch.bfloat16)

    out: dict[str, Any] = {"ml_dtypes": "ml_dtypes" in sys.modules
                           and sys.modules["ml_dtypes"] is not None}
    for name, op, fold in (("SUM", dist.ReduceOp.SUM, torch.add),
                           ("MAX", dist.ReduceOp.MAX, torch.maximum)):
        t = data(rank)
        dist.all_reduce(t, op=op)
        expected = data(0)
        for r in range(1, world):
            expected = fold(expected, data(r))
        out[name] = bool(torch.equal(t.view(torch.int16), expected.view(torch.int16)))
    return out


def small(rank: int) -> dict[str, Any]:
    """Blocking small all-reduces back to back, as a training loop's metrics are: on one
    host they take the shared-memory lane, most finishing on the calling thread
    (``Group.all_reduce_eager``, counted here); then sizes that differ by rank."""
    from netdist.collectives.group import Group

    original = Group.all_reduce_eager
    started = 0

    def counting(self: Group, *args: Any, **kwargs: Any) -> Any:
        nonlocal started
        outcome = original(self, *args, **kwargs)
        started += outcome is not None
        return outcome

    Group.all_reduce_eager = counting  # type: ignore[method-assign]
    sums, maxima, means = [], [], []
    for i in range(300):
        t = torch.tensor([rank + i, 2 * i], dtype=torch.int64)
        dist.all_reduce(t)
        sums.append(t.tolist())
        m = torch.tensor([float(rank * i)], dtype=torch.float32)
        dist.all_reduce(m, op=dist.ReduceOp.MAX)
        maxima.append(m.item())
        a = torch.full((3,), float(rank + i), dtype=torch.float64)
        dist.all_reduce(a, op=dist.ReduceOp.AVG)
        means.append(a.tolist())
    out: dict[str, Any] = {"sums": sums, "maxima": maxima, "means": means,
                           "started": started}
    try:
        dist.all_reduce(torch.ones(2 + rank))
    except Exception as exc:  # noqa: BLE001 - the test checks type and message
        out["mismatch"] = {"mro": [c.__name__ for c in type(exc).__mro__],
                           "message": str(exc)}
    return out


def ddp_failure(rank: int, out_dir: str) -> dict[str, Any]:
    """DDP trains two steps; rank 1 then dies; rank 0's next backward must raise."""
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(16, 4))
    for step in range(3):
        if step == 2 and rank == 1:
            os._exit(3)
        try:
            model(torch.randn(8, 16)).sum().backward()
        except Exception as exc:  # noqa: BLE001 - the test checks type and message
            result = {"step": step, "type": type(exc).__name__, "message": str(exc)}
            with open(os.path.join(out_dir, f"ddp_peer_dies-netdist-{rank}.json"), "w") as f:
                json.dump(result, f)
            os._exit(0)  # the job is broken: leave without the group's goodbye
    return {"step": None}


def failure(scenario: str, rank: int, out_dir: str) -> dict[str, Any]:
    """Rank 1 dies (or sits out one collective); rank 0 reports what torch raised."""
    dist.all_reduce(torch.ones(1))
    if rank == 1:
        if scenario == "peer_dies":
            os._exit(3)
        done = os.path.join(out_dir, "rank0-done")
        deadline = time.monotonic() + 60
        while not os.path.exists(done):  # sits the collective out until rank 0 gave up
            if time.monotonic() > deadline:
                raise TimeoutError("rank 0 never reported")
            time.sleep(0.01)  # a bounded poll of a real condition (the file)
        return {}
    try:
        dist.all_reduce(torch.ones(1))
    except Exception as exc:  # noqa: BLE001 - the type is what the test checks
        result = {"type": type(exc).__name__,
                  "mro": [c.__name__ for c in type(exc).__mro__], "message": str(exc)}
    else:
        result = {"type": None}
    open(os.path.join(out_dir, "rank0-done"), "w").close()
    if scenario == "peer_dies":
        with open(os.path.join(out_dir, f"{scenario}-netdist-0.json"), "w") as f:
            json.dump(result, f)
        os._exit(0)  # the job is broken: leave without the group's goodbye
    return result


INT_AVG_DTYPES = [torch.int8, torch.uint8, torch.int32, torch.int64]


def int_avg_data(dtype: torch.dtype, rank: int, size: int) -> torch.Tensor:
    """Rank ``rank``'s integers: the type's minimum, its maximum and (rank 0 only) -7
    in the first three places (7 for uint8), then full-range random values."""
    import numpy as np

    info = torch.iinfo(dtype)
    rng = np.random.default_rng([rank, info.bits])
    t = torch.from_numpy(rng.integers(info.min, info.max, size, endpoint=True,
                                      dtype=str(dtype).removeprefix("torch.")))
    third = 7 if info.min == 0 else (-7 if rank == 0 else 0)
    t[:3] = torch.tensor([info.min, info.max, third], dtype=torch.int64).to(dtype)
    return t


def int_avg(rank: int, world: int, backend: str) -> dict[str, Any]:
    """AVG of integer tensors (issue 27). netdist: ``ReduceOp.AVG`` itself, blocking
    (small sizes through the shared-memory lane, most on the calling thread), async, and
    large (the host arena), for all_reduce, reduce and reduce_scatter_tensor. Gloo, which
    has no AVG: SUM, then torch's own truncating division, ``torch.div(rounding_mode=
    "trunc")``, the reference the test compares netdist's bits with. netdist only: AVG of
    bool raises TypeError at the call, naming torch's op."""
    avg = dist.ReduceOp.AVG if backend == "netdist" else dist.ReduceOp.SUM

    def divided(t: torch.Tensor) -> list[Any]:
        if backend == "gloo":
            t = torch.div(t, world, rounding_mode="trunc")
        return t.tolist()

    out: dict[str, Any] = {}
    for dtype in INT_AVG_DTYPES:
        name = str(dtype).removeprefix("torch.")
        for size in (5, 3000, 300_000):
            t = int_avg_data(dtype, rank, size)
            dist.all_reduce(t, op=avg)
            out[f"all_reduce/{size}/{name}"] = divided(t)
        t = int_avg_data(dtype, rank, 3000)
        dist.all_reduce(t, op=avg, async_op=True).wait()
        out[f"all_reduce_async/{name}"] = divided(t)
        t = int_avg_data(dtype, rank, 3000)
        dist.reduce(t, dst=0, op=avg)
        if rank == 0:
            out[f"reduce/{name}"] = divided(t)
        whole = int_avg_data(dtype, rank, 10 * world)
        mine = torch.zeros(10, dtype=dtype)
        dist.reduce_scatter_tensor(mine, whole, op=avg)
        out[f"reduce_scatter_tensor/{name}"] = divided(mine)
    if backend == "netdist":
        for what, call in (("all_reduce", lambda t: dist.all_reduce(t, op=avg)),
                           ("all_reduce_async", lambda t: dist.all_reduce(t, op=avg,
                                                                          async_op=True)),
                           ("reduce", lambda t: dist.reduce(t, dst=0, op=avg))):
            try:
                call(torch.ones(3, dtype=torch.bool))
                out[f"bool/{what}"] = {"raised": None}
            except Exception as exc:  # noqa: BLE001 - the test checks type and message
                out[f"bool/{what}"] = {"raised": type(exc).__name__, "message": str(exc)}
    dist.barrier()
    return out


if __name__ == "__main__":
    main()
