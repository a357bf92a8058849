"""What the test asks of one elastic member process, read from its environment.

Shared by the member scripts (``_torch_member``, ``_diloco_member``): ``ELASTIC_TEST_DIR``
(where to write), ``ELASTIC_TEST_STEPS``, ``ELASTIC_TEST_STEP_SECONDS`` (the least time a
step takes) and ``ELASTIC_TEST_DIE=<phase>:<step>`` with ``ELASTIC_TEST_DIE_SLOT`` (only
the first incarnation of that slot dies, at that step).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class MemberPlan:
    slot: int
    out: Path
    steps: int
    pause: float
    die_at: int
    """The step at which this process kills itself; -1: never."""


def member_plan(default_steps: int) -> MemberPlan:
    """This process's plan (``default_steps`` when ``ELASTIC_TEST_STEPS`` is unset)."""
    slot = int(os.environ["NETDIST_ELASTIC_SLOT"])
    die = os.environ.get("ELASTIC_TEST_DIE", "")
    dies = (die and os.environ.get("NETDIST_RESTART_COUNT") == "0"
            and os.environ.get("ELASTIC_TEST_DIE_SLOT", str(slot)) == str(slot))
    return MemberPlan(slot, Path(os.environ["ELASTIC_TEST_DIR"]),
                      int(os.environ.get("ELASTIC_TEST_STEPS", str(default_steps))),
                      float(os.environ.get("ELASTIC_TEST_STEP_SECONDS", "0")),
                      int(die.split(":")[1]) if dies else -1)
