"""Elastic torch training with real processes: a member running torch SGD with momentum
through ``ElasticDataParallel`` is SIGKILLed and restarted; it fetches the model and the
momentum buffers, and every member ends with bitwise-equal parameters and buffers."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.elastic.cluster import ElasticCluster

pytest.importorskip("torch")


def test_torch_member_killed_and_replaced_stays_bitwise_in_step(tmp_path: Path) -> None:
    cluster = ElasticCluster(tmp_path, 3, steps=60, member="tests.elastic._torch_member",
                             env={"ELASTIC_TEST_DIE": "compute:8", "ELASTIC_TEST_DIE_SLOT": "1",
                                  "ELASTIC_TEST_UNTIL_WORLD": "3",
                                  "ELASTIC_TEST_STEP_SECONDS": "0.02"})
    try:
        cluster.start_all()
        cluster.wait_until("slot 1 to die", lambda: cluster.procs[1].poll() is not None)
        cluster.start(1)
        assert cluster.wait_all(timeout=120) == {0: 0, 1: 0, 2: 0}
        finals = [cluster.final(slot) for slot in range(3)]
        for final in finals[1:]:
            assert np.array_equal(final["w"], finals[0]["w"])
            assert np.array_equal(final["momentum"], finals[0]["momentum"])
        assert finals[1]["changes"][0][3] > 0 and finals[1]["changes"][0][4] == 2
    finally:
        cluster.close()


def test_wrapper_refuses_a_model_without_trainable_parameters() -> None:
    import torch

    from netdist.elastic import ElasticDataParallel

    frozen = torch.nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(ValueError, match="no parameters"):
        ElasticDataParallel(frozen, torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=1))
