"""The code of docs/sharded.md, runnable: each python block of the page is a fragment of it.

The page's training script, then its other snippets in order, on the same ``Sharded``: the mixed
policy, loss scaling, checkpoints between windows and mid-window, DCP, and resharding through
whole params. Run it from a scratch directory (it writes ``ckpt/``, ``model.pt``, ``whole.pt``);
the tests run it on 2 processes::

    torchrun --standalone --nproc_per_node 2 examples/pages/sharded.py
"""

import datetime
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.func import functional_call

import gradaccum

dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=2))  # torchrun sets the rest
rank, world = dist.get_rank(), dist.get_world_size()

torch.manual_seed(rank)  # any initialisation: shard() starts every rank from rank 0's values
model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 4))
sharded = gradaccum.shard(
    gradaccum.params_of(model),
    param_groups=lambda path: "no_decay" if "bias" in path else "decay",
)
model.to("meta")  # the module keeps its structure for functional_call; the params are sharded
optimizer = torch.optim.AdamW(
    [
        {"params": sharded.group_shards("decay"), "weight_decay": 0.05},
        {"params": sharded.group_shards("no_decay"), "weight_decay": 0.0},
    ],
    lr=3e-3,
)


def loss_fn(params, batch):
    x, y = batch
    return nn.functional.cross_entropy(functional_call(model, params, (x,)), y)


sync = gradaccum.reduce_scatter(sharded, policy="boundary", timeout=60)
step = gradaccum.accumulate(gradaccum.grad_and_value(loss_fn), n=4, sync=sync)

for i in range(100):
    data = torch.Generator().manual_seed(i)  # the same global batch on every rank
    x = torch.randn(256, 16, generator=data)
    y = (x[:, :4].sum(1) > 0).long() + (x[:, 4:8].sum(1) > 0).long()
    grads, loss = step(sharded, (x[rank::world], y[rank::world]))  # this rank's gradient shards
    grads, norm = gradaccum.boundary.clip_by_global_norm(grads, 1.0, group=dist.group.WORLD)
    sharded.write_grads(grads)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)

params = sharded.gather()  # the full params, on every rank: evaluate, or save a plain state dict
if rank == 0:
    torch.save({name: p.clone() for name, p in params.items()}, "model.pt")
print(f"rank {rank}: loss on this rank's share of the last batch {float(loss):.4f}")


# -- a policy per parameter group ----------------------------------------------------------------
sync = gradaccum.reduce_scatter(sharded, policy={"decay": "every", "no_decay": "boundary"})

assert sync.policies()

# -- the wire dtype ------------------------------------------------------------------------------
wire = gradaccum.reduce_scatter(sharded, policy="every", reduce_dtype=torch.bfloat16)
assert {b.dtype for b in wire.plan()} == {torch.bfloat16}  # what goes on the wire

# -- loss scaling and clipping with the shards' group --------------------------------------------
scaler = gradaccum.boundary.LossScale(init_scale=2.0**10)
scale = scaler.init()
batch = (x[rank::world], y[rank::world])


def scaled_loss(params, batch, s):
    return loss_fn(params, batch) * s


step = gradaccum.accumulate(gradaccum.grad_and_value(scaled_loss), n=4, sync=sync)
grads, loss = step(sharded, batch, scale.scale)  # loss_fn(params, batch, s) returns loss * s
grads, finite, scale = scaler.unscale(grads, scale, group=dist.group.WORLD)  # every rank alike
if finite:
    grads, norm = gradaccum.boundary.clip_by_global_norm(grads, 1.0, group=dist.group.WORLD)
    sharded.write_grads(grads)
    optimizer.step()
optimizer.zero_grad(set_to_none=True)

# -- checkpoints between windows -----------------------------------------------------------------
os.makedirs("ckpt", exist_ok=True)
torch.save(
    {"step": i, "sharded": sharded.state_dict(), "optimizer": optimizer.state_dict()},
    f"ckpt/rank{rank}.pt",
)

# To resume: shard the same params with the same param_groups and bucket_mb, build the same
# optimizer, then load the shards (in place) before the optimizer state.
state = torch.load(f"ckpt/rank{rank}.pt", weights_only=True)
sharded.load_state_dict(state["sharded"])
optimizer.load_state_dict(state["optimizer"])

# -- mid-window, with Accumulator ----------------------------------------------------------------
micro_batches = list(zip(x[rank::world].tensor_split(6), y[rank::world].tensor_split(6)))
acc = gradaccum.Accumulator(n=4, sync=gradaccum.reduce_scatter(sharded, policy="every"))
micro_grad = gradaccum.grad_and_value(loss_fn)

state = acc.init(sharded)
params = sharded.gather()  # once per window
for x, y in micro_batches:  # this rank's micro-batches, the same number on every rank
    g, loss = micro_grad(params, (x, y))
    state = acc.add(state, g, size=len(x))
    if acc.is_complete(state):
        grads, state = acc.finalize(state)  # this rank's gradient shards
        sharded.write_grads(grads)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        params = sharded.gather()  # the next window's params

# Mid-window: the running sums are this rank's own.
torch.save(
    {
        "accumulator": acc.state_dict(state),
        "sharded": sharded.state_dict(),
        "optimizer": optimizer.state_dict(),
    },
    f"ckpt/rank{rank}.pt",
)

# To resume (same world size, same shard/param_groups/bucket_mb, policy and reduction):
ckpt = torch.load(f"ckpt/rank{rank}.pt", weights_only=True)
sharded.load_state_dict(ckpt["sharded"])
optimizer.load_state_dict(ckpt["optimizer"])
state = acc.load_state_dict(acc.init(sharded), ckpt["accumulator"])
params = sharded.gather()
assert state.micro_step == 2  # 6 micro-batches: a window of 4, then 2 saved mid-window

# -- torch.distributed.checkpoint ----------------------------------------------------------------


def groups(path):
    return "no_decay" if "bias" in path else "decay"


def make_optimizer(sharded):
    return torch.optim.AdamW(
        [
            {"params": sharded.group_shards("decay"), "weight_decay": 0.05},
            {"params": sharded.group_shards("no_decay"), "weight_decay": 0.0},
        ],
        lr=3e-3,
    )


import torch.distributed.checkpoint as dcp

dcp.save(
    {"train": gradaccum.checkpoint.dcp_checkpoint(sharded, optimizer)}, checkpoint_id="ckpt/100"
)
# later, on any number of ranks: the same params, param_groups and bucket_mb
sharded = gradaccum.shard(params, param_groups=groups)
optimizer = make_optimizer(sharded)
dcp.load(
    {"train": gradaccum.checkpoint.dcp_checkpoint(sharded, optimizer)}, checkpoint_id="ckpt/100"
)

# A window in progress, with an accumulator of the new Sharded:
acc = gradaccum.Accumulator(n=4, sync=gradaccum.reduce_scatter(sharded, policy="every"))
params = sharded.gather()
state = acc.init(sharded)
g, loss = micro_grad(params, micro_batches[0])
state = acc.add(state, g, size=len(micro_batches[0][0]))
gradaccum.checkpoint.dcp_save("ckpt/window", sharded, optimizer, accumulator=acc, state=state)
state = gradaccum.checkpoint.dcp_load("ckpt/window", sharded, optimizer, accumulator=acc)


# -- whole params and optimizer state, to reshard without DCP -----------------------------------
def gather_like(sharded, tensors):
    """All-gather tensors laid out like sharded.shards (e.g. optimizer moments), as full params."""
    kept = [s.clone() for s in sharded.shards]
    with torch.no_grad():
        for s, t in zip(sharded.shards, tensors):
            s.copy_(t)
        full = sharded.gather()  # views into new buffers: unaffected by the restore below
        for s, k in zip(sharded.shards, kept):
            s.copy_(k)
    return full


whole = {"params": sharded.gather()}
for key in ("exp_avg", "exp_avg_sq"):
    whole[key] = gather_like(sharded, [optimizer.state[s][key] for s in sharded.shards])
whole["step"] = optimizer.state[sharded.shards[0]]["step"]
if rank == 0:
    torch.save(whole, "whole.pt")

dist.barrier()  # here in one job (the page's is a new run): rank 0 has written whole.pt
whole = torch.load("whole.pt", weights_only=True)
sharded = gradaccum.shard(whole["params"], param_groups=groups, src=None)
optimizer = make_optimizer(sharded)  # as before: AdamW on sharded.group_shards(...)
for key in ("exp_avg", "exp_avg_sq"):
    moments = gradaccum.shard(whole[key], param_groups=groups, src=None).shards
    for s, m in zip(sharded.shards, moments):
        optimizer.state[s][key] = m
for s in sharded.shards:
    optimizer.state[s]["step"] = whole["step"].clone()

print(f"rank {rank}: every snippet of the page ran")
dist.destroy_process_group()
