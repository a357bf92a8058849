"""Elastic training: a job that carries on when members are lost and grows when they join.

::

    import netdist.elastic as elastic

    state = elastic.ElasticState({"w": w, "momentum": m})       # or state_dict callables
    sampler = elastic.ElasticSampler(num_samples, global_batch)
    with elastic.connect(state, sampler=sampler) as job:       # blocking API
        while job.step < steps:
            job.run_step(step_fn)                              # step_fn(ctx)

``ElasticJob`` is the asyncio API (``await ElasticJob.start(config, state)``);
``ElasticConfig.from_env()`` reads what ``netdist launch --elastic`` sets. The PURE parts
are ``membership`` (epochs, majority, order) and ``sampler`` (samples accounted for
across membership changes). See docs/elastic.md for the guarantees and the bounds.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

_EXPORTS: dict[str, str] = {
    "ElasticJob": "netdist.elastic.job",
    "StepContext": "netdist.elastic.job",
    "StepReport": "netdist.elastic.job",
    "EpochChange": "netdist.elastic.job",
    "StepDiscarded": "netdist.elastic.job",
    "ElasticConfig": "netdist.elastic.config",
    "ElasticState": "netdist.elastic.state",
    "ElasticSampler": "netdist.elastic.sampler",
    "Membership": "netdist.elastic.membership",
    "BlockingElasticJob": "netdist.elastic.blocking",
    "BlockingStepContext": "netdist.elastic.blocking",
    "connect": "netdist.elastic.blocking",
    "SyncReport": "netdist.elastic.transfer",
    "ElasticDataParallel": "netdist.elastic.torch_data_parallel",
    "ElasticDiLoCo": "netdist.elastic.diloco",
}

__all__ = list(_EXPORTS)

if TYPE_CHECKING:
    from netdist.elastic.blocking import BlockingElasticJob, BlockingStepContext, connect
    from netdist.elastic.config import ElasticConfig
    from netdist.elastic.diloco import ElasticDiLoCo
    from netdist.elastic.job import (
        ElasticJob,
        EpochChange,
        StepContext,
        StepDiscarded,
        StepReport,
    )
    from netdist.elastic.membership import Membership
    from netdist.elastic.sampler import ElasticSampler
    from netdist.elastic.state import ElasticState
    from netdist.elastic.torch_data_parallel import ElasticDataParallel
    from netdist.elastic.transfer import SyncReport
else:
    from netdist._lazy import attach as _attach

    __getattr__, __dir__ = _attach(__name__, _EXPORTS)
