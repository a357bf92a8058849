"""PURE: how a model is cut into fragments and when each fragment is synchronised.

Streaming DiLoCo (Douillard et al. 2025) synchronises a model not all at once every ``H``
inner steps but fragment by fragment, at staggered steps, so the link carries ``1/F`` of
the model at a time and the exchange can run behind the following inner steps.

- ``split_fragments(sizes, F)`` cuts the parameter list (in order) into ``F`` contiguous
  runs of about equal element counts (a parameter is never split), as Streaming DiLoCo
  cuts a transformer into runs of blocks.
- ``FragmentSchedule``: fragment ``p`` of ``F`` is *launched* after inner steps ``t`` with
  ``t % H == offset(p)``, ``offset(p) = ((p + 1) * H // F) % H``; with ``F = 1`` that is
  every ``H``-th step, DiLoCo's schedule. Its exchange is *completed* (and its outer step
  applied) ``delay`` inner steps later, after inner step ``t + delay``; ``delay = 0``
  completes it at once. Every fragment is thus synchronised once every ``H`` steps, the
  fragments evenly spread over them, and ``delay < H // F`` keeps at most one exchange of
  each fragment in flight.

Every rank computes the same schedule from the same numbers, which is what keeps the
collectives issued in the same order everywhere.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from netdist.errors import ConfigError

__all__ = ["FragmentSchedule", "split_fragments"]


def split_fragments(sizes: Sequence[int], count: int) -> list[tuple[int, ...]]:
    """Parameter indices of ``count`` contiguous fragments of about equal element counts.

    Fragment ``p`` ends at the first parameter boundary where the running element count
    reaches ``(p + 1) / count`` of the total; every fragment holds at least one parameter.
    """
    if count < 1:
        raise ConfigError(f"fragments must be >= 1, got {count}")
    if count > len(sizes):
        raise ConfigError(f"{count} fragments need at least {count} parameters, the model "
                          f"has {len(sizes)}")
    total = sum(sizes)
    cuts: list[int] = []
    running = 0
    for i, size in enumerate(sizes):
        running += size
        remaining_params = len(sizes) - (i + 1)
        remaining_cuts = count - 1 - len(cuts)
        if remaining_cuts == 0:
            break
        target = total * (len(cuts) + 1) / count
        if running >= target or remaining_params == remaining_cuts:
            cuts.append(i + 1)
    bounds = [0, *cuts, len(sizes)]
    return [tuple(range(bounds[p], bounds[p + 1])) for p in range(count)]


@dataclass(frozen=True, slots=True)
class FragmentSchedule:
    """When each of ``fragments`` fragments is launched and completed; see the module."""

    sync_every: int
    fragments: int = 1
    delay: int = 0

    def __post_init__(self) -> None:
        if self.sync_every < 1:
            raise ConfigError(f"sync_every must be >= 1, got {self.sync_every}")
        if self.fragments < 1:
            raise ConfigError(f"fragments must be >= 1, got {self.fragments}")
        if self.fragments > self.sync_every:
            raise ConfigError(f"{self.fragments} fragments cannot be staggered over "
                              f"sync_every={self.sync_every} steps; use at most "
                              f"{self.sync_every}")
        if not 0 <= self.delay < max(1, self.sync_every // self.fragments):
            raise ConfigError(f"fragment_sync_delay must be in [0, sync_every // fragments = "
                              f"{self.sync_every // self.fragments}), got {self.delay}")

    def offset(self, fragment: int) -> int:
        """The inner step (mod ``sync_every``) after which ``fragment`` is launched."""
        return ((fragment + 1) * self.sync_every // self.fragments) % self.sync_every

    def launched_after(self, step: int) -> list[int]:
        """Fragments whose exchange starts after inner step ``step`` (1-based)."""
        return [p for p in range(self.fragments)
                if step >= 1 and step % self.sync_every == self.offset(p)]

    def completed_after(self, step: int) -> list[int]:
        """Fragments whose exchange is completed after inner step ``step``: those launched
        after step ``step - delay``."""
        return self.launched_after(step - self.delay) if step - self.delay >= 1 else []
