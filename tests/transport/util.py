"""Small helpers for the transport tests (``free_port`` lives in ``tests/ranks.py``)."""

from __future__ import annotations

from tests.ranks import free_port

__all__ = ["free_port"]
