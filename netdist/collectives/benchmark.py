"""Collective benchmarks in the style of nccl-tests: time, algbw, busbw, correctness.

``run_benchmark(group, op, sizes, ...)`` runs on every rank of a group and returns rows
on group rank 0. Conventions follow nccl-tests so figures compare directly:

- ``size`` is the per-rank buffer in bytes for ``all_reduce`` and ``broadcast``, the
  input of ``reduce_scatter`` (each rank gets ``size / n``) and the output of
  ``all_gather`` (each rank contributes ``size / n``);
- ``algbw = size / time``; ``busbw = algbw * factor`` with factor ``2(n-1)/n`` for
  all_reduce, ``(n-1)/n`` for reduce_scatter and all_gather, 1 for broadcast; busbw is
  comparable to the link speed whatever the world size;
- each iteration starts after a barrier and its time is the slowest rank's;
- timed iterations run on a buffer whose values do not change the cost (zeros), then one
  extra call with rank-dependent data is checked exactly against its closed form.

``dtype="bfloat16"`` needs no extra package: without ``ml_dtypes`` the buffers hold the
raw bits (``netdist.types.BFLOAT16``), and the check's integers go in and out through
float32, which holds them exactly.

Pure helpers (size parsing, formatting) have no I/O; the driver is ``run_benchmark``.
"""

from __future__ import annotations

import json
import re
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from netdist.collectives.group import Group
from netdist.sharding import chunk_bounds
from netdist.bfloat16 import bfloat16_to_float32, float32_to_bfloat16
from netdist.types import BFLOAT16, ReduceOp, is_bfloat16

__all__ = [
    "BenchRow",
    "OPS",
    "busbw_factor",
    "parse_size",
    "parse_sizes",
    "format_size",
    "format_table",
    "run_benchmark",
    "write_json",
    "plot_rows",
]

OPS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "barrier")
"""Collectives ``run_benchmark`` measures (``p2p`` lives in ``netdist.transport.probe``)."""

_UNITS = {"": 1, "B": 1, "K": 1024, "KB": 1024, "KIB": 1024, "M": 1024**2, "MB": 1024**2,
          "MIB": 1024**2, "G": 1024**3, "GB": 1024**3, "GIB": 1024**3}


@dataclass(frozen=True, slots=True)
class BenchRow:
    """One size of one collective: times in microseconds, bandwidths in GB/s (1e9 B/s)."""

    op: str
    world_size: int
    size: int
    count: int
    dtype: str
    iters: int
    time_median_us: float
    time_min_us: float
    time_max_us: float
    algbw_gbps: float
    busbw_gbps: float
    check: str
    """``"ok"``, ``"FAIL (...)"`` or ``"-"`` (barrier)."""


def busbw_factor(op: str, world_size: int) -> float:
    """nccl-tests' bus bandwidth factor for ``op`` at ``world_size``."""
    n = world_size
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in ("reduce_scatter", "all_gather"):
        return (n - 1) / n
    if op == "broadcast":
        return 1.0
    return 0.0


def parse_size(text: str) -> int:
    """``"8"``, ``"64K"``, ``"1MiB"``, ``"256M"``, ``"1G"`` -> bytes (binary units)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    if match is None or match.group(2).upper() not in _UNITS:
        raise ValueError(f"cannot parse size {text!r} (e.g. 8, 64K, 1M, 256MiB, 1G)")
    return int(float(match.group(1)) * _UNITS[match.group(2).upper()])


def parse_sizes(text: str) -> list[int]:
    """``"8:256M"`` (doubling), ``"1M:64M:4"`` (factor 4) or ``"8,1M,16M"`` -> bytes."""
    if ":" in text:
        parts = text.split(":")
        if len(parts) not in (2, 3):
            raise ValueError(f"size range {text!r} must be MIN:MAX or MIN:MAX:FACTOR")
        low, high = parse_size(parts[0]), parse_size(parts[1])
        factor = int(parts[2]) if len(parts) == 3 else 2
        if low < 1 or high < low or factor < 2:
            raise ValueError(f"size range {text!r} needs 1 <= MIN <= MAX and FACTOR >= 2")
        sizes = []
        size = low
        while size <= high:
            sizes.append(size)
            size *= factor
        return sizes
    sizes = [parse_size(part) for part in text.split(",") if part.strip()]
    if not sizes:
        raise ValueError("no sizes given")
    return sizes


def format_size(nbytes: float) -> str:
    for unit, scale in (("G", 1024**3), ("M", 1024**2), ("K", 1024)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{int(nbytes // scale)}{unit}"
    return str(int(nbytes))


def format_table(rows: Sequence[BenchRow], title: str = "") -> str:
    """An nccl-tests-like text table."""
    lines = []
    if title:
        lines.append(f"# {title}")
    lines.append(f"# {'size':>10} {'count':>11} {'type':>8} {'time med':>11} {'time min':>11} "
                 f"{'time max':>11} {'algbw':>8} {'busbw':>8}  check")
    lines.append(f"# {'(B)':>10} {'(elements)':>11} {'':>8} {'(us)':>11} {'(us)':>11} "
                 f"{'(us)':>11} {'(GB/s)':>8} {'(GB/s)':>8}")
    for r in rows:
        lines.append(f"  {r.size:>10} {r.count:>11} {r.dtype:>8} {r.time_median_us:>11.1f} "
                     f"{r.time_min_us:>11.1f} {r.time_max_us:>11.1f} {r.algbw_gbps:>8.3f} "
                     f"{r.busbw_gbps:>8.3f}  {r.check}")
    return "\n".join(lines)


def _count_for(op: str, size: int, itemsize: int, n: int) -> int:
    """Elements per buffer: the full buffer, rounded so every rank's share is equal."""
    count = max(1, size // itemsize) if op != "barrier" else 0
    if op in ("reduce_scatter", "all_gather") and count % n:
        count = max(n, count - count % n)
    return count


def _dtype(name: str) -> np.dtype[Any]:
    """The dtype benchmarked as ``name``: bfloat16 is ``BFLOAT16`` (raw bits without
    ml_dtypes), everything else NumPy's own."""
    return BFLOAT16 if name == "bfloat16" else np.dtype(name)


def _pattern(count: int, dtype: np.dtype[Any]) -> np.ndarray:
    """Small positive integers as int64: 1..13, whose sums over the ranks stay exact in
    every float dtype; 1..3 for bfloat16 (8 significant bits: exact up to 12 ranks)."""
    return np.arange(count, dtype=np.int64) % (3 if is_bfloat16(dtype) else 13) + 1


def _as(values: np.ndarray, dtype: np.dtype[Any]) -> np.ndarray:
    """Integer ``values`` in ``dtype`` (bfloat16 through float32, exact for them)."""
    if is_bfloat16(dtype):
        return float32_to_bfloat16(values.astype(np.float32), out=np.empty(values.shape, dtype))
    return values.astype(dtype)


def _same(got: np.ndarray, expected: np.ndarray) -> bool:
    """Exact equality of ``got`` with integer ``expected`` cast to its dtype (so integer
    types wrap alike); bfloat16 compared through float32."""
    if is_bfloat16(got.dtype):
        return np.array_equal(bfloat16_to_float32(got), expected)
    return np.array_equal(got, expected.astype(got.dtype))


async def _timed(group: Group, op: str, count: int, dtype: np.dtype[Any], iters: int,
                 warmup: int, timeout: float | None) -> list[float]:
    n = group.world_size
    rank = group.rank
    if op == "all_reduce":
        buf = np.zeros(count, dtype)

        async def call() -> None:
            await group.all_reduce(buf, timeout=timeout)
    elif op == "reduce_scatter":
        buf = np.zeros(count, dtype)
        a, b = chunk_bounds(count, n)[rank]
        out = np.empty(b - a, dtype)

        async def call() -> None:
            await group.reduce_scatter(buf, out=out, timeout=timeout)
    elif op == "all_gather":
        out = np.zeros(count, dtype)
        a, b = chunk_bounds(count, n)[rank]
        shard = np.zeros(b - a, dtype)

        async def call() -> None:
            await group.all_gather(shard, out=out, timeout=timeout)
    elif op == "broadcast":
        buf = np.zeros(count, dtype)

        async def call() -> None:
            await group.broadcast(buf, 0, timeout=timeout)
    elif op == "barrier":
        async def call() -> None:
            await group.barrier(timeout=timeout)
    else:
        raise ValueError(f"unknown collective {op!r} (expected one of {', '.join(OPS)})")
    times = []
    for i in range(warmup + iters):
        await group.barrier(timeout=timeout)
        started = time.perf_counter()
        await call()
        elapsed = time.perf_counter() - started
        if i >= warmup:
            times.append(elapsed)
    return times


async def _check(group: Group, op: str, count: int, dtype: np.dtype[Any],
                 timeout: float | None) -> str:
    """Run ``op`` once on rank-dependent data and compare exactly with the closed form."""
    n = group.world_size
    rank = group.rank
    base = _pattern(count, dtype)
    if op == "all_reduce":
        buf = _as(base * (rank + 1), dtype)
        await group.all_reduce(buf, timeout=timeout)
        ok = _same(buf, base * (n * (n + 1) // 2))
    elif op == "reduce_scatter":
        a, b = chunk_bounds(count, n)[rank]
        shard = await group.reduce_scatter(_as(base * (rank + 1), dtype), ReduceOp.SUM,
                                           timeout=timeout)
        ok = _same(shard, base[a:b] * (n * (n + 1) // 2))
    elif op == "all_gather":
        bounds = chunk_bounds(count, n)
        a, b = bounds[rank]
        out = np.zeros(count, dtype)
        await group.all_gather(_as(base[a:b] + rank, dtype), out=out, timeout=timeout)
        expected = base.copy()
        for r, (lo, hi) in enumerate(bounds):
            expected[lo:hi] += r
        ok = _same(out, expected)
    elif op == "broadcast":
        buf = _as(base, dtype) if rank == 0 else np.zeros(count, dtype)
        await group.broadcast(buf, 0, timeout=timeout)
        ok = _same(buf, base)
    else:
        return "-"
    flags = await group.all_gather_object(bool(ok), timeout=timeout)
    bad = [r for r, flag in enumerate(flags) if not flag]
    return "ok" if not bad else f"FAIL (ranks {', '.join(map(str, bad))})"


async def run_benchmark(group: Group, op: str, sizes: Sequence[int], *, iters: int = 20,
                        warmup: int = 5, dtype: str = "float32",
                        timeout: float | None = None, check: bool = True,
                        on_row: Callable[[BenchRow], None] | None = None) -> list[BenchRow]:
    """Benchmark ``op`` at each size; returns rows on group rank 0, ``[]`` elsewhere.

    Every rank must call it with the same arguments. ``on_row(row)`` is called as each
    size finishes (on every rank; the rows are identical), e.g. to print progressively.
    """
    if op not in OPS:
        raise ValueError(f"unknown collective {op!r} (expected one of {', '.join(OPS)})")
    if iters < 1 or warmup < 0:
        raise ValueError("iters must be >= 1 and warmup >= 0")
    dt = _dtype(dtype)
    n = group.world_size
    rows = []
    for size in ([0] if op == "barrier" else sizes):
        count = _count_for(op, size, dt.itemsize, n)
        times = await _timed(group, op, count, dt, iters, warmup, timeout)
        # each iteration's time is the slowest rank's
        all_times = await group.all_gather_object(times, timeout=timeout)
        per_iter = np.max(np.array(all_times), axis=0)
        verdict = await _check(group, op, count, dt, timeout) if check else "-"
        nbytes = count * dt.itemsize
        median = float(statistics.median(per_iter))
        algbw = nbytes / median / 1e9 if median > 0 and nbytes else 0.0
        name = "bfloat16" if is_bfloat16(dt) else dt.name
        row = BenchRow(op, n, nbytes, count, name, iters, median * 1e6,
                       float(per_iter.min()) * 1e6, float(per_iter.max()) * 1e6,
                       algbw, algbw * busbw_factor(op, n), verdict)
        rows.append(row)
        if on_row is not None:
            on_row(row)
    return rows if group.rank == 0 else []


def write_json(path: str, rows: Sequence[BenchRow | dict[str, Any]],
               meta: dict[str, Any]) -> None:
    """Write ``{"meta": ..., "rows": [...]}`` to ``path``."""
    data = {"meta": meta,
            "rows": [asdict(r) if isinstance(r, BenchRow) else dict(r) for r in rows]}
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(data, fh, indent=2)
        fh.write("\n")


def plot_rows(path: str, rows: Sequence[BenchRow], title: str) -> None:
    """Draw busbw against size (log2 x axis) to ``path``; needs matplotlib.

    Raises ``ImportError`` with an install hint when matplotlib is missing.
    """
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ImportError("--plot needs matplotlib: pip install 'netdist[plot]'") from exc
    fig, ax = plt.subplots(figsize=(7, 4))
    sizes = [r.size for r in rows]
    ax.plot(sizes, [r.busbw_gbps for r in rows], marker="o", label="busbw")
    ax.plot(sizes, [r.algbw_gbps for r in rows], marker=".", linestyle="--", label="algbw")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel("GB/s")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
