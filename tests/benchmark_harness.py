"""Load a script of ``benchmarks/`` as a module, or run it, for tests that drive it.

The benchmarks are scripts, not a package; a test that runs the same job a benchmark
measures (``checkpoint_crash.py``, ``torchrun_restarts.py``, ``gpu_mixed_backends.py``)
imports it through here rather than copying its code, and a test that keeps a script
from rotting runs it with ``run_benchmark``.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[1]
BENCHMARKS = REPO / "benchmarks"


def load_benchmark(name: str) -> ModuleType:
    """``benchmarks/NAME.py`` as the module ``NAME`` (registered in ``sys.modules``, where
    dataclasses look their module up); loaded once per process."""
    if name in sys.modules:
        return sys.modules[name]
    path = BENCHMARKS / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"{path} is missing")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def run_benchmark(name: str, args: list[str], *, timeout: float,
                  cwd: Path) -> subprocess.CompletedProcess[str]:
    """``python benchmarks/NAME.py ARGS`` in ``cwd``, output captured, bounded by
    ``timeout``; its environment is this process's less every ``NETDIST_*`` variable,
    with the repository importable."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("NETDIST_")}
    env["PYTHONPATH"] = str(REPO)
    return subprocess.run([sys.executable, str(BENCHMARKS / f"{name}.py"), *args],
                          capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env)
