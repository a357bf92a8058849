# example: lightning_ddp.py
# run: netdist launch -n 2 -- python lightning_ddp.py
import argparse
import hashlib
import os
from datetime import timedelta

import lightning as L
import torch
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader, TensorDataset

parser = argparse.ArgumentParser()
parser.add_argument("--backend", default="netdist")  # "gloo" to compare
parser.add_argument("--out", help="a folder for each rank's weights and metrics")
args = parser.parse_args()
ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "2"))  # set by netdist launch -n N

gen = torch.Generator().manual_seed(0)
x = torch.randn(10 * ranks + 2, 8, generator=gen)
y = x.sum(dim=1, keepdim=True).tanh()


class Regressor(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(),
                                       torch.nn.Linear(16, 1))
        self.seen = 0
        self.mean_seen = torch.tensor(0)

    def _shard(self, start: int, stop: int) -> DataLoader:
        # uneven shards: rank 0 gets one sample more, so batch sizes differ across ranks
        r, n = self.global_rank, self.trainer.world_size
        xs, ys = x[start:stop].tensor_split(n)[r], y[start:stop].tensor_split(n)[r]
        return DataLoader(TensorDataset(xs, ys), batch_size=4 if start == 0 else 3)

    def train_dataloader(self) -> DataLoader:
        return self._shard(0, 6 * ranks + 1)

    def val_dataloader(self) -> DataLoader:
        return self._shard(6 * ranks + 1, 10 * ranks + 2)

    def training_step(self, batch: list[torch.Tensor], _: int) -> torch.Tensor:
        inputs, targets = batch
        loss = torch.nn.functional.mse_loss(self.net(inputs), targets)
        self.log("train_loss", loss, on_step=True, on_epoch=True, sync_dist=True)
        self.seen += len(inputs)
        return loss

    def on_train_epoch_end(self) -> None:
        # an int64 mean over the ranks: ReduceOp.AVG on netdist, SUM and a division on Gloo
        self.mean_seen = self.trainer.strategy.reduce(torch.tensor(self.seen), reduce_op="mean")
        self.seen = 0

    def validation_step(self, batch: list[torch.Tensor], _: int) -> None:
        inputs, targets = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(inputs), targets),
                 sync_dist=True)  # weighted by each rank's batch sizes, an int64 AVG

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


torch.manual_seed(0)
model = Regressor()
trainer = L.Trainer(
    accelerator="cpu", devices=ranks, num_nodes=1, max_epochs=2,
    strategy=DDPStrategy(process_group_backend=args.backend, timeout=timedelta(seconds=60)),
    use_distributed_sampler=False, logger=False, enable_checkpointing=False,
    enable_progress_bar=False, enable_model_summary=False, default_root_dir="lightning_ddp")
trainer.fit(model)

metrics = {k: v.detach().clone() for k, v in trainer.callback_metrics.items()}
weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
digest = hashlib.sha256(b"".join(w.numpy().tobytes() for w in weights.values())).hexdigest()
rank = trainer.global_rank
print(f"rank {rank} on {args.backend}: val_loss {metrics['val_loss'].item():.6f}, "
      f"samples per rank {model.mean_seen.item()}, weights {digest[:16]}")
if args.out:
    torch.save({"metrics": metrics, "weights": weights, "mean_seen": model.mean_seen},
               os.path.join(args.out, f"{args.backend}-rank{rank}.pt"))
