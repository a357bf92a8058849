"""Tests that run ranks in network namespaces (``netdist.netlab``).

``require_netlab()`` is the one test-side piece: it fails in CI and skips elsewhere when
``netdist.netlab.netlab_missing()`` names something this machine lacks.
"""

from __future__ import annotations

from netdist.netlab import netlab_missing

__all__ = ["require_netlab"]


def require_netlab() -> None:
    """Fail in CI, skip elsewhere, when ``netlab_missing()`` names something missing."""
    missing = netlab_missing()
    if missing is not None:
        from tests.conftest import require_in_ci
        require_in_ci(missing)
