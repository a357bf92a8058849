"""torch's own distributed test suite, run for Gloo and for netdist on this machine.

torch ships its distributed test suite in the wheel
(``torch.testing._internal.distributed.distributed_test``: ``DistributedTest._DistTestBase``
mixed into ``TestDistBackend``). pytorch runs it per backend through
``test/distributed/test_distributed_spawn.py``: every test spawns ``WORLD_SIZE`` fresh
ranks that rendezvous through a ``file://`` store and run the test body; the parent joins
them, and a rank's exception fails the test. ``tests/torch/conformance_suite.py`` is that
file for any backend: for ``netdist`` it imports ``netdist.torch`` in every process (the
parent and each spawned rank) and declares netdist's features in
``DistTestCases.backend_feature`` ("cpu", "ddp", "subgroup", "plugin"; not "gpu"/"cuda"),
as torch asks an out-of-tree backend to do.

This script picks the tests (``-k``/``--exclude`` regular expressions, ``--tests-file``,
``--shard I/N``), runs them in batches of ``--batch`` per worker process, ``--jobs``
workers at a time, with a per-test time limit (torch's own join timeout, set through
``DISTRIBUTED_TESTS_DEFAULT_TIMEOUT``, and a watchdog above it that kills a hung worker's
process group and records the test as an error), and prints per backend the passed /
failed / skipped / error counts and, when both ran, every test that passes on Gloo but not
on netdist with the first line of its failure. ``--json`` writes all of it.

    python benchmarks/torch_conformance.py                          # both, world size 2
    python benchmarks/torch_conformance.py --backend gloo --jobs 2 --json gloo.json
    python benchmarks/torch_conformance.py -k all_reduce -k broadcast --backend both
    python benchmarks/torch_conformance.py --backend netdist --gate-as gloo   # see below
    python benchmarks/torch_conformance.py --start-method forkserver --jobs 2 --gate-as gloo

Some tests are gated on the backend's *name* ("Only gloo backend supports timeouts",
``require_backend_is_available({"gloo"})``, or the "gpu" feature set, which also gates
CPU tests); on netdist they are skipped. ``--gate-as gloo`` imports torch's suite as if
the backend were Gloo (so exactly Gloo's tests run) and then hands it the real backend,
to show what those gloo-only tests do on netdist; the report then also gives the counts
netdist's own gating would have (those tests turned into skips), and marks them
"[gloo-only by name]" in the list. A few such test bodies branch on the backend's name
at run time (``if BACKEND == "gloo": ddp_model = ...``) and fail under ``--gate-as`` for
that reason alone (test_accumulate_gradients_no_sync*).

Time (this 2-core machine, world size 2, 285 tests): with ``--start-method spawn`` (the
default, pytorch's way: every rank imports torch and the suite, ~3 s) about 4-5 s a test
idle, 81 min for Gloo alone with other jobs loading the machine (load 10-20);
``--start-method forkserver`` forks ranks from a server that imported them once: 4.7 min
for Gloo and 4 min for netdist at ``--jobs 2`` (load ~7), with the same counts.

Exit status: 1 if a test passes on Gloo but fails or errors on netdist (when both ran),
or, for a single backend, if any test failed or errored; else 0. Runs only on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, TextIO

HERE = os.path.abspath(__file__)
REPO = os.path.dirname(os.path.dirname(HERE))
SUITE = os.path.join(REPO, "tests", "torch", "conformance_suite.py")

OUTCOMES = ("passed", "failed", "error", "skipped")

#: Environment that a surrounding launcher (torchrun, netdist launch, Slurm) may have set
#: and that must not leak into the suite's own ranks.
_STRIPPED_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE",
                 "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "INIT_METHOD", "TEMP_DIR",
                 "BACKEND", "NETDIST_COORDINATOR", "NETDIST_RANK", "NETDIST_WORLD_SIZE",
                 "NETDIST_JOB_ID", "NETDIST_RESTART_COUNT", "CONFORMANCE_GATE_AS",
                 "CONFORMANCE_START_METHOD")

#: Seconds the watchdog waits past a test's own join timeout before killing its worker.
_WATCHDOG_GRACE = 60.0


@dataclass(frozen=True, slots=True)
class Settings:
    """How one backend's run is made (everything that changes a result is in here)."""

    backend: str
    world_size: int
    timeout: int
    init_method: str
    gate_as: str
    start_method: str
    jobs: int
    batch: int
    log_dir: str


@dataclass(slots=True)
class _Worker:
    """One worker process running a batch of tests, and what it has reported so far."""

    proc: subprocess.Popen[bytes]
    tests: list[str]
    out_path: str
    log: TextIO
    offset: int = 0
    current: str | None = None
    current_started: float = 0.0
    current_limit: float = 0.0
    log_offset: int = 0
    done: set[str] = field(default_factory=set)


def _ask_suite(flag: str, backend: str, world_size: int, init_method: str,
               gate_as: str = "") -> str:
    """Run the suite script with ``flag`` (``--list``, ``--list-skips``); its stdout."""
    with tempfile.TemporaryDirectory(prefix="torch_conformance_list_") as temp_dir:
        env = _suite_env(backend, world_size, 300, init_method, gate_as, "spawn", temp_dir)
        done = subprocess.run([sys.executable, SUITE, flag], env=env, cwd=REPO,
                              capture_output=True, text=True, timeout=300, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"asking torch's suite for {flag} under {backend} failed:\n"
                           f"{done.stderr[-4000:]}")
    return done.stdout


def list_tests(world_size: int) -> list[str]:
    """Every test name of torch's suite, asked of the suite itself (under Gloo)."""
    out = _ask_suite("--list", "gloo", world_size, "file")
    return [line.strip() for line in out.splitlines() if line.strip()]


def import_time_skips(backend: str, world_size: int, init_method: str) -> dict[str, str]:
    """``{test: reason}``: what torch's suite skips at import for ``backend``'s own name
    and declared features (see ``conformance_suite.import_time_skips``)."""
    skips: dict[str, str] = json.loads(_ask_suite("--list-skips", backend, world_size,
                                                  init_method))
    return skips


def own_gating(results: dict[str, dict[str, Any]],
               skips: dict[str, str]) -> dict[str, dict[str, Any]]:
    """A ``--gate-as`` run's results as the backend's own gating would have them: the
    tests its name or features skip at import become skips (nothing else changes, since
    a rank re-reads nothing of the gating)."""
    derived = dict(results)
    for name, reason in skips.items():
        if name in derived:
            derived[name] = {"outcome": "skipped", "seconds": 0.0, "reason": reason}
    return derived


def select_tests(names: list[str], include: list[str], exclude: list[str],
                 shard: tuple[int, int] | None) -> list[str]:
    """The tests matching any ``include`` regex (all if none) and no ``exclude`` one,
    then every N-th of them starting at I-1 for ``shard=(I, N)``."""
    chosen = [name for name in names
              if (not include or any(re.search(pat, name) for pat in include))
              and not any(re.search(pat, name) for pat in exclude)]
    if shard is not None:
        index, count = shard
        chosen = chosen[index - 1::count]
    return chosen


def _suite_env(backend: str, world_size: int, timeout: int, init_method: str,
               gate_as: str, start_method: str, temp_dir: str) -> dict[str, str]:
    """Environment of a worker process: the suite's variables, nothing from a launcher."""
    env = {key: value for key, value in os.environ.items() if key not in _STRIPPED_ENV}
    env.update(BACKEND=backend, WORLD_SIZE=str(world_size), TEMP_DIR=temp_dir,
               DISTRIBUTED_TESTS_DEFAULT_TIMEOUT=str(timeout), PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH")) if p)
    if init_method == "file":
        # pytorch's CI runs the spawn suite once "with file init_method": the suite reads
        # INIT_METHOD at import, and a few tests run only under file:// (each test still
        # makes its own rendezvous file).
        env["INIT_METHOD"] = "file://" + os.path.join(temp_dir, "init_file")
    if gate_as:
        env["CONFORMANCE_GATE_AS"] = gate_as
    env["CONFORMANCE_START_METHOD"] = start_method
    return env


def _start_worker(settings: Settings, tests: list[str], serial: int) -> _Worker:
    """Start one worker process (its own process group) on ``tests``."""
    temp_dir = tempfile.mkdtemp(prefix=f"w{serial}_", dir=settings.log_dir)
    out_path = os.path.join(settings.log_dir, f"{settings.backend}_w{serial}.jsonl")
    log = open(os.path.join(settings.log_dir, f"{settings.backend}_w{serial}.log"), "w",
               encoding="utf-8")
    env = _suite_env(settings.backend, settings.world_size, settings.timeout,
                     settings.init_method, settings.gate_as, settings.start_method,
                     temp_dir)
    proc = subprocess.Popen([sys.executable, SUITE, "--out", out_path, *tests], env=env,
                            cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    return _Worker(proc=proc, tests=tests, out_path=out_path, log=log)


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    """Kill a worker and every rank it spawned (they share its process group)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        pass


def _read_events(worker: _Worker) -> list[dict[str, Any]]:
    """New complete JSON lines the worker appended since the last call."""
    try:
        with open(worker.out_path, "rb") as handle:
            handle.seek(worker.offset)
            data = handle.read()
    except FileNotFoundError:
        return []
    end = data.rfind(b"\n") + 1
    worker.offset += end
    return [json.loads(line) for line in data[:end].splitlines() if line.strip()]


def _absorb(worker: _Worker, results: dict[str, dict[str, Any]], settings: Settings,
            total: int, progress: TextIO | None) -> None:
    """Take the worker's new events into ``results`` and its current-test state."""
    for event in _read_events(worker):
        if event["event"] == "start":
            worker.current = event["test"]
            worker.current_started = time.monotonic()
            worker.current_limit = float(event.get("timeout", settings.timeout))
            offset = int(event.get("log_offset", -1))
            worker.log_offset = offset if offset >= 0 else os.path.getsize(worker.log.name)
        elif event["event"] == "end":
            record = {k: event[k] for k in ("outcome", "seconds", "reason")}
            if event["outcome"] in ("failed", "error"):
                record["detail"] = event.get("detail", "")[-6000:]
                _explain_exit(record, worker)
            _record(results, worker, event["test"], record, settings, total, progress)


_EXIT_CODE = re.compile(r"Expected exit code (-?\d+) but got (-?\d+)")
_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt|Timeout)\b")


def _explain_exit(record: dict[str, Any], worker: _Worker) -> None:
    """Give a failure that is only "rank 0 exited with code 1" the rank's own reason.

    A rank that raises outside the test body (in init_process_group, torch's file
    barrier, destroy_process_group) exits with status 1 and its traceback goes to the
    worker's log, not through torch's pipe; the log since the test started has it.
    """
    match = _EXIT_CODE.search(record["detail"])
    if not match:
        return
    try:
        with open(worker.log.name, encoding="utf-8", errors="replace") as handle:
            handle.seek(worker.log_offset)
            section = handle.read()[-20000:]
    except OSError:
        return
    lines = [line.rstrip() for line in section.splitlines()]
    cause = next((line for line in lines if _EXCEPTION_LINE.match(line)), "")
    record["reason"] = (f"rank 0 exited with status {match.group(2)}"
                        + (f": {cause[:300]}" if cause else ""))
    record["detail"] += "\n--- worker log since the test started ---\n" + section[-6000:]


def _record(results: dict[str, dict[str, Any]], worker: _Worker, test: str,
            record: dict[str, Any], settings: Settings, total: int,
            progress: TextIO | None) -> None:
    """Store one test's result and print its progress line."""
    results[test] = record
    worker.done.add(test)
    if worker.current == test:
        worker.current = None
    if progress is not None:
        note = f" ({record['reason']})" if record["outcome"] == "error" else ""
        print(f"[{settings.backend} {len(results)}/{total}] {record['outcome']:7} "
              f"{record['seconds']:7.1f}s {test}{note[:300]}", file=progress, flush=True)


def run_backend(settings: Settings, tests: list[str],
                progress: TextIO | None = sys.stdout) -> dict[str, dict[str, Any]]:
    """Run ``tests`` for one backend; return ``{test: {outcome, seconds, reason, ...}}``.

    Tests go out in batches to at most ``jobs`` workers. A worker that hangs (no result
    ``timeout + 60`` s after a test started) is killed with its ranks, and one that exits
    in the middle of a test is noted: that test is recorded as an error and the rest of
    its batch goes back in the queue.
    """
    results: dict[str, dict[str, Any]] = {}
    pending = collections.deque(tests)
    workers: list[_Worker] = []
    serial = 0
    total = len(tests)
    try:
        while pending or workers:
            while pending and len(workers) < settings.jobs:
                batch = [pending.popleft() for _ in range(min(settings.batch, len(pending)))]
                serial += 1
                workers.append(_start_worker(settings, batch, serial))
            for worker in list(workers):
                exited = worker.proc.poll() is not None
                _absorb(worker, results, settings, total, progress)
                hung = (worker.current is not None and time.monotonic()
                        - worker.current_started > worker.current_limit + _WATCHDOG_GRACE)
                if not (hung or exited):
                    continue
                if hung:
                    _kill_group(worker.proc)
                worker.log.close()
                workers.remove(worker)
                if worker.current is not None:
                    seconds = round(time.monotonic() - worker.current_started, 3)
                    why = (f"watchdog: no result {worker.current_limit + _WATCHDOG_GRACE:.0f}"
                           " s after the test started; worker and ranks killed" if hung else
                           f"worker exited with status {worker.proc.returncode} during the "
                           f"test; see {worker.log.name}")
                    _record(results, worker, worker.current,
                            {"outcome": "error", "seconds": seconds, "reason": why,
                             "detail": why}, settings, total, progress)
                    pending.extendleft(reversed([t for t in worker.tests
                                                 if t not in worker.done]))
                else:
                    # exited between tests (e.g. at import): requeueing would loop
                    for name in [t for t in worker.tests if t not in worker.done]:
                        why = (f"worker exited with status {worker.proc.returncode} before "
                               f"the test; see {worker.log.name}")
                        _record(results, worker, name,
                                {"outcome": "error", "seconds": 0.0, "reason": why,
                                 "detail": why}, settings, total, progress)
            if workers:
                # A monitor's poll interval, not synchronisation: results come from files.
                time.sleep(0.25)
    finally:
        for worker in workers:
            _kill_group(worker.proc)
            worker.log.close()
    return results


def count(results: dict[str, dict[str, Any]]) -> dict[str, int]:
    """``{"passed": n, "failed": n, "error": n, "skipped": n, "total": n}``."""
    counts = {outcome: 0 for outcome in OUTCOMES}
    for record in results.values():
        counts[record["outcome"]] += 1
    counts["total"] = len(results)
    return counts


def compare(reference: dict[str, dict[str, Any]],
            candidate: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Tests that passed in ``reference`` but not in ``candidate``, with the reason."""
    return [{"test": name, "outcome": candidate[name]["outcome"],
             "reason": candidate[name]["reason"]}
            for name in sorted(reference)
            if reference[name]["outcome"] == "passed" and name in candidate
            and candidate[name]["outcome"] != "passed"]


def _parse_shard(text: str) -> tuple[int, int]:
    """``"I/N"`` with 1 <= I <= N."""
    match = re.fullmatch(r"(\d+)/(\d+)", text)
    if not match or not 1 <= int(match.group(1)) <= int(match.group(2)):
        raise argparse.ArgumentTypeError(f"--shard wants I/N with 1 <= I <= N, got {text!r}")
    return int(match.group(1)), int(match.group(2))


def main(argv: list[str] | None = None) -> int:
    """Command line; see the module docstring."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backend", choices=("gloo", "netdist", "both"), default="both")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("-k", dest="include", action="append", default=[],
                        help="regex a test name must match (repeatable: any of them)")
    parser.add_argument("--exclude", action="append", default=[],
                        help="regex a test name must not match (repeatable)")
    parser.add_argument("--tests-file", help="run exactly these tests (one a line)")
    parser.add_argument("--shard", type=_parse_shard, help="I/N: every N-th selected test")
    parser.add_argument("--jobs", type=int, default=1,
                        help="worker processes at once (each runs WORLD_SIZE ranks)")
    parser.add_argument("--batch", type=int, default=8, help="tests per worker process")
    parser.add_argument("--timeout", type=int, default=300,
                        help="per-test join timeout in s (torch's default 300); a worker "
                        "is killed 60 s past it")
    parser.add_argument("--init-method", choices=("file", "env"), default="file",
                        help="INIT_METHOD the suite is imported with (pytorch CI runs both)")
    parser.add_argument("--gate-as", default="",
                        help="evaluate the suite's backend-name skips as this backend "
                        "(e.g. gloo) and run the real one")
    parser.add_argument("--start-method", choices=("spawn", "forkserver"), default="spawn",
                        help="how ranks start: spawn (pytorch's; ~3 s of imports per rank "
                        "per test) or forkserver (forked from a process that imported "
                        "torch and the suite once; much faster, same test bodies)")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--log-dir", help="worker logs and raw results (default: a new "
                        "directory under /tmp, kept)")
    parser.add_argument("--list", action="store_true", help="print the selection, run none")
    parser.add_argument("--quiet", action="store_true", help="no per-test progress lines")
    args = parser.parse_args(argv)
    if args.world_size < 2 or args.jobs < 1 or args.batch < 1 or args.timeout < 1:
        parser.error("--world-size >= 2, --jobs, --batch and --timeout >= 1")

    names = list_tests(args.world_size)
    if args.tests_file:
        with open(args.tests_file, encoding="utf-8") as handle:
            wanted = [line.strip() for line in handle if line.strip()
                      and not line.startswith("#")]
        unknown = sorted(set(wanted) - set(names))
        if unknown:
            parser.error(f"not in torch's suite: {', '.join(unknown)}")
        names = wanted
    tests = select_tests(names, args.include, args.exclude, args.shard)
    if args.list:
        print("\n".join(tests))
        return 0
    if not tests:
        parser.error("no test selected")

    import torch  # only for the report: the version that was tested

    log_dir = args.log_dir or tempfile.mkdtemp(prefix="torch_conformance_")
    os.makedirs(log_dir, exist_ok=True)
    backends = ["gloo", "netdist"] if args.backend == "both" else [args.backend]
    report: dict[str, Any] = {
        "torch": torch.__version__, "python": sys.version.split()[0],
        "command": [os.path.relpath(HERE, REPO), *(sys.argv[1:] if argv is None else argv)],
        "world_size": args.world_size, "init_method": args.init_method,
        "timeout": args.timeout, "jobs": args.jobs, "start_method": args.start_method, "cpus": os.cpu_count(),
        "selected": len(tests), "log_dir": log_dir, "backends": {},
    }
    print(f"torch {torch.__version__}: {len(tests)} tests, world size {args.world_size}, "
          f"backends {', '.join(backends)}, jobs {args.jobs}; logs in {log_dir}", flush=True)
    all_results: dict[str, dict[str, dict[str, Any]]] = {}
    for backend in backends:
        settings = Settings(backend=backend, world_size=args.world_size,
                            timeout=args.timeout, init_method=args.init_method,
                            gate_as=args.gate_as if backend != "gloo" else "",
                            start_method=args.start_method,
                            jobs=args.jobs, batch=args.batch, log_dir=log_dir)
        started = time.monotonic()
        results = run_backend(settings, tests, None if args.quiet else sys.stdout)
        wall = time.monotonic() - started
        all_results[backend] = results
        report["backends"][backend] = {"counts": count(results), "seconds": round(wall, 1),
                                       "gate_as": settings.gate_as, "tests": results}
        if settings.gate_as and settings.gate_as != backend:
            skips = import_time_skips(backend, args.world_size, args.init_method)
            own = own_gating(results, skips)
            report["backends"][backend]["own_gating"] = {
                "counts": count(own),
                "skipped_by_name": {n: r for n, r in sorted(skips.items()) if n in results
                                    and results[n]["outcome"] != "skipped"}}
        if args.json:
            _write_json(args.json, report)

    print()
    for backend in backends:
        info = report["backends"][backend]
        c = info["counts"]
        label = f"{backend} (gated as {info['gate_as']})" if info["gate_as"] else backend
        print(f"{label:26} passed {c['passed']:4}  failed {c['failed']:4}  skipped "
              f"{c['skipped']:4}  errors {c['error']:4}  (of {c['total']}, "
              f"{info['seconds']:.0f} s)")
        if "own_gating" in info:
            c = info["own_gating"]["counts"]
            print(f"{backend + ' (own gating)':26} passed {c['passed']:4}  failed "
                  f"{c['failed']:4}  skipped {c['skipped']:4}  errors {c['error']:4}  "
                  f"(derived: {len(info['own_gating']['skipped_by_name'])} more tests "
                  "skipped by name)")
    status = 0
    if len(backends) == 2:
        missing = compare(all_results["gloo"], all_results["netdist"])
        report["gloo_pass_netdist_not"] = missing
        broken = [m for m in missing if m["outcome"] != "skipped"]
        print(f"\npass on gloo, not on netdist: {len(missing)} "
              f"({len(broken)} failed/error, {len(missing) - len(broken)} skipped)")
        by_name = report["backends"]["netdist"].get("own_gating", {}).get("skipped_by_name", {})
        for item in missing:
            # a test netdist's own name/features would skip: only run because of --gate-as
            item["skipped_by_name_without_gate_as"] = item["test"] in by_name
            mark = " [gloo-only by name]" if item["test"] in by_name else ""
            print(f"  {item['outcome']:7} {item['test']}{mark}: {item['reason']}")
        status = 1 if broken else 0
    else:
        c = report["backends"][backends[0]]["counts"]
        status = 1 if c["failed"] or c["error"] else 0
    if args.json:
        _write_json(args.json, report)
        print(f"\nresults: {args.json}")
    if not args.log_dir:
        # keep only the logs worth reading: those of failed tests' workers stay either way
        for entry in os.listdir(log_dir):
            path = os.path.join(log_dir, entry)
            if os.path.isdir(path):
                shutil.rmtree(path, ignore_errors=True)
    return status


def _write_json(path: str, report: dict[str, Any]) -> None:
    """Write ``report`` to ``path`` through a temporary sibling and a rename."""
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as handle:
        json.dump(report, handle, indent=1, sort_keys=True)
    os.replace(tmp, path)


if __name__ == "__main__":
    sys.exit(main())
