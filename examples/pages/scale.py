"""The code of docs/scale.md, runnable: each python block of the page is a fragment of it.

A 2-D (replicate, shard) mesh of ``world / 2`` nodes of 2 ranks: plain parameters sharded by
gradaccum over it, then an FSDP2 (``fully_shard``) model trained through gradaccum. The tests run
it on 2 processes (a 1 x 2 mesh)::

    torchrun --standalone --nproc_per_node 4 examples/pages/scale.py
"""

import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.func import functional_call

import gradaccum

dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
rank, world = dist.get_rank(), dist.get_world_size()
device_type = "cuda" if torch.cuda.is_available() else "cpu"
if device_type == "cuda":
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
gpus_per_node = 2
nodes = world // gpus_per_node


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.Sequential(
            *[nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(2)]
        )
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        return self.head(self.blocks(x))


def build_model():
    torch.manual_seed(0)
    return Net().to(device_type)


model = build_model()


def loss_fn(params, batch):
    out = functional_call(model, params, (batch["x"],))
    return nn.functional.cross_entropy(out, batch["y"])


data = torch.Generator().manual_seed(1)
x = torch.randn(64, 16, generator=data)
batch = {"x": x[rank::world].to(device_type), "y": (x[rank::world, :4].argmax(1)).to(device_type)}

from torch.distributed.device_mesh import init_device_mesh

mesh = init_device_mesh(device_type, (nodes, gpus_per_node), mesh_dim_names=("replicate", "shard"))
sharded = gradaccum.shard(gradaccum.params_of(model), mesh)  # shards over dim 1
opt = torch.optim.AdamW(sharded.shards, lr=3e-4)
sync = gradaccum.reduce_scatter(sharded, policy="every")  # or "boundary", or per group
step = gradaccum.accumulate(gradaccum.grad(loss_fn), n=8, sync=sync)
sharded.write_grads(step(sharded, batch))

opt.step()

# -- an FSDP2 model ------------------------------------------------------------------------
model = build_model()
for block in model.blocks:
    fully_shard(block, mesh=mesh)
fully_shard(model, mesh=mesh)
opt = torch.optim.AdamW(model.parameters(), lr=3e-4)  # the DTensor parameters, as usual

sharded = gradaccum.shard(model)  # the model's own shards, where FSDP2 keeps them


def loss_fn(params, batch):  # params: the gathered, plain parameters by name
    out, _ = gradaccum.call_module(model, params, {}, batch["x"])
    return torch.nn.functional.cross_entropy(out, batch["y"])


sync = gradaccum.reduce_scatter(sharded, policy="every")
step = gradaccum.accumulate(gradaccum.grad(loss_fn), n=8, sync=sync)
sharded.write_grads(step(sharded, batch))  # DTensor gradients on model.parameters()
opt.step()
opt.zero_grad()
print(f"rank {rank}: both of the page's blocks ran")
dist.destroy_process_group()
