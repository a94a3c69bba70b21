"""The code of docs/reductions.md that needs processes: those blocks are fragments of it.

The page's summary call of a custom reduction, its per-rank checkpoint of the reduction's state,
and its one-bit reduction under an ``Accumulator`` with a mid-window checkpoint. The tests run it
on 2 processes (it writes ``ckpt-rank*.pt`` and ``accumulator-rank*.pt`` in the working
directory)::

    torchrun --standalone --nproc_per_node 2 examples/pages/reductions.py
"""

import torch
import torch.distributed as dist
from torch import nn
from torch.func import functional_call, grad, vmap

import gradaccum

BITS = 2 ** torch.arange(8, dtype=torch.uint8)  # 1, 2, 4, ..., 128: 8 signs per byte


def gather(t, group):
    """Every rank's ``t``, stacked: shape ``(world, *t.shape)``."""
    if group is None:  # one process without torch.distributed: a world of one
        return t.unsqueeze(0)
    world = dist.get_world_size(group)
    out = t.new_empty(world * t.numel())
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    all_gather(out, t.reshape(-1), group=group)
    return out.view(world, *t.shape)


def init_errors(zeros):
    return zeros  # one error-feedback buffer per leaf, zero before the first window


def one_bit(shares, errors, group):
    """Send 1 bit per element and one scale per leaf; keep what the message misses."""
    names = list(shares)  # a flat dict of tensors, as gradaccum.params_of gives
    corrected = [shares[k] + errors[k] for k in names]  # add what was not sent before
    scales = torch.stack([c.abs().mean() for c in corrected])  # one number per leaf
    positive = torch.cat([c.reshape(-1) >= 0 for c in corrected])
    bits = torch.cat([positive, positive.new_zeros(-len(positive) % 8)]).view(-1, 8)
    packed = (bits.to(torch.uint8) * BITS.to(bits.device)).sum(1, dtype=torch.uint8)

    all_scales = gather(scales, group)  # (world, leaves)
    all_packed = gather(packed, group)  # (world, bytes): 1/32 of the float32 gradient
    unpacked = all_packed.unsqueeze(-1).bitwise_and(BITS.to(packed.device)).ne(0)
    signs = unpacked.flatten(1)[:, : len(positive)].to(scales.dtype) * 2 - 1  # +1 or -1

    summed, new_errors, start = {}, {}, 0
    for i, (name, c) in enumerate(zip(names, corrected)):
        sent = torch.where(c >= 0, scales[i], -scales[i])  # what this rank's message says
        new_errors[name] = c - sent  # what it does not say: added to the next window
        mine = signs[:, start : start + c.numel()]  # every rank's signs for this leaf
        summed[name] = (all_scales[:, i, None] * mine).sum(0).view_as(c)
        start += c.numel()
    return summed, new_errors


sync = gradaccum.custom_reduce(one_bit, init=init_errors)

# -- the summary at the top of the page ----------------------------------------------------------
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
model = nn.Linear(8, 1)
params = gradaccum.params_of(model)
data = torch.Generator().manual_seed(rank)
local_batch = (torch.randn(12, 8, generator=data), torch.randn(12, generator=data))


def loss_fn(params, batch):
    x, y = batch
    return ((functional_call(model, params, (x,)).squeeze(-1) - y) ** 2).mean()


def fn(shares, state, group):  # the exact sum over the ranks, and a count of windows
    for share in shares.values():
        dist.all_reduce(share, group=group)
    return shares, state + 1


def init(zeros):
    return 0


sync = gradaccum.custom_reduce(fn, init=init)  # fn(shares, state, group) -> (summed, new_state)
step = gradaccum.accumulate(grad(loss_fn), n=4, sync=sync)
grads = step(params, local_batch)  # fn's estimate of the gradient over all ranks' batches
assert sync.state == 1

# -- the reduction's state in a checkpoint -------------------------------------------------------
torch.save({"model": model.state_dict(), "reduce": sync.state}, f"ckpt-rank{rank}.pt")
...
checkpoint = torch.load(f"ckpt-rank{rank}.pt", weights_only=True)
sync.load_state(checkpoint["reduce"])  # before the first window after the restart
assert sync.state == 1

# -- one_bit under an Accumulator, checkpointed mid-window ---------------------------------------
window = [(x[None], y[None]) for x, y in zip(*local_batch)][:4]
micro_grad = grad(loss_fn)
acc = gradaccum.Accumulator(n=4, sync=gradaccum.custom_reduce(one_bit, init=init_errors))
state = acc.init(params)
for micro_batch in window:
    state = acc.add(state, micro_grad(params, micro_batch), size=len(micro_batch))
grads, state = acc.finalize(state)  # state.reduce_state: the new error-feedback buffers
torch.save(acc.state_dict(state), f"accumulator-rank{rank}.pt")  # buffers included

# -- DP-SGD ----------------------------------------------------------------------------------------
torch.manual_seed(0)
model = nn.Linear(8, 3)
params = gradaccum.params_of(model)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
N, q = 512, 0.5
sampler = torch.Generator().manual_seed(7)  # the same on every rank
x, y = torch.randn(N, 8, generator=sampler), torch.randint(0, 3, (N,), generator=sampler)


def loss_of_one(params, sample):
    x, y = sample
    logits = functional_call(model, params, (x[None],))
    return torch.nn.functional.cross_entropy(logits, y[None])


step = gradaccum.accumulate(
    vmap(grad(loss_of_one), in_dims=(None, 0)),
    n=4,
    reduction="sum",
    micro_transform=gradaccum.privacy.clip_per_sample(1.0),
    sync=gradaccum.privacy.dp_noise(noise_multiplier=1.1, max_norm=1.0, expected_batch_size=256),
)
# Poisson sampling: each point is in the logical batch with probability q = L / N,
# the same draw on every rank (a shared generator); each rank takes its part.
chosen = (torch.rand(N, generator=sampler) < q).nonzero().flatten()[rank::world]
grads = step(params, (x[chosen], y[chosen]))  # (clipped sum + noise) / L, identical on every rank
gradaccum.write_grads(model, grads)
opt.step()
print(f"rank {rank}: the page's multi-process blocks ran")
dist.destroy_process_group()
