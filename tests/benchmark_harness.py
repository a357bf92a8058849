"""Load a script of ``benchmarks/`` as a module, for tests that drive its harness.

The benchmarks are scripts, not a package; a test that runs the same job a benchmark
measures (``checkpoint_crash.py``, ``torchrun_restarts.py``, ``gpu_mixed_backends.py``)
imports it through here rather than copying its code.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


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
