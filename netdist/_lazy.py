"""Lazy package namespaces (PEP 562): a package's public names load on first use.

Each netdist package lists its public names in an explicit ``name -> module`` table and
calls :func:`attach`, which returns the module-level ``__getattr__`` and ``__dir__``::

    _EXPORTS = {"Group": "netdist.collectives.group", ...}
    __all__ = [...]
    if TYPE_CHECKING:                      # what mypy and editors see
        from netdist.collectives.group import Group
    else:                                  # what runs
        __getattr__, __dir__ = attach(__name__, _EXPORTS)

Why: importing ``netdist.collectives.plan`` runs ``netdist/collectives/__init__.py``
first. An eager ``__init__`` would import ``group.py`` and with it asyncio, the transport
and socket, so a PURE module (DESIGN.md, "Layers") would not be pure in practice. With a
lazy one, importing a submodule imports that submodule and nothing beside it, and
``from netdist.collectives import Group`` still works: ``from``-imports fall back to the
package's ``__getattr__``.

The hooks are defined only outside ``TYPE_CHECKING``, so static analysers see the eager
imports alone and a misspelt name stays a type error instead of ``Any``.

One trap is handled here: an export named like the submodule defining it
(``netdist.checkpoint.consolidate``, the function, in ``consolidate.py``). Importing that
submodule from anywhere makes Python bind the *module* to the package attribute, which
would then shadow the function. The package's module type is switched (as the Python
reference shows under "Customizing module attribute access") to one whose ``__setattr__``
binds the export instead.
"""

from __future__ import annotations

import importlib
import sys
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = ["attach"]

_TABLE = "_lazy_exports"
"""Where a lazy package keeps its ``name -> module`` table (read by ``_LazyPackage``)."""


class _LazyPackage(types.ModuleType):
    """A package module that keeps an export bound when its same-named module loads."""

    def __setattr__(self, name: str, value: Any) -> None:
        table: Mapping[str, str] = self.__dict__.get(_TABLE, {})
        if isinstance(value, types.ModuleType) and table.get(name) == value.__name__:
            value = getattr(value, name)  # the submodule's export, not the submodule
        super().__setattr__(name, value)

    def __reduce__(self) -> tuple[Callable[[str], types.ModuleType], tuple[str]]:
        """Pickle as the import of this package by name, as cloudpickle pickles a plain
        module: a function shipped by value (Ray Train's train function, a Dask task)
        that uses ``netdist`` then travels, and imports netdist where it lands."""
        return importlib.import_module, (self.__name__,)


def attach(package: str, exports: Mapping[str, str], *, submodules: Sequence[str] = (),
           ) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``__getattr__`` and ``__dir__`` for ``package``, resolving names through ``exports``.

    ``exports`` maps each public name to the module that defines it (the value is that
    module's attribute of the same name); ``submodules`` names submodules that are
    themselves public (``netdist.errors``). A resolved value is stored in the package's
    namespace, so later lookups skip ``__getattr__``. Unknown names raise
    ``AttributeError`` as a plain module would.
    """
    module = sys.modules[package]
    namespace = module.__dict__
    table = dict(exports)
    modules = {name: f"{package}.{name}" for name in submodules}
    namespace[_TABLE] = table
    module.__class__ = _LazyPackage

    def __getattr__(name: str) -> Any:
        if name in modules:
            value = importlib.import_module(modules[name])
        else:
            module_name = table.get(name)
            if module_name is None:
                raise AttributeError(f"module {package!r} has no attribute {name!r}")
            value = getattr(importlib.import_module(module_name), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(table) | set(modules))

    return __getattr__, __dir__
