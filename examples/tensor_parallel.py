# example: tensor_parallel.py
# run: netdist launch -n 2 -- python tensor_parallel.py
import numpy as np

import netdist
from netdist.collectives import Group
from netdist.parallel import ColumnParallelLinear, RowParallelLinear
from netdist.train import SGD, Linear, Sequential, Tanh, mse_loss

with netdist.connect() as job:
    group = job.make(Group, job.transport, shared_memory=False)  # every byte over TCP: counted
    rng = np.random.default_rng(0)                # the same seed on every rank: the same model
    whole = Sequential(Linear(8, 16, rng=rng), Tanh(), Linear(16, 4, rng=rng))
    tp = Sequential(ColumnParallelLinear.from_linear(whole[0], group), Tanh(),  # 8 of 16 rows
                    RowParallelLinear.from_linear(whole[2], group))             # 8 of 16 cols
    models = {"whole": whole, "tensor-parallel": tp}
    optimizers = {name: SGD(m.parameters(), lr=0.1) for name, m in models.items()}
    data = np.random.default_rng(1)                # the same batches on every rank
    for step in range(3):
        x, target = data.normal(size=(32, 8)), data.normal(size=(32, 4))
        for name, model in models.items():
            before = job.transport.traffic()
            model.zero_grad()
            y, ctx = model.forward(x)                  # tp: one all-reduce of y (32 x 4)
            loss, grad = mse_loss(y, target)
            model.backward(ctx, grad)                  # tp: one all-reduce of dx (32 x 8)
            optimizers[name].step()
            sent = (job.transport.traffic() - before).total.sent_bytes
            if step == 2:
                print(f"rank {job.rank}: {name:15} loss {loss:.6f}, {sent} bytes sent")
    diff = np.abs(tp[2].weight.data - whole[2].weight.data[:, tp[2].layout.shard.slice]).max()
    print(f"rank {job.rank}: holds fc2 columns {tp[2].layout.shard.start}.."
          f"{tp[2].layout.shard.stop - 1}, {tp[2].tp_placements}, same weights: {diff < 1e-12}")
