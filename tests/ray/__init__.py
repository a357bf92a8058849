"""Tests of netdist on Ray Train (``netdist.ray``).

``require_ray()`` is the one test-side piece: Ray Train comes with the ``test`` extra, so a
missing Ray fails in CI (``CI=true``) and skips elsewhere, saying what to install.
"""

from __future__ import annotations

import importlib.util

__all__ = ["require_ray", "RAY_MISSING"]

RAY_MISSING = ("Ray Train is not installed: pip install -e '.[test]' (or "
               "'netdist[ray]', which brings ray[train])")


def require_ray() -> None:
    """Fail in CI, skip elsewhere, unless Ray Train (``ray`` and the ``ray[train]``
    extras it imports: pandas, pyarrow) can be imported."""
    if any(importlib.util.find_spec(name) is None for name in ("ray", "pandas", "pyarrow")):
        from tests.conftest import require_in_ci
        require_in_ci(RAY_MISSING)
