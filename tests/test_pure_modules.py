"""PURE means pure: the modules DESIGN.md marks PURE import neither asyncio nor socket.

Each PURE module is imported in a fresh interpreter, which then reports whether
``asyncio``, ``socket`` or ``torch`` is in ``sys.modules``, and if so, which netdist files
were on the stack when it was first imported (so a failure names the eager import to
fix). A PURE module can only stay pure if every package ``__init__`` above it is lazy
(``netdist._lazy``), so every package is checked the same way, and the lazy packages must
still export every name in their ``__all__``.

To declare a new PURE module, add its dotted name to ``PURE`` (``pkg.*`` means the package
and every module in it).
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

PURE = [
    "netdist.errors",
    "netdist.types",
    "netdist.bfloat16",
    "netdist.reduce_kernels",
    "netdist.call_markers",
    "netdist.config",
    "netdist.sharding",
    "netdist.optim",
    "netdist.optim_kernels",
    "netdist.wire.*",
    "netdist.transport.traffic",
    "netdist.trace.counters",
    "netdist.trace.prometheus",
    "netdist.compression.*",
    "netdist.collectives.plan",
    "netdist.collectives.routes",
    "netdist.collectives.host.layout",
    "netdist.collectives.host.settings",
    "netdist.collectives.tags",
    "netdist.elastic.membership",
    "netdist.elastic.sampler",
    "netdist.ps.placement",
    "netdist.ps.messages",
    "netdist.ps.shard",
    "netdist.ps.staleness",
    "netdist.ps.roles",
    "netdist.ps.protocol",
    "netdist.ps.faults",
    "netdist.parallel.stages",
    "netdist.parallel.schedule",
    "netdist.parallel.flat_param",
    "netdist.parallel.fsdp_strategy",
    "netdist.parallel.fsdp_stats",
    "netdist.parallel.tp_layout",
    "netdist.parallel.outer_optim",
    "netdist.parallel.fragments",
    "netdist.checkpoint.metadata",
    "netdist.checkpoint.planner",
    "netdist.checkpoint.options",
    "netdist.checkpoint.summary",
    "netdist.checkpoint.regions",
    "netdist.checkpoint.group_like",
    "netdist.netlab.layout",
    "netdist.ray.places",
    "netdist.trace.schema",
    "netdist.trace.analysis",
    "netdist.trace.clock",
    "netdist.trace.settings",
    "netdist.trace.recorder",
    "netdist.trace.tracer",
    "netdist.trace.control",
    "netdist.trace.viewer",
    "netdist.trace.stragglers",
]
"""The PURE modules of DESIGN.md ("Layers"), and those the ps and parallel packages declare
PURE in their docstrings; ``pkg.*`` is a package and all its modules."""

NOT_LAZY_BY_DESIGN = {
    "netdist.torch": "registers the torch.distributed backend on import, so it imports torch",
}
"""Packages whose ``__init__`` must stay eager."""

AWAITING_LAZY_INIT: dict[str, str] = {}
"""Packages whose ``__init__`` is known to be still eager, with why: the modules under them
are expected to fail (strict xfail, so the test says so once the package is lazy)."""

FORBIDDEN = ("asyncio", "socket", "torch")

CHILD = r"""
import importlib, json, sys, traceback

FORBIDDEN = set(sys.argv[2].split(","))
found = {}

class Spy:
    '''Notes which netdist files were importing when a forbidden module first loaded.'''

    def find_spec(self, name, path=None, target=None):
        if name in FORBIDDEN and name not in found and name not in sys.modules:
            found[name] = [f"{frame.filename.split('/netdist/')[-1]}:{frame.lineno}"
                           for frame in traceback.extract_stack()
                           if "/netdist/" in frame.filename]
        return None

sys.meta_path.insert(0, Spy())
importlib.import_module(sys.argv[1])
print(json.dumps({name: found.get(name, []) for name in sorted(FORBIDDEN)
                  if name in sys.modules}))
"""


def _expand(entry: str) -> list[str]:
    """``pkg.*`` -> the package and every module in it; anything else as is."""
    if not entry.endswith(".*"):
        return [entry]
    package = entry[:-2]
    spec = importlib.util.find_spec(package)
    assert spec is not None and spec.submodule_search_locations, f"{package} is no package"
    return [package] + sorted(f"{package}.{info.name}" for info in
                              pkgutil.iter_modules(spec.submodule_search_locations))


def _packages() -> list[str]:
    """``netdist`` and its subpackages at every depth (``netdist.collectives.host``),
    found without importing them."""
    import netdist

    found = ["netdist"]
    pending = [("netdist", list(netdist.__path__))]
    while pending:
        package, paths = pending.pop()
        for info in pkgutil.iter_modules(paths, f"{package}."):
            if info.ispkg:
                found.append(info.name)
                pending.append((info.name, [str(Path(p) / info.name.rsplit(".", 1)[1])
                                            for p in paths]))
    return sorted(found)


def _under_eager_init(module: str) -> str | None:
    """Why ``module`` cannot be pure yet, if a package above it is still eager."""
    for package, why in AWAITING_LAZY_INIT.items():
        if module == package or module.startswith(package + "."):
            return why
    return None


def _loaded_by_import(module: str) -> dict[str, list[str]]:
    """Forbidden modules that importing ``module`` in a fresh interpreter loads, with the
    netdist frames that were importing each."""
    done = subprocess.run([sys.executable, "-c", CHILD, module, ",".join(FORBIDDEN)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"importing {module} failed:\n{done.stderr}"
    result: dict[str, list[str]] = json.loads(done.stdout)
    return result


def _cases(modules: list[str]) -> list[object]:
    return [pytest.param(m, marks=pytest.mark.xfail(reason=why, strict=True))
            if (why := _under_eager_init(m)) else m for m in modules]


PURE_MODULES = [module for entry in PURE for module in _expand(entry)]
LAZY_PACKAGES = [p for p in _packages() if p not in NOT_LAZY_BY_DESIGN]


@pytest.mark.parametrize("module", _cases(PURE_MODULES))
def test_a_pure_module_imports_no_asyncio_socket_or_torch(module: str) -> None:
    loaded = _loaded_by_import(module)
    assert loaded == {}, (
        f"importing {module} loads {sorted(loaded)}; first imported from:\n"
        + "\n".join(f"  {name}: {' -> '.join(chain)}" for name, chain in loaded.items()))


@pytest.mark.parametrize("package", _cases(LAZY_PACKAGES))
def test_a_package_init_imports_no_asyncio_socket_or_torch(package: str) -> None:
    loaded = _loaded_by_import(package)
    assert loaded == {}, (
        f"importing {package} loads {sorted(loaded)}; first imported from:\n"
        + "\n".join(f"  {name}: {' -> '.join(chain)}" for name, chain in loaded.items()))


def test_the_pure_list_names_real_modules() -> None:
    for module in PURE_MODULES:
        assert importlib.util.find_spec(module) is not None, f"{module} does not exist"
    assert len(PURE_MODULES) >= len(PURE)


@pytest.mark.parametrize("package", LAZY_PACKAGES)
def test_a_lazy_package_exports_every_name_in_all(package: str) -> None:
    module = importlib.import_module(package)
    names = list(getattr(module, "__all__", []))
    listed = dir(module)
    for name in names:
        assert getattr(module, name) is not None, f"{package}.{name}"
        assert name in listed, f"{package}.{name} missing from dir()"
    with pytest.raises(AttributeError, match=f"module '{package}' has no attribute 'nope'"):
        getattr(module, "nope")


def test_an_export_named_like_its_module_stays_the_export() -> None:
    """``consolidate`` (the function) lives in ``consolidate.py``: importing the module
    from elsewhere first must not make the package hand out the module."""
    code = ("import types, netdist.checkpoint.consolidate\n"
            "from netdist.checkpoint import consolidate\n"
            "import netdist.checkpoint as ck\n"
            "print(callable(consolidate), isinstance(consolidate, types.ModuleType),\n"
            "      ck.consolidate is consolidate)")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, check=True)
    assert done.stdout.split() == ["True", "False", "True"]
