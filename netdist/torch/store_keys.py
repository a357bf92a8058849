"""Which attempt of a job a rank belongs to, the store keys netdist uses for it, and the
coordinator record rank 0 publishes under them.

torchrun keeps one store for the whole run: the c10d rendezvous shares its TCPStore
server with the workers of every attempt, and the static one keeps its store too, so
after a restart the store still holds what attempt 0 wrote. A restarted rank that read
attempt 0's coordinator address would retry a dead port until its join timeout. So:

- every key is unique per attempt and group: ``netdist/GROUP/RUN_ID:RESTART/wWORLD/``
  (torch's group name, ``TORCHELASTIC_RUN_ID``, ``TORCHELASTIC_RESTART_COUNT`` and the
  world size; ``-`` where a variable is unset), then a *generation*, the number of earlier
  joins of the same group under that prefix (``(arrivals - 1) // world_size`` from an
  atomic counter), which tells apart two ``init_process_group`` calls of one process, or
  two runs on one persistent store (a ``FileStore`` kept across runs);
- the record carries the attempt (run id, restart count, world size, group, generation)
  and a random nonce, and a reader uses it only if the attempt is its own. The nonce
  becomes part of netdist's job id, which both ends of netdist's authenticated handshake
  must share: a rank holding another incarnation's record cannot join that coordinator,
  nor a coordinator that happens to have the same port.

Torch-free and I/O-free; ``netdist.torch.store_join`` talks to the store.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

from netdist.config import parse_host_port
from netdist.errors import ConfigError, RendezvousError

__all__ = ["Attempt", "CoordinatorRecord", "RECORD_VERSION"]

RECORD_VERSION = 1
"""Version of the coordinator record's JSON layout."""

_UNSET = "-"


def _part(text: str) -> str:
    """``text`` as one key component (no ``/`` inside, never empty)."""
    return quote(text, safe="") or _UNSET


@dataclass(frozen=True, slots=True)
class Attempt:
    """One launch of one process group: what a coordinator record must match."""

    group: str
    """torch's group name (``options.group_id``): ``"0"`` for the default group."""
    world_size: int
    run_id: str | None = None
    """``TORCHELASTIC_RUN_ID`` (torchrun's ``--rdzv-id``), None outside torchrun."""
    restart_count: int | None = None
    """``TORCHELASTIC_RESTART_COUNT``: 0, then 1 after the first restart, ..."""

    @classmethod
    def from_env(cls, group: str, world_size: int,
                 environ: Mapping[str, str] | None = None) -> Attempt:
        """This process's attempt: torchrun's variables from ``environ`` (``os.environ``)."""
        env = os.environ if environ is None else environ
        run_id = env.get("TORCHELASTIC_RUN_ID") or None
        restart_text = env.get("TORCHELASTIC_RESTART_COUNT", "").strip()
        restart = None
        if restart_text:
            try:
                restart = int(restart_text)
            except ValueError:
                raise ConfigError(f"TORCHELASTIC_RESTART_COUNT={restart_text!r} is not a "
                                  "whole number") from None
        return cls(group, world_size, run_id, restart)

    @property
    def prefix(self) -> str:
        """The key prefix of this attempt (unique per run, restart, world size, group)."""
        run = _UNSET if self.run_id is None else _part(self.run_id)
        restart = _UNSET if self.restart_count is None else str(self.restart_count)
        return f"netdist/{_part(self.group)}/{run}:{restart}/w{self.world_size}"

    @property
    def arrivals_key(self) -> str:
        """The counter every joining rank adds 1 to: it numbers the generations."""
        return f"{self.prefix}/arrivals"

    def generation(self, arrivals: int) -> int:
        """The generation of a join that brought the counter to ``arrivals``."""
        return (arrivals - 1) // self.world_size

    def coordinator_key(self, generation: int) -> str:
        """Where rank 0 of ``generation`` publishes its coordinator record."""
        return f"{self.prefix}/g{generation}/coordinator"

    def describe(self) -> str:
        """The attempt in words, for messages."""
        parts = [f"group {self.group!r}", f"world size {self.world_size}"]
        if self.run_id is not None:
            parts.append(f"torchrun run {self.run_id!r}")
        if self.restart_count is not None:
            parts.append(f"restart {self.restart_count}")
        return ", ".join(parts)


@dataclass(frozen=True, slots=True)
class CoordinatorRecord:
    """What rank 0 publishes in torch's store: where its coordinator listens, for which
    attempt and generation, a nonce, and the job token when netdist drew one."""

    address: tuple[str, int]
    attempt: Attempt
    generation: int
    nonce: str
    token: str | None = field(default=None, repr=False)
    """The random job token when ``NETDIST_TOKEN`` is unset on rank 0 (never shown)."""

    @property
    def job_id(self) -> str:
        """netdist's job id for this record: the handshake makes both ends agree on it."""
        restart = self.attempt.restart_count
        return (f"torch:{self.attempt.group}:"
                f"{_UNSET if restart is None else restart}.{self.generation}:{self.nonce}")

    def stale_for(self, attempt: Attempt, generation: int) -> str | None:
        """Why this record is not for ``attempt``'s ``generation`` (None when it is)."""
        if self.attempt != attempt:
            return f"it was written for {self.attempt.describe()}, not {attempt.describe()}"
        if self.generation != generation:
            return f"it is for generation {self.generation}, not {generation}"
        return None

    def encode(self) -> bytes:
        """The record as the store holds it (JSON)."""
        return json.dumps({**self.as_dict(), "token": self.token}).encode()

    @classmethod
    def decode(cls, raw: bytes, key: str) -> CoordinatorRecord:
        """Parse what ``encode`` wrote; ``RendezvousError`` naming ``key`` otherwise."""
        try:
            data = json.loads(raw.decode())
            if data["version"] != RECORD_VERSION:
                raise ValueError(f"record version {data['version']}, this netdist reads "
                                 f"{RECORD_VERSION}")
            restart = data["restart_count"]
            attempt = Attempt(str(data["group"]), int(data["world_size"]), data["run_id"],
                              None if restart is None else int(restart))
            address = parse_host_port(str(data["address"]), what=f"the store key {key!r}")
            token = data.get("token")
            return cls(address, attempt, int(data["generation"]), str(data["nonce"]),
                       None if token is None else str(token))
        except (ValueError, KeyError, TypeError, UnicodeDecodeError, ConfigError) as exc:
            raise RendezvousError(
                f"the netdist coordinator record under the store key {key!r} is not one "
                f"this netdist can read ({exc}); is another netdist version, or another "
                f"program, using the same store?") from None

    def as_dict(self) -> dict[str, Any]:
        """The record without the token, for logs and for checking where ranks met."""
        host, port = self.address
        return {"version": RECORD_VERSION,
                "address": f"[{host}]:{port}" if ":" in host else f"{host}:{port}",
                "group": self.attempt.group, "world_size": self.attempt.world_size,
                "run_id": self.attempt.run_id, "restart_count": self.attempt.restart_count,
                "generation": self.generation, "nonce": self.nonce}
