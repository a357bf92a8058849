"""torch's own distributed test suite, run for one backend; a script.

torch ships ``torch.testing._internal.distributed.distributed_test`` in its wheel; pytorch's
``test/distributed/test_distributed_spawn.py`` runs it for a backend by mixing
``TestDistBackend`` with ``DistributedTest._DistTestBase`` into one test class. This file
does the same for any backend, including the out-of-tree ``netdist``: the environment
names the backend (``BACKEND``) and the world size (``WORLD_SIZE``), and because spawned
ranks re-import this script as ``__mp_main__``, everything a rank needs (``import
netdist.torch``, the feature sets in ``DistTestCases``) happens here at import time, before
torch's suite module is imported (its skip decorators read those sets at import).

It is started by ``benchmarks/torch_conformance.py``, which owns scheduling, timeouts and
the report; this script only runs the named tests one after another and appends one JSON
line per event to ``--out`` (``start`` before a test, ``end`` with its outcome after), so a
shard killed for hanging still leaves every finished result and names the test it hung in.

Environment besides torch's own (BACKEND, WORLD_SIZE, TEMP_DIR, INIT_METHOD,
DISTRIBUTED_TESTS_DEFAULT_TIMEOUT):

- ``CONFORMANCE_START_METHOD``: ``spawn`` (default, as pytorch) or ``forkserver`` (ranks
  fork from a server that imported torch, the suite and the backend once).
- ``CONFORMANCE_GATE_AS``: import torch's suite as if the backend were this one (e.g.
  ``gloo``), so its name-based skips are that backend's, then run the real backend.

    BACKEND=netdist WORLD_SIZE=2 python tests/torch/conformance_suite.py --list-skips
    BACKEND=gloo WORLD_SIZE=2 python tests/torch/conformance_suite.py \\
        --out /tmp/r.jsonl test_all_reduce_sum test_barrier
"""

from __future__ import annotations

import os
import sys

# Run as a script, this file's directory is sys.path[0]; nothing there should shadow an
# installed module in the ranks (spawn hands sys.path on to them).
if sys.path and os.path.abspath(sys.path[0] or ".") == os.path.dirname(os.path.abspath(__file__)):
    del sys.path[0]

import argparse  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
import unittest  # noqa: E402
from typing import Any, TextIO  # noqa: E402

import torch  # noqa: E402

#: What netdist declares in ``DistTestCases.backend_feature``: CPU tensors only (no
#: "gpu"/"cuda"), DDP, subgroups, and "plugin" (an out-of-tree backend that is available
#: once registered). "cpu" is not a key torch's suite reads today; it is recorded anyway.
NETDIST_FEATURES = ("cpu", "ddp", "subgroup", "plugin")

#: ``DistTestCases.skip_collective`` keys that name collectives netdist does NOT implement
#: (empty: it implements everything Gloo does on CPU, issue 14 item 1).
NETDIST_SKIPPED_COLLECTIVES: tuple[str, ...] = ()


def _prepare_environment() -> str:
    """Check and complete the environment torch's suite reads at import; return BACKEND."""
    backend = os.environ.get("BACKEND")
    if not backend:
        raise RuntimeError("BACKEND must name the backend to test (gloo, netdist, ...)")
    if int(os.environ.get("WORLD_SIZE", "0")) < 2:
        raise RuntimeError("WORLD_SIZE must be an integer >= 2")
    if "TEMP_DIR" not in os.environ:
        # test_distributed_spawn.py insists on a TEMP_DIR with a "barrier" directory; each
        # test then makes its own (initialize_temp_directories) and points TEMP_DIR there.
        os.environ["TEMP_DIR"] = tempfile.mkdtemp(prefix="torch_conformance_")
    os.makedirs(os.path.join(os.environ["TEMP_DIR"], "barrier"), exist_ok=True)
    return backend


def register_features(backend: str) -> None:
    """Declare ``backend``'s features in torch's ``DistTestCases`` (idempotent).

    Built-in backends (gloo, nccl, ...) are already listed by torch. For netdist this
    imports ``netdist.torch`` (which registers the backend with torch) and adds it to the
    sets in :data:`NETDIST_FEATURES`, as pytorch asks an out-of-tree backend to do.
    """
    from torch.testing._internal.common_distributed import DistTestCases

    if backend != "netdist":
        return
    import netdist.torch  # noqa: F401  (registers backend "netdist" with torch)

    for feature in NETDIST_FEATURES:
        DistTestCases.backend_feature.setdefault(feature, set()).add(backend)
    for collective in NETDIST_SKIPPED_COLLECTIVES:
        DistTestCases.skip_collective.setdefault(collective, set()).add(backend)


BACKEND = _prepare_environment()
register_features(BACKEND)

# CONFORMANCE_GATE_AS=gloo: torch's suite decides at import which tests to skip, from the
# backend's name ("Only gloo backend supports timeouts", require_backend_is_available
# ({"gloo"}), ...). Importing it under "gloo" and then pointing it at the real backend runs
# exactly the tests Gloo runs, so a gloo-only test shows what the backend really does.
_GATE_AS = os.environ.get("CONFORMANCE_GATE_AS", "") or BACKEND
os.environ["BACKEND"] = _GATE_AS
import torch.testing._internal.distributed.distributed_test as _suite  # noqa: E402

os.environ["BACKEND"] = BACKEND
_suite.BACKEND = BACKEND
DistributedTest = _suite.DistributedTest
TestDistBackend = _suite.TestDistBackend

torch.backends.cuda.matmul.allow_tf32 = False


class TestDistBackendWithSpawn(TestDistBackend, DistributedTest._DistTestBase):
    """pytorch's TestDistBackendWithSpawn: every test spawns WORLD_SIZE fresh ranks."""

    def setUp(self) -> None:
        super().setUp()
        self._spawn_processes()
        torch.backends.cudnn.flags(enabled=True, allow_tf32=False).__enter__()

    def _spawn_processes(self) -> None:
        """Start the ranks with spawn (pytorch's way) or, if asked, with a forkserver.

        ``CONFORMANCE_START_METHOD=forkserver`` forks each rank from a server that has
        already imported torch, the backend and this module, which saves the ~3 s of
        imports every spawned rank pays; the test bodies are unchanged.
        """
        method = os.environ.get("CONFORMANCE_START_METHOD", "spawn")
        if method == "spawn":
            super()._spawn_processes()
            return
        context = torch.multiprocessing.get_context(method)

        def process(target: Any, name: str, args: tuple[Any, ...],
                    kwargs: dict[str, Any]) -> Any:
            # A forked rank inherits the server's environment, not this process's: hand
            # it the environment each test's setUp prepared (TEMP_DIR, INIT_METHOD, ...).
            return context.Process(  # type: ignore[attr-defined]
                target=_run_with_environment, name=name,
                args=(target, dict(os.environ), args, kwargs))

        self._start_processes(process)


def _run_with_environment(target: Any, environment: dict[str, str], args: tuple[Any, ...],
                          kwargs: dict[str, Any]) -> None:
    """A forked rank: take the parent's environment as a spawned rank would, then run."""
    os.environ.clear()
    os.environ.update(environment)
    # torch's suite reads INIT_METHOD at import; a spawned rank would import it afresh
    _suite.INIT_METHOD = os.environ.get("INIT_METHOD", "env://")
    target(*args, **kwargs)


TestDistBackendWithSpawn.__name__ = f"TestDistBackendWithSpawn{BACKEND.upper()}"
TestDistBackendWithSpawn.__qualname__ = TestDistBackendWithSpawn.__name__
globals()[TestDistBackendWithSpawn.__name__] = TestDistBackendWithSpawn


def list_tests() -> list[str]:
    """Names of every test method of the suite, in unittest's (sorted) order."""
    return list(unittest.TestLoader().getTestCaseNames(TestDistBackendWithSpawn))


def import_time_skips() -> dict[str, str]:
    """``{test: reason}`` for the tests torch's suite skips at import for this backend.

    These are decided by decorators from the backend's name and declared features, before
    any rank starts (skips a rank decides at run time, such as "no GPU", are not here).
    """
    skips = {}
    for name in list_tests():
        method = getattr(TestDistBackendWithSpawn, name)
        if getattr(method, "__unittest_skip__", False):
            skips[name] = str(getattr(method, "__unittest_skip_why__", ""))
    return skips


_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt|Failure|Timeout)\b")


def summarize(text: str) -> str:
    """One line saying why a test failed, from a traceback torch's harness produced.

    A rank's exception reaches the parent as ``RuntimeError: Process 0 exited with error
    code 10 and exception:`` followed by the rank's traceback; the useful line is the last
    exception line of that inner traceback (first failing rank), not the wrapper.
    """
    lines = [line.rstrip() for line in text.splitlines()]
    blocks: list[list[str]] = []
    for line in lines:
        if re.match(r"^(RuntimeError: )?Process \d+ exited with error code", line):
            blocks.append([])
        elif blocks:
            blocks[-1].append(line)
    candidates = blocks[0] if blocks else lines
    exc = [line for line in candidates if _EXCEPTION_LINE.match(line)]
    chosen = exc[-1] if exc else next((line for line in reversed(candidates) if line.strip()), "")
    if blocks:
        first = next(line for line in lines if "exited with error code" in line)
        chosen = f"{chosen}  [{first.split(' exited')[0].split(': ')[-1]}]"
    return chosen.strip()[:400]


class _JsonLinesResult(unittest.TestResult):
    """A unittest result that appends one JSON object per event to an open file."""

    def __init__(self, sink: TextIO) -> None:
        super().__init__()
        self._sink = sink
        self._started = 0.0

    def _emit(self, record: dict[str, Any]) -> None:
        self._sink.write(json.dumps(record) + "\n")
        self._sink.flush()

    def startTest(self, test: unittest.TestCase) -> None:
        super().startTest(test)
        self._started = time.monotonic()
        from torch.testing._internal.common_distributed import get_timeout

        sys.stdout.flush()
        sys.stderr.flush()
        try:  # where this test's output (and its ranks', same file) starts in the log
            log_offset = os.lseek(sys.stdout.fileno(), 0, os.SEEK_CUR)
        except (OSError, ValueError):
            log_offset = -1
        self._emit({"event": "start", "test": test._testMethodName, "pid": os.getpid(),
                    "timeout": get_timeout(test.id()), "log_offset": log_offset})

    def _end(self, test: unittest.TestCase, outcome: str, detail: str = "") -> None:
        self._emit({
            "event": "end", "test": test._testMethodName, "outcome": outcome,
            "seconds": round(time.monotonic() - self._started, 3),
            "reason": summarize(detail) if outcome in ("failed", "error") else detail[:400],
            "detail": detail[-20000:],
        })

    def addSuccess(self, test: unittest.TestCase) -> None:
        super().addSuccess(test)
        self._end(test, "passed")

    def addFailure(self, test: unittest.TestCase, err: Any) -> None:
        super().addFailure(test, err)
        self._end(test, "failed", "".join(traceback.format_exception(*err)))

    def addError(self, test: unittest.TestCase, err: Any) -> None:
        super().addError(test, err)
        self._end(test, "error", "".join(traceback.format_exception(*err)))

    def addSkip(self, test: unittest.TestCase, reason: str) -> None:
        super().addSkip(test, reason)
        self._end(test, "skipped", reason)

    def addExpectedFailure(self, test: unittest.TestCase, err: Any) -> None:
        super().addExpectedFailure(test, err)
        self._end(test, "passed", "expected failure")

    def addUnexpectedSuccess(self, test: unittest.TestCase) -> None:
        super().addUnexpectedSuccess(test)
        self._end(test, "failed", "unexpected success")


def run_tests(names: list[str], out_path: str) -> int:
    """Run the named tests in order, appending JSON lines to ``out_path``; return #failed."""
    if os.environ.get("CONFORMANCE_START_METHOD", "spawn") == "forkserver":
        # The server imports the heavy modules once and each rank forks from it; a rank
        # still re-runs this script as __mp_main__ (Python 3.11 cannot preload
        # "__main__" into a forkserver), which is cheap once these are imported.
        preload = ["torch", "torch.distributed", _suite.__name__]
        if BACKEND == "netdist":
            preload.append("netdist.torch")
        torch.multiprocessing.get_context("forkserver").set_forkserver_preload(preload)
    suite = unittest.TestSuite(TestDistBackendWithSpawn(name) for name in names)
    with open(out_path, "a", encoding="utf-8") as sink:
        result = _JsonLinesResult(sink)
        suite.run(result)
    return len(result.failures) + len(result.errors)


def main(argv: list[str] | None = None) -> int:
    """Command line: ``--list`` prints the test names; else run tests into ``--out``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--list", action="store_true", help="print the test names and exit")
    parser.add_argument("--list-skips", action="store_true",
                        help="print {test: reason} of import-time skips as JSON and exit")
    parser.add_argument("--out", help="JSON-lines file the results are appended to")
    parser.add_argument("--tests-file", help="file with one test name a line (else argv)")
    parser.add_argument("tests", nargs="*", help="test method names to run")
    args = parser.parse_args(argv)
    if args.list:
        print("\n".join(list_tests()))
        return 0
    if args.list_skips:
        print(json.dumps(import_time_skips(), indent=1, sort_keys=True))
        return 0
    names = list(args.tests)
    if args.tests_file:
        with open(args.tests_file, encoding="utf-8") as handle:
            names += [line.strip() for line in handle if line.strip()]
    if not args.out or not names:
        parser.error("--out and at least one test name are required")
    run_tests(names, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
