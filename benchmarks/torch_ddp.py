"""netdist as a torch.distributed backend against Gloo: a DDP step and all_reduce (issue 14).

Both backends run through the same plain ``torch.distributed`` code; only the name given
to ``init_process_group`` differs (``netdist`` is registered by ``import netdist.torch``).
Every rank is a separate process on 127.0.0.1, started by ``netdist.launcher.launch``
(which sets ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT``, so the ranks use
``init_method="env://"``), with ``cores // ranks`` intra-op threads each.

One job = one backend at one world size: it times

``compute``     the model's step without DDP on every rank at once (forward, backward,
                SGD step);
``ddp``         the same step under ``DistributedDataParallel`` (defaults: 25 MB buckets,
                all-reduce overlapped with backward), split into forward, backward (which
                includes waiting for the last bucket) and optimizer;
``no comm``     the DDP step again with a comm hook that sends nothing: DDP's own work
                (bucketing, copying gradients in and out of buckets) with free
                communication, so ``no comm / gloo step`` is the best ratio any backend
                could reach on this machine (printed beside the DDP targets);
``all_reduce``  ``dist.all_reduce`` of float32 tensors, back to back, each call timed.

An iteration's time is the slowest rank's; a job reports the median over its iterations.
Jobs run in rounds, and each round runs every backend at every world size, the backend
order alternating from round to round, so both see the same background load; the figure
per backend is the median over rounds and the ratio netdist / Gloo is taken from those
same-run medians (each round's own ratio is shown as a range). busbw uses nccl-tests'
factor ``2 (n - 1) / n`` for all_reduce.

The model (default): an MLP ``Linear(1024, 4096) - ReLU - Linear(4096, 4096) - ReLU -
Linear(4096, 1024)``, 25.2 M float32 parameters (101 MB of gradients per step), MSE loss
on a fixed random batch of 32 rows per rank, SGD (``--widths``, ``--batch`` change it).
A small batch keeps forward/backward cheap for its size: the step is dominated by moving
and reducing 101 MB per rank, which DDP overlaps with backward; ``step - no comm`` is what
communication added.

Next to every figure: ``cores``, the CPU time of all ranks over the wall time of the same
section, and the machine's load average per job. On a host shared with other work both
backends get less than the cores they could use, and not evenly: read the ratios against
those (a busy machine shows as low ``cores`` for both backends). The DDP table's
``helpers`` column is the CPU per step of every thread of a rank but the training thread
(netdist's progress thread; Gloo's worker and I/O threads), averaged over ranks: with no
idle core, that is what communication costs the step.

Targets (issue 14): DDP step time netdist <= 0.8x Gloo at 2 ranks and <= 1.0x at 4;
all_reduce busbw at 16 and 64 MiB >= 1.3x Gloo at 2 ranks; 8-byte all_reduce latency
<= 0.5x Gloo. One PASS/MISS line per target. When netdist misses one (or with
``--profile always``), one more netdist job runs the missed configuration with rank 0
under cProfile (its main thread, deterministic), a stack sampler (every Python thread,
so the backend's progress thread too) and per-OS-thread CPU time (native threads too), and
the top entries are printed: where the time goes.

    python benchmarks/torch_ddp.py                         # full run, ~15 min on 2 cores
    python benchmarks/torch_ddp.py --rounds 3 --json out.json
    python benchmarks/torch_ddp.py --quick                 # smoke test: tiny sizes
    python benchmarks/torch_ddp.py --candidate gloo        # gloo against gloo
    python benchmarks/torch_ddp.py --layout 2x2 --rate-mbit 1000   # as root, see below

``--layout HxR`` runs every job's ranks on test hosts instead of loopback: a
``netdist.netlab`` cluster of H network namespaces with R ranks each, on one switch,
every host's link shaped to ``--rate-mbit`` both ways (default 1000); the world size is
the layout's (H * R) and all_reduce is timed in the same jobs. It needs root. Every job
is bounded by ``--child-timeout``.
"""

from __future__ import annotations

import argparse
import cProfile
import importlib.metadata
import io
import json
import os
import pstats
import secrets
import socket
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from contextlib import ExitStack
from pathlib import Path
from types import FrameType
from typing import Any, Callable

HERE = os.path.abspath(__file__)
REPO = os.path.dirname(os.path.dirname(HERE))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

MIB = 1024 * 1024
DDP_TARGETS = {2: 0.8, 4: 1.0}
"""world size -> highest allowed netdist / Gloo DDP step-time ratio."""
BUSBW_TARGET = 1.3
"""lowest allowed netdist / Gloo all_reduce busbw ratio at 16 and 64 MiB, 2 ranks."""
BUSBW_SIZES = (16 * MIB, 64 * MIB)
LATENCY_TARGET = 0.5
"""highest allowed netdist / Gloo 8-byte all_reduce latency ratio, 2 ranks."""
LATENCY_SIZE = 8


# -- rank side --------------------------------------------------------------------------

def _build_model(spec: dict[str, Any]) -> Any:
    """The benchmark's MLP, identically initialised on every rank and backend."""
    import torch

    torch.manual_seed(0)
    widths = spec["widths"]
    layers: list[Any] = []
    for i in range(len(widths) - 1):
        layers.append(torch.nn.Linear(widths[i], widths[i + 1]))
        if i < len(widths) - 2:
            layers.append(torch.nn.ReLU())
    return torch.nn.Sequential(*layers)


def _train_steps(model: Any, batch: tuple[Any, Any], steps: int,
                 warmup: int) -> tuple[list[list[float]], list[float]]:
    """Run ``warmup + steps`` SGD steps; return per timed step ``[fwd, bwd, opt]`` seconds
    and every step's loss (float)."""
    import torch

    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    inputs, targets = batch
    times: list[list[float]] = []
    losses: list[float] = []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        optimizer.zero_grad(set_to_none=False)
        loss = torch.nn.functional.mse_loss(model(inputs), targets)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        optimizer.step()
        t3 = time.perf_counter()
        losses.append(float(loss.detach()))
        if i >= warmup:
            times.append([t1 - t0, t2 - t1, t3 - t2])
    return times, losses


def _no_communication(state, bucket):  # type: ignore[no-untyped-def]  # noqa: ANN001
    """A DDP comm hook that hands each bucket back as it is: DDP's own work (bucketing,
    copies, hooks) with no communication at all (the ``no comm`` column). Unannotated:
    DDP rejects a ``bucket`` annotation other than ``dist.GradBucket``, which this
    module imports only in the workers."""
    import torch

    future: Any = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


def _all_reduce_times(dist: Any, tensor: Any, iters: int, warmup: int) -> list[float]:
    """Back-to-back ``dist.all_reduce`` calls, each timed on its own (after one barrier)."""
    for _ in range(warmup):
        dist.all_reduce(tensor)
    dist.barrier()
    times = []
    for _ in range(iters):
        started = time.perf_counter()
        dist.all_reduce(tensor)
        times.append(time.perf_counter() - started)
    return times


def _with_cpu(body: Callable[[], Any]) -> tuple[Any, list[float]]:
    """``body()`` and ``[CPU seconds of this process (every thread), wall seconds, CPU
    seconds of the calling thread]``."""
    import resource

    before = resource.getrusage(resource.RUSAGE_SELF)
    own_before = time.thread_time()
    started = time.perf_counter()
    result = body()
    wall = time.perf_counter() - started
    own = time.thread_time() - own_before
    after = resource.getrusage(resource.RUSAGE_SELF)
    cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    return result, [cpu, wall, own]


class _StackSampler:
    """Samples every thread's Python stack every ``interval`` seconds (own daemon thread).

    cProfile sees only the thread that enabled it; a backend that works on a progress
    thread needs this to show where that thread spends its time. ``leaf`` counts the
    innermost frame of each sample (self time); ``inclusive`` counts every function on the
    stack once per sample (cumulative time). Keys are ``(thread name, function)``. A
    frame's self share includes the C code it called (uvloop's ``run_forever``, autograd's
    ``run_backward``, a lock wait), busy or blocked alike, so the CPU time of every OS
    thread of the process (Python's and native ones: autograd, Gloo) over the same span
    is taken too (``/proc/self/task``; Linux).
    """

    def __init__(self, interval: float = 0.002) -> None:
        self.interval = interval
        self.samples: Counter[str] = Counter()
        self.leaf: Counter[tuple[str, str]] = Counter()
        self.inclusive: Counter[tuple[str, str]] = Counter()
        self.wall = 0.0
        self.cpu: dict[int, tuple[str, float]] = {}
        self._cpu_before: dict[int, tuple[str, float]] = {}
        self._started = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stack-sampler", daemon=True)

    def __enter__(self) -> _StackSampler:
        self._cpu_before = _thread_cpu()
        self._started = time.perf_counter()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self.wall = time.perf_counter() - self._started
        after = _thread_cpu()
        self.cpu = {tid: (name, seconds - self._cpu_before.get(tid, ("", 0.0))[1])
                    for tid, (name, seconds) in after.items()}

    def _run(self) -> None:
        me = threading.get_ident()
        while not self._stop.wait(self.interval):
            names = {t.ident: t.name for t in threading.enumerate()}
            for ident, top in sys._current_frames().items():
                if ident == me:
                    continue
                frame: FrameType | None = top
                name = names.get(ident, f"thread-{ident}")
                self.samples[name] += 1
                seen = set()
                leaf = True
                while frame is not None:
                    code = frame.f_code
                    key = (name, f"{_short_path(code.co_filename)}:{code.co_firstlineno}"
                                 f"({code.co_name})")
                    if leaf:
                        self.leaf[key] += 1
                        leaf = False
                    if key not in seen:
                        seen.add(key)
                        self.inclusive[key] += 1
                    frame = frame.f_back

    def report(self, top: int) -> str:
        """Per thread: the functions most often on top of the stack and on it at all."""
        lines = [f"CPU time per OS thread over {self.wall:.2f} s wall "
                 "(threads that used >= 1%; 100% = one core busy all along):"]
        total_cpu = 0.0
        for tid, (name, seconds) in sorted(self.cpu.items(), key=lambda kv: -kv[1][1]):
            total_cpu += seconds
            if seconds >= 0.01 * self.wall:
                lines.append(f"  {seconds / self.wall:6.1%}  {seconds:7.3f} s  "
                             f"{name} (tid {tid})")
        lines.append(f"  {total_cpu / self.wall:6.1%}  {total_cpu:7.3f} s  whole process")
        lines.append(f"stack samples every {self.interval * 1e3:.0f} ms, per Python thread "
                     "(share of that thread's samples)")
        for name, total in self.samples.most_common():
            lines.append(f"  thread {name!r}: {total} samples")
            for title, counter in (("self", self.leaf), ("on stack", self.inclusive)):
                # frames on every sample of the thread (its entry point) say nothing
                rows = sorted(((c, f) for (t, f), c in counter.items()
                               if t == name and c < total), reverse=True)[:top]
                lines.append(f"    {title}:")
                lines.extend(f"      {c / total:6.1%}  {f}" for c, f in rows)
        return "\n".join(lines)


def _thread_cpu() -> dict[int, tuple[str, float]]:
    """Native thread id -> (name, CPU seconds so far) for every thread of this process:
    Python threads by their ``threading`` name, others by their OS name. Empty where
    ``/proc`` is missing."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    threads = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return {}
    for entry in tids:
        try:
            stat = Path(f"/proc/self/task/{entry}/stat").read_text()
        except OSError:
            continue  # the thread ended meanwhile
        comm = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        tid = int(entry)
        # utime and stime are fields 14 and 15 of stat(5); fields[0] is field 3
        threads[tid] = (names.get(tid, f"[{comm}]"),
                        (int(fields[11]) + int(fields[12])) / tick)
    return threads


def _short_path(path: str) -> str:
    for marker in ("site-packages/", "/lib/python3"):
        if marker in path:
            return path.split(marker, 1)[1]
    return path.replace(REPO + "/", "")


def _profiled(enabled: bool, out: str, name: str, top: int,
              body: Callable[[], Any]) -> Any:
    """Run ``body``; when ``enabled``, under cProfile and the stack sampler, writing the
    text report to ``out/profile_<name>.txt``."""
    if not enabled:
        return body()
    profile = cProfile.Profile()
    with _StackSampler() as sampler:
        profile.enable()
        try:
            result = body()
        finally:
            profile.disable()
    text = io.StringIO()
    stats = pstats.Stats(profile, stream=text)
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(top)
    Path(out, f"profile_{name}.txt").write_text(
        f"cProfile, rank 0 main thread:\n{text.getvalue()}\n{sampler.report(top)}\n")
    return result


def worker(spec: dict[str, Any]) -> None:
    """One rank of one job: init the process group with ``spec["backend"]``, time the
    compute-only step, the DDP step and all_reduce, write ``rank_<r>.json`` to
    ``spec["out"]``."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(spec["threads"])
    if spec["backend"] == "netdist":
        import netdist.torch  # noqa: F401 - registers the "netdist" backend
    dist.init_process_group(spec["backend"], init_method="env://",
                            timeout=timedelta(seconds=spec["timeout"]))
    rank, n = dist.get_rank(), dist.get_world_size()
    profile = spec.get("profile") or []
    prof = rank == 0 and bool(profile)
    out: dict[str, Any] = {"rank": rank, "world_size": n}

    if spec["ddp_steps"] > 0:
        widths = spec["widths"]
        generator = torch.Generator().manual_seed(1000 + rank)
        batch = (torch.randn(spec["batch"], widths[0], generator=generator),
                 torch.randn(spec["batch"], widths[-1], generator=generator))
        if spec["compute_steps"] > 0:
            dist.barrier()
            out["compute"], _ = _train_steps(_build_model(spec), batch,
                                             spec["compute_steps"], 1)
        model = DistributedDataParallel(_build_model(spec))
        dist.barrier()
        (out["ddp"], out["losses"]), out["ddp_cpu"] = _with_cpu(lambda: _profiled(
            prof and "ddp" in profile, spec["out"], "ddp", spec["profile_top"],
            lambda: _train_steps(model, batch, spec["ddp_steps"], spec["warmup"])))
        cpu, _, own = out["ddp_cpu"]
        out["ddp_helpers"] = (cpu - own) / (spec["ddp_steps"] + spec["warmup"])
        out["params"] = sum(p.numel() for p in model.parameters())
        del model
        if spec["compute_steps"] > 0:
            # DDP exactly as above but with a comm hook that sends nothing: what the step
            # would cost if communication were free, for any backend
            floor_model = DistributedDataParallel(_build_model(spec))
            floor_model.register_comm_hook(None, _no_communication)
            dist.barrier()
            out["floor"], _ = _train_steps(floor_model, batch, spec["ddp_steps"],
                                           spec["warmup"])
            del floor_model

    out["all_reduce"], out["all_reduce_cpu"] = {}, {}
    for size in spec["sizes"]:
        # zeros: a sum of ones would double each call and overflow float32 within ~130
        tensor = torch.zeros(max(1, size // 4), dtype=torch.float32)
        iters = spec["latency_iters"] if size < MIB else spec["bw_iters"]
        key = str(tensor.numel() * 4)
        out["all_reduce"][key], out["all_reduce_cpu"][key] = _with_cpu(lambda: _profiled(
            prof and f"all_reduce:{size}" in profile, spec["out"], f"all_reduce_{size}",
            spec["profile_top"],
            lambda: _all_reduce_times(dist, tensor, iters, spec["warmup"])))
    Path(spec["out"], f"rank_{rank}.json").write_text(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()


# -- orchestration ----------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _launch_in_cluster(cluster: Any, argv: list[str], env: dict[str, str],
                       timeout: float) -> int:
    """Run ``argv`` on every rank of a ``netdist.netlab`` cluster (torch's variables set
    by ``Cluster.rank_env``); the first failing rank's exit status, else 0."""
    global _cluster_jobs
    _cluster_jobs += 1
    env = dict(env, PYTHONPATH=os.pathsep.join(
        p for p in (REPO, os.environ.get("PYTHONPATH")) if p))
    results = cluster.run(lambda rank: argv, timeout, port=29500 + 2 * _cluster_jobs,
                          token=secrets.token_hex(16), torch=True, extra=env)
    failed = [r for r in results if not r.ok]
    for r in failed:
        how = "killed" if r.killed else f"exit {r.returncode}"
        print(f"# rank {r.rank} ({how}); stderr ends:\n{r.stderr[-1500:]}", file=sys.stderr,
              flush=True)
    return next((r.returncode or 1 for r in failed), 0)


_cluster_jobs = 0
"""Jobs run in clusters so far: each takes ports of its own (no wait on TIME_WAIT)."""


def run_job(spec: dict[str, Any], n: int, timeout: float,
            keep_profile: bool = False, cluster: Any = None) -> dict[str, Any] | None:
    """Launch one job of ``n`` ranks (on loopback, or on ``cluster``'s hosts); return its
    merged result, or None if it failed.

    Merged: per timed iteration, the slowest rank's time. With ``keep_profile``, the
    profile reports rank 0 wrote come back under ``"profiles"``.
    """
    from netdist.launcher import launch

    with tempfile.TemporaryDirectory() as tmp:
        spec = dict(spec, out=tmp)
        spec_path = os.path.join(tmp, "spec.json")
        Path(spec_path).write_text(json.dumps(spec))
        threads = str(spec["threads"])
        argv = [sys.executable, HERE, "--worker", spec_path]
        env = {"PYTHONPATH": REPO, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}
        if cluster is not None:
            code = _launch_in_cluster(cluster, argv, env, timeout)
        else:
            code = launch(argv, n, timeout=timeout,
                          env=dict(env, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port())))
        paths = [Path(tmp, f"rank_{r}.json") for r in range(n)]
        if not all(p.exists() for p in paths):
            print(f"# {spec['backend']} n={n}: job failed (exit {code})", file=sys.stderr,
                  flush=True)
            return None
        if code != 0:
            # every rank wrote its results before the last barrier: the failure came in
            # teardown (Gloo sometimes aborts at interpreter exit); keep the numbers, say so
            print(f"# {spec['backend']} n={n}: exit {code} after every rank wrote its "
                  "results (teardown); results kept", file=sys.stderr, flush=True)
        ranks = [json.loads(p.read_text()) for p in paths]
        profiles = {p.stem.removeprefix("profile_"): p.read_text()
                    for p in sorted(Path(tmp).glob("profile_*.txt"))} if keep_profile else {}
    merged: dict[str, Any] = {"profiles": profiles, "exit_code": code}
    for key in ("compute", "ddp", "floor"):
        if key in ranks[0]:
            # per step: the slowest rank's [fwd, bwd, opt] by total, as measured there
            merged[key] = [max((r[key][i] for r in ranks), key=sum)
                           for i in range(len(ranks[0][key]))]
    if "losses" in ranks[0]:
        merged["losses"] = ranks[0]["losses"]
        merged["params"] = ranks[0]["params"]
        merged["ddp_cores"] = _busy_cores([r["ddp_cpu"] for r in ranks])
        merged["ddp_helpers"] = statistics.mean(r["ddp_helpers"] for r in ranks)
    merged["all_reduce_cores"] = {int(size): _busy_cores([r["all_reduce_cpu"][size]
                                                          for r in ranks])
                                  for size in ranks[0]["all_reduce_cpu"]}
    merged["all_reduce"] = {
        int(size): [max(r["all_reduce"][size][i] for r in ranks)
                    for i in range(len(times))]
        for size, times in ranks[0]["all_reduce"].items()}
    return merged


def _busy_cores(spans: list[list[float]]) -> float:
    """Cores the job kept busy on average over a section: every rank's CPU seconds over
    the longest rank's wall time. Next to the cores available it says whether the job had
    the machine to itself (other load shows as a low figure for both backends) and how
    much CPU a backend spends on the same work."""
    return sum(span[0] for span in spans) / max(max(span[1] for span in spans), 1e-9)


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _fmt_time(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 1e-3:
        return f"{seconds * 1e6:.0f} us"
    return f"{seconds * 1e3:.2f} ms" if seconds < 1 else f"{seconds:.3f} s"


def _load() -> str:
    """The machine's 1-minute load average, to read the figures against (other work on
    the cores slows both backends, and not evenly)."""
    try:
        return f"load average {os.getloadavg()[0]:.1f}"
    except OSError:
        return "load average unknown"


def _fmt_cores(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _fmt_size(nbytes: int) -> str:
    from netdist.collectives.benchmark import format_size

    return format_size(nbytes)


def _ratio_range(pairs: list[tuple[float, float]]) -> str:
    ratios = [a / b for a, b in pairs if a and b]
    return f"{min(ratios):.2f}-{max(ratios):.2f}" if ratios else "-"


def summarise(rounds: list[dict[tuple[str, int], dict[str, Any] | None]],
              labels: tuple[str, str], world_sizes: list[int],
              sizes: list[int]) -> dict[str, Any]:
    """Per-round medians of every job, then the median over rounds per backend and the
    ratio candidate / baseline (timings) or candidate / baseline busbw."""
    cand, base = labels
    ddp_rows, ar_rows = [], []
    for n in world_sizes:
        per: dict[str, dict[str, list[float]]] = {
            b: {"step": [], "compute": [], "floor": [], "fwd": [], "bwd": [], "opt": [],
                "cores": [], "helpers": []}
            for b in labels}
        pairs = []
        losses: dict[str, Any] = {}
        params = None
        for rnd in rounds:
            medians = {}
            for b in labels:
                job = rnd.get((b, n))
                if not job or not job.get("ddp"):
                    continue
                steps = job["ddp"]
                medians[b] = statistics.median(sum(s) for s in steps)
                per[b]["step"].append(medians[b])
                for i, part in enumerate(("fwd", "bwd", "opt")):
                    per[b][part].append(statistics.median(s[i] for s in steps))
                for key in ("compute", "floor"):
                    if job.get(key):
                        per[b][key].append(statistics.median(sum(s) for s in job[key]))
                per[b]["cores"].append(job["ddp_cores"])
                per[b]["helpers"].append(job["ddp_helpers"])
                losses.setdefault(b, job["losses"])
                params = job["params"]
            if len(medians) == 2:
                pairs.append((medians[cand], medians[base]))
        if not per[cand]["step"] and not per[base]["step"]:
            continue
        row: dict[str, Any] = {"world_size": n, "params": params, "rounds": len(pairs)}
        for b in labels:
            row[b] = {k: _median(v) for k, v in per[b].items()}
        step_c, step_b = row[cand]["step"], row[base]["step"]
        row["ratio"] = step_c / step_b if step_c and step_b else None
        floors = [row[b]["floor"] for b in labels if row[b]["floor"]]
        # the best ratio any backend could reach: DDP with no communication against the
        # baseline's step (both jobs measure the floor; they differ only by noise)
        row["floor_ratio"] = (statistics.mean(floors) / step_b
                              if floors and step_b else None)
        row["round_ratios"] = [a / b for a, b in pairs]
        row["losses_equal"] = row["losses_max_rel_diff"] = None
        if len(losses) == 2:
            row["losses_equal"] = losses[cand] == losses[base]
            row["losses_max_rel_diff"] = max(
                abs(a - b) / max(abs(b), 1e-30) for a, b in zip(losses[cand], losses[base]))
        ddp_rows.append(row)
    for n in world_sizes:
        factor = 2 * (n - 1) / n
        for size in sizes:
            nbytes = max(1, size // 4) * 4
            per_t: dict[str, list[float]] = {b: [] for b in labels}
            cores: dict[str, list[float]] = {b: [] for b in labels}
            pairs = []
            for rnd in rounds:
                medians = {}
                for b in labels:
                    job = rnd.get((b, n))
                    if job and nbytes in job["all_reduce"]:
                        medians[b] = statistics.median(job["all_reduce"][nbytes])
                        per_t[b].append(medians[b])
                        cores[b].append(job["all_reduce_cores"][nbytes])
                if len(medians) == 2:
                    pairs.append((medians[cand], medians[base]))
            if not per_t[cand] and not per_t[base]:
                continue
            row = {"world_size": n, "size": nbytes, "rounds": len(pairs)}
            for b in labels:
                t = _median(per_t[b])
                row[b] = {"time": t, "busbw_gbps": factor * nbytes / t / 1e9 if t else None,
                          "cores": _median(cores[b])}
            tc, tb = row[cand]["time"], row[base]["time"]
            row["time_ratio"] = tc / tb if tc and tb else None
            row["busbw_ratio"] = tb / tc if tc and tb else None
            row["round_time_ratios"] = [a / b for a, b in pairs]
            ar_rows.append(row)
    return {"ddp": ddp_rows, "all_reduce": ar_rows}


def judge(summary: dict[str, Any]) -> list[dict[str, Any]]:
    """One entry per issue-14 target that was measured: name, value, limit, pass, and
    which job would profile it (``(world_size, profile-key)``)."""
    targets = []
    for row in summary["ddp"]:
        limit = DDP_TARGETS.get(row["world_size"])
        if limit is not None and row["ratio"] is not None:
            floor = row.get("floor_ratio")
            targets.append({"name": f"DDP step time, {row['world_size']} ranks: netdist / "
                                    f"gloo <= {limit:g}",
                            "value": row["ratio"], "limit": limit,
                            "pass": row["ratio"] <= limit,
                            "note": "" if floor is None else
                            f" (with no communication at all: {floor:.2f}x)",
                            "profile": (row["world_size"], "ddp")})
    for row in summary["all_reduce"]:
        if row["world_size"] != 2 or row["time_ratio"] is None:
            continue
        if row["size"] in BUSBW_SIZES:
            targets.append({"name": f"all_reduce busbw {_fmt_size(row['size'])}, 2 ranks: "
                                    f"netdist / gloo >= {BUSBW_TARGET:g}",
                            "value": row["busbw_ratio"], "limit": BUSBW_TARGET,
                            "pass": row["busbw_ratio"] >= BUSBW_TARGET,
                            "profile": (2, f"all_reduce:{row['size']}")})
        elif row["size"] == LATENCY_SIZE:
            targets.append({"name": f"all_reduce 8 B latency, 2 ranks: netdist / gloo <= "
                                    f"{LATENCY_TARGET:g}",
                            "value": row["time_ratio"], "limit": LATENCY_TARGET,
                            "pass": row["time_ratio"] <= LATENCY_TARGET,
                            "profile": (2, f"all_reduce:{row['size']}")})
    return targets


def print_tables(summary: dict[str, Any], labels: tuple[str, str], spec: dict[str, Any],
                 rounds: int, cores: int) -> None:
    """The DDP table and the all_reduce table (medians over rounds, same-run ratios)."""
    cand, base = labels
    widths = spec["widths"]
    print(f"\n# DDP step: MLP {' - '.join(str(w) for w in widths)} (ReLU between), "
          f"batch {spec['batch']} per rank, SGD; median over {rounds} rounds of the per-round "
          f"median of {spec['ddp_steps']} steps (slowest rank per step); compute: the same "
          "steps without DDP; no comm: DDP with a comm hook that sends nothing; cores: CPU time "
          f"of all ranks / wall time over the DDP steps ({cores} available); helpers: CPU "
          "per step per rank of the threads other than the training thread")
    print(f"# {'ranks':>5} {'params':>7} {'backend':>9} {'step':>10} {'compute':>10} "
          f"{'no comm':>10} {'fwd':>10} {'bwd+comm':>10} {'opt':>10} {'cores':>6} {'helpers':>10} {'ratio':>7} "
          f"{'per round':>11}  same losses")
    for row in summary["ddp"]:
        for i, b in enumerate(labels):
            r = row[b]
            params = f"{row['params'] / 1e6:.1f}M" if row["params"] else "-"
            ratio = (f"{row['ratio']:.2f}x" if row["ratio"] else "-") if i == 0 else ""
            spread = (_ratio_range([(x, 1.0) for x in row["round_ratios"]])
                      if i == 0 else "")
            same = ("-" if row["losses_equal"] is None else
                    "bitwise" if row["losses_equal"] else
                    f"no, rel {row['losses_max_rel_diff']:.1e}") if i == 0 else ""
            print(f"  {row['world_size']:>5} {params:>7} {b:>9} {_fmt_time(r['step']):>10} "
                  f"{_fmt_time(r['compute']):>10} {_fmt_time(r['floor']):>10} "
                  f"{_fmt_time(r['fwd']):>10} "
                  f"{_fmt_time(r['bwd']):>10} {_fmt_time(r['opt']):>10} "
                  f"{_fmt_cores(r['cores']):>6} {_fmt_time(r['helpers']):>10} {ratio:>7} "
                  f"{spread:>11}  {same}")
    print(f"\n# dist.all_reduce float32, back to back, each call timed; median over "
          f"{rounds} rounds of the per-round median (slowest rank per call); busbw = "
          "2(n-1)/n * bytes / time; cores as above, over the calls")
    print(f"# {'ranks':>5} {'size':>6} {base + ' time':>14} {cand + ' time':>14} "
          f"{base + ' busbw':>14} {cand + ' busbw':>14} {'time ratio':>10} {'per round':>11} "
          f"{base + ' cores':>12} {cand + ' cores':>14}")
    for row in summary["all_reduce"]:
        bw = {b: row[b]["busbw_gbps"] for b in labels}
        ratio = "-" if row["time_ratio"] is None else f"{row['time_ratio']:.2f}x"
        print(f"  {row['world_size']:>5} {_fmt_size(row['size']):>6} "
              f"{_fmt_time(row[base]['time']):>14} {_fmt_time(row[cand]['time']):>14} "
              f"{'-' if bw[base] is None else f'{bw[base]:.3f} GB/s':>14} "
              f"{'-' if bw[cand] is None else f'{bw[cand]:.3f} GB/s':>14} "
              f"{ratio:>10} "
              f"{_ratio_range([(x, 1.0) for x in row['round_time_ratios']]):>11} "
              f"{_fmt_cores(row[base]['cores']):>12} {_fmt_cores(row[cand]['cores']):>14}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--candidate", default="netdist",
                        help="backend under test (default netdist; gloo to check the script)")
    parser.add_argument("--baseline", default="gloo")
    parser.add_argument("--world-sizes", default=None,
                        help="DDP world sizes (default 2,4; with --layout, its world size)")
    parser.add_argument("--all-reduce-world-sizes", default=None,
                        help="world sizes whose jobs also time all_reduce (default 2; with "
                             "--layout, its world size)")
    parser.add_argument("--layout", default=None, metavar="HxR",
                        help="run the ranks on H test hosts of R ranks (netdist.netlab "
                             "network namespaces on a switch; needs root) instead of "
                             "loopback")
    parser.add_argument("--rate-mbit", type=float, default=1000.0,
                        help="with --layout: each host's link rate, both ways (default 1000)")
    parser.add_argument("--sizes", default="8,16M,64M", help="all_reduce sizes in bytes")
    parser.add_argument("--widths", default="1024,4096,4096,1024",
                        help="MLP layer widths (default: 25.2 M parameters)")
    parser.add_argument("--batch", type=int, default=32, help="rows per rank per step")
    parser.add_argument("--steps", type=int, default=10, help="timed DDP steps per job")
    parser.add_argument("--compute-steps", type=int, default=3,
                        help="timed steps without DDP per job, after one untimed (0: skip "
                             "them and the no-comm DDP steps)")
    parser.add_argument("--warmup", type=int, default=2,
                        help="untimed DDP steps / all_reduce calls per job")
    parser.add_argument("--latency-iters", type=int, default=1000,
                        help="timed calls for sizes under 1 MiB")
    parser.add_argument("--bw-iters", type=int, default=20,
                        help="timed calls for sizes of 1 MiB and more")
    parser.add_argument("--rounds", type=int, default=5,
                        help="rounds; each runs every backend at every world size")
    parser.add_argument("--profile", choices=("auto", "always", "never"), default="auto",
                        help="profile netdist's missed configurations (auto), every "
                             "configuration with a target (always) or none")
    parser.add_argument("--profile-top", type=int, default=25)
    parser.add_argument("--child-timeout", type=float, default=900.0)
    parser.add_argument("--quick", action="store_true",
                        help="smoke test: 2 ranks, a tiny MLP, 8 B and 1 MiB, one round")
    parser.add_argument("--json", default=None, metavar="FILE")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(json.loads(Path(args.worker).read_text()))
        return 0
    layout = None
    if args.layout is not None:
        from netdist.netlab import ClusterLayout, netlab_missing

        try:
            layout = ClusterLayout.parse(args.layout)
        except ValueError as exc:
            parser.error(str(exc))
        if args.world_sizes or args.all_reduce_world_sizes:
            parser.error("--layout sets the world size: leave out --world-sizes and "
                         "--all-reduce-world-sizes")
        missing = netlab_missing()
        if missing is not None:
            print(f"torch_ddp.py --layout runs its ranks in network namespaces and cannot "
                  f"here: {missing}", file=sys.stderr)
            return 2
        args.world_sizes = args.all_reduce_world_sizes = str(layout.world_size)
    args.world_sizes = args.world_sizes or "2,4"
    args.all_reduce_world_sizes = args.all_reduce_world_sizes or "2"
    if args.quick:
        if layout is None:
            args.world_sizes = args.all_reduce_world_sizes = "2"
        args.sizes, args.widths, args.batch = "8,1M", "64,128,64", 4
        args.steps, args.compute_steps, args.warmup = 3, 2, 1
        args.latency_iters, args.bw_iters, args.rounds = 20, 3, 1
        if args.profile == "auto":
            args.profile = "never"
    from netdist.collectives.benchmark import parse_sizes

    try:
        world_sizes = [int(x) for x in args.world_sizes.split(",") if x.strip()]
        ar_sizes = {int(x) for x in args.all_reduce_world_sizes.split(",") if x.strip()}
        widths = [int(w) for w in args.widths.split(",") if w.strip()]
        sizes = parse_sizes(args.sizes)
    except ValueError as exc:
        parser.error(str(exc))
    if not world_sizes or min(world_sizes) < 1:
        parser.error("--world-sizes needs world sizes >= 1")
    if not ar_sizes <= set(world_sizes):
        parser.error("--all-reduce-world-sizes must be among --world-sizes (all_reduce is "
                     "timed in the same jobs)")
    if len(widths) < 2 or min(widths) < 1:
        parser.error("--widths needs at least two positive layer widths")
    for name in ("batch", "steps", "latency_iters", "bw_iters", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.warmup < 0 or args.compute_steps < 0:
        parser.error("--warmup and --compute-steps must not be negative")
    labels = (args.candidate, args.baseline)
    if args.candidate == args.baseline:
        labels = (f"{args.candidate}'", args.baseline)  # same backend twice: tell apart
    backend_of = {labels[0]: args.candidate, labels[1]: args.baseline}
    cores = os.cpu_count() or 1
    spec_base: dict[str, Any] = {
        "widths": widths, "batch": args.batch,
        "ddp_steps": args.steps, "compute_steps": args.compute_steps,
        "warmup": args.warmup, "latency_iters": args.latency_iters,
        "bw_iters": args.bw_iters, "timeout": args.child_timeout, "profile": [],
        "profile_top": args.profile_top}
    torch_version = importlib.metadata.version("torch")  # importing torch here costs ~2 s
    where = ("loopback" if layout is None else
             f"cluster {layout} ({layout.hosts} hosts, {args.rate_mbit:g} Mbit/s links)")
    print(f"# torch {torch_version}, {cores} cores ({_load()}); {args.candidate} against "
          f"{args.baseline}; {args.rounds} rounds, backend order alternating; {where}"
          + (" (--quick: tiny sizes, the PASS/MISS lines below are no evidence)"
             if args.quick else ""), flush=True)

    def spec_for(label: str, n: int) -> dict[str, Any]:
        return dict(spec_base, backend=backend_of[label], threads=max(1, cores // n),
                    sizes=sizes if n in ar_sizes else [])

    stack = ExitStack()
    cluster = None
    if layout is not None:
        from netdist.netlab import Cluster

        cluster = stack.enter_context(Cluster.create(layout, rate_mbit=args.rate_mbit))
    with stack:
        return _run_rounds(args, labels, world_sizes, sizes, spec_base, spec_for, cores,
                           torch_version, cluster)


def _run_rounds(args: argparse.Namespace, labels: tuple[str, str], world_sizes: list[int],
                sizes: list[int], spec_base: dict[str, Any],
                spec_for: Callable[[str, int], dict[str, Any]], cores: int,
                torch_version: str, cluster: Any) -> int:
    """Every round, the tables, the targets, the profiles of missed ones, the JSON."""
    rounds: list[dict[tuple[str, int], dict[str, Any] | None]] = []
    for r in range(args.rounds):
        order = labels if r % 2 == 0 else labels[::-1]
        results: dict[tuple[str, int], dict[str, Any] | None] = {}
        for n in world_sizes:
            for label in order:
                started = time.perf_counter()
                results[(label, n)] = run_job(spec_for(label, n), n, args.child_timeout,
                                              cluster=cluster)
                job = results[(label, n)]
                step = (statistics.median(sum(s) for s in job["ddp"])
                        if job and job.get("ddp") else None)
                busy = _fmt_cores(job.get("ddp_cores")) if job else "-"
                print(f"# round {r + 1}/{args.rounds}: {label} at {n} ranks, median step "
                      f"{_fmt_time(step)}, {busy} cores busy "
                      f"({time.perf_counter() - started:.0f} s; {_load()})", flush=True)
        rounds.append(results)

    summary = summarise(rounds, labels, world_sizes, sizes)
    print_tables(summary, labels, spec_base, args.rounds, cores)
    targets = judge(summary)
    print()
    for target in targets:
        print(f"{'PASS' if target['pass'] else 'MISS'}  {target['name']}: "
              f"{target['value']:.2f}x{target.get('note', '')}", flush=True)
    failed = [(b, n) for rnd in rounds for (b, n), job in rnd.items() if job is None]
    if failed:
        print(f"# failed jobs: {sorted(set(failed))}", flush=True)
    teardown = sorted({f"{b}@{n}: exit {job['exit_code']}" for rnd in rounds
                       for (b, n), job in rnd.items() if job and job["exit_code"]})
    if teardown:
        print(f"# failed in teardown, after writing results: {', '.join(teardown)}",
              flush=True)

    profiles: dict[str, str] = {}
    wanted = [t["profile"] for t in targets
              if args.profile == "always" or (args.profile == "auto" and not t["pass"])]
    for n in sorted({n for n, _ in wanted}):
        keys = sorted({key for m, key in wanted if m == n})
        print(f"\n# where the time goes: {args.candidate} at {n} ranks, rank 0 profiled "
              f"({', '.join(keys)})", flush=True)
        spec = dict(spec_for(labels[0], n), profile=keys, compute_steps=0,
                    sizes=[int(k.split(":")[1]) for k in keys if k.startswith("all_reduce:")])
        if "ddp" not in keys:
            spec["ddp_steps"] = 0
        job = run_job(spec, n, args.child_timeout, keep_profile=True, cluster=cluster)
        if job is None:
            continue
        for name, text in job["profiles"].items():
            profiles[f"{n}:{name}"] = text
            print(f"\n## profile {name}, {n} ranks, {args.candidate}\n{text}", flush=True)

    if args.json:
        Path(args.json).write_text(json.dumps({
            "candidate": args.candidate, "baseline": args.baseline, "labels": list(labels),
            "cores": cores, "torch": torch_version, "rounds": args.rounds,
            "layout": args.layout, "rate_mbit": args.rate_mbit if args.layout else None,
            "quick": args.quick, "model": {"widths": spec_base["widths"],
                                           "batch": args.batch, "steps": args.steps},
            "ddp": summary["ddp"], "all_reduce": summary["all_reduce"],
            "targets": [{k: v for k, v in t.items() if k != "profile"} for t in targets],
            "failed_jobs": sorted({f"{b}@{n}" for b, n in failed}),
            "teardown_failures": teardown,
            "profiles": profiles}, indent=2))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
