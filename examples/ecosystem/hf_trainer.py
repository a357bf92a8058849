# example: hf_trainer.py
# run: netdist launch -n 2 -- python hf_trainer.py
import hashlib

import torch
import torch.distributed as dist
from transformers import GPT2Config, GPT2LMHeadModel, PrinterCallback, Trainer, TrainingArguments

from netdist.torch.data_parallel_check import check_data_parallel  # registers netdist too

dist.init_process_group("netdist")          # first: accelerate keeps the group that exists
torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=64, n_positions=32))
tokens = torch.randint(0, 64, (32, 16), generator=torch.Generator().manual_seed(1))
data = [{"input_ids": t, "labels": t} for t in tokens]
args = TrainingArguments(output_dir="hf_trainer", use_cpu=True,  # use_cpu: DDP on the CPU
                         per_device_train_batch_size=4, max_steps=4, learning_rate=1e-2,
                         report_to=[], save_strategy="no", disable_tqdm=True)
check_data_parallel(args)                   # ConfigError if every rank would train alone
trainer = Trainer(model=model, args=args, train_dataset=data)
trainer.remove_callback(PrinterCallback)    # print only the lines below
loss = trainer.train().training_loss        # this rank's own batches
trainer.save_model()                        # rank 0 writes hf_trainer/model.safetensors
weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
digests = [None] * dist.get_world_size()
dist.all_gather_object(digests, hashlib.sha256(weights.numpy().tobytes()).hexdigest())
print(f"rank {dist.get_rank()}: {dist.get_backend()}, {args.world_size} ranks, "
      f"loss {loss:.4f}, weights identical: {len(set(digests)) == 1}")
dist.destroy_process_group()
