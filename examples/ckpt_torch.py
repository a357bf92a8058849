# example: ckpt_torch.py
# run: netdist launch -n 2 -- python ckpt_torch.py
import asyncio

import safetensors.torch
import torch

import netdist
from netdist.checkpoint import RNGState, consolidate, load, save
from netdist.collectives import Group


def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    return model, torch.optim.Adam(model.parameters(), lr=0.01)


async def main() -> None:
    async with netdist.init() as transport, Group(transport) as group:
        torch.manual_seed(0)                        # the same weights on every rank
        model, optimizer = build()
        for _ in range(3):                          # (data-parallel training goes here)
            optimizer.zero_grad()
            model(torch.randn(16, 4)).pow(2).mean().backward()
            optimizer.step()
        state = {"model": model, "optim": optimizer, "rng": RNGState(), "step": 3}
        await save(state, "ckpt_torch", group, step=3, overwrite=True)
        expected = torch.rand(2)                    # what the generator draws next

        torch.manual_seed(100 + group.rank)         # as a restarted job would start:
        model2, optimizer2 = build()                # other weights, no optimizer state
        loaded = await load("ckpt_torch", group, like={"model": model2, "optim": optimizer2,
                                                       "rng": RNGState(), "step": 0})
        same = all(torch.equal(a, b) for a, b in
                   zip(model.state_dict().values(), model2.state_dict().values()))
        print(f"rank {group.rank}: step {loaded['step']}, weights restored: {same}, "
              f"Adam state for {len(optimizer2.state)} parameters, "
              f"rng restored: {torch.equal(torch.rand(2), expected)}")
        if group.rank == 0:                         # one file for torch / Hugging Face tools
            consolidate("ckpt_torch", "ckpt_torch/model.safetensors", prefix="model.")
            model3, _ = build()
            model3.load_state_dict(safetensors.torch.load_file("ckpt_torch/model.safetensors"),
                                   strict=True)
            print(f"consolidated: {sorted(model3.state_dict())}")


asyncio.run(main())
