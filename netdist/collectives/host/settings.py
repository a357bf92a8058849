"""PURE: the one-host path's settings, ``NETDIST_SHM`` and ``NETDIST_SHM_COPY``.

``Group`` reads them (its ``shared_memory=`` and ``shm_copy=``, else these variables),
and ``netdist launch`` checks ``NETDIST_SHM_COPY`` with the same reader before it starts
any rank.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Mapping

from netdist.config import parse_switch
from netdist.errors import ConfigError

__all__ = ["ShmCopy", "shared_memory_enabled", "shared_memory_copy"]


def shared_memory_enabled(setting: bool | None) -> bool:
    """``setting`` if given, else the switch ``NETDIST_SHM`` (default on; see
    ``netdist.config.parse_switch`` for the accepted words)."""
    if setting is not None:
        return bool(setting)
    return parse_switch(os.environ, "NETDIST_SHM", True)


class ShmCopy(enum.Enum):
    """How a single-host all-reduce moves bytes between the ranks' arrays."""

    SINGLE = "single"
    """Each rank reads and writes its peers' arrays directly (``process_vm_readv`` /
    ``process_vm_writev``): one copy per byte moved and nothing staged, where the kernel
    lets the ranks reach each other (a probe at setup decides; otherwise ``STAGED``)."""
    STAGED = "staged"
    """Through the shared segment's slots: copied in by the owner, out by the reader."""


def shared_memory_copy(setting: ShmCopy | str | None, *,
                       environ: Mapping[str, str] | None = None) -> ShmCopy:
    """``setting`` if given, else ``NETDIST_SHM_COPY`` in ``environ`` (default
    ``os.environ``): ``single``, the default, or ``staged``; anything else is a
    ``ConfigError`` (a ``ValueError``) naming the accepted values."""
    env = os.environ if environ is None else environ
    raw = env.get("NETDIST_SHM_COPY", "single") if setting is None else setting
    if isinstance(raw, ShmCopy):
        return raw
    try:
        return ShmCopy(str(raw).strip().lower())
    except ValueError:
        source = "NETDIST_SHM_COPY" if setting is None else "shm_copy"
        raise ConfigError(f"{source} must be 'single' or 'staged', got {raw!r}") from None
