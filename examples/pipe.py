# example: pipe.py
# run: netdist launch -n 2 -- python pipe.py
import asyncio

import numpy as np

import netdist
from netdist import (SGD, PipelineParallel, PipelineParallelConfig, softmax_cross_entropy,
                     split_into_stages)
from netdist.train import mlp


async def main() -> None:
    async with netdist.init() as transport:
        model = mlp([16, 32, 32, 4], rng=np.random.default_rng(0))  # 5 layers, built on every rank
        config = PipelineParallelConfig(num_stages=2, num_micro_batches=4, schedule="1f1b")
        stage = split_into_stages(len(model.layers), config.num_stages)[transport.rank]
        pipe = PipelineParallel(transport, stage.select(model.layers), config,
                                loss_fn=softmax_cross_entropy,
                                optimizer_factory=lambda params: SGD(params, lr=0.1))
        data = np.random.default_rng(1)                  # the same batches on every rank
        for step in range(3):
            x, y = data.normal(size=(32, 16)), data.integers(0, 4, size=32)
            loss = await pipe.train_step(x, y)           # first stage uses x, last stage y
            if loss is not None:                         # the loss exists on the last stage
                print(f"step {step}: loss {loss:.4f}")
        print(f"stage {pipe.stage}: layers {stage.start_layer}..{stage.end_layer - 1}")


asyncio.run(main())
