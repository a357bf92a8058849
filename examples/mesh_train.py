# example: mesh_train.py
# run: netdist launch -n 4 -- python mesh_train.py
import numpy as np

import netdist
from netdist.parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from netdist.train import SGD, ReLU, Sequential, mlp, mse_loss

data = np.random.default_rng(1)                                   # same batches everywhere
batches = [(data.normal(size=(32, 16)), data.normal(size=(32, 16))) for _ in range(20)]


def train(model, rows, average):
    optimizer = SGD(model.parameters(), lr=0.05)
    for x, y in batches:
        model.zero_grad()
        out, ctx = model.forward(x[rows])
        loss, grad = mse_loss(out, y[rows])
        model.backward(ctx, grad)
        average(model.parameters())
        optimizer.step()
    return loss


with netdist.connect() as job:
    mesh = job.group.new_mesh({"dp": 2, "tp": 2})            # collective: every rank calls
    dp, tp = mesh.group("dp"), mesh.group("tp")
    full = mlp([16, 64, 16], rng=np.random.default_rng(0))    # same seed: same model
    model = Sequential(ColumnParallelLinear.from_linear(full[0], tp),   # 32 of 64 outputs
                       ReLU(),
                       RowParallelLinear.from_linear(full[2], tp))      # 32 of 64 inputs

    def mean_over_dp(params):
        for p in params:
            dp.all_reduce(p.grad, op="mean")

    loss = train(model, slice(16 * dp.rank, 16 * dp.rank + 16), mean_over_dp)
    train(full, slice(None), lambda params: None)             # one process, every row
    mine = full[0].weight.data[32 * tp.rank:32 * tp.rank + 32]
    same = np.allclose(model[0].weight.data, mine, rtol=1e-12, atol=0)
    print(f"dp {dp.rank} tp {tp.rank}: loss {loss:.4f}, same weights as one process: {same}")
