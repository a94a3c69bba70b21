"""The code of docs/sync.md that needs processes, runnable: those blocks are fragments of it.

The page's training program (loss scaling, clipping, a scheduler) with its streaming
continuation, and the page's two short snippets as functions called from it: the summary call at
the top of the page and the error handling of a streaming window. The tests run it on 2
processes (it writes ``accumulator-rank*.pt`` in the working directory)::

    torchrun --standalone --nproc_per_node 2 examples/pages/sync.py
"""

import datetime

import torch
import torch.distributed as dist
from torch import nn
from torch.func import functional_call, grad

import gradaccum


def summary(model, local_batch):
    """The page's first block: one call, the gradient over all ranks' batches."""

    def loss_fn(params, batch):
        x, y = batch
        return nn.functional.mse_loss(functional_call(model, params, (x,)).squeeze(-1), y)

    params = gradaccum.params_of(model)
    step = gradaccum.accumulate(grad(loss_fn), n=4, sync=gradaccum.all_reduce())
    grads = step(params, local_batch)  # on every rank: the gradient over all ranks' local batches
    return grads


def joined(acc, state, window, micro_grad, params):
    """The page's streaming window that joins the boundary when it fails."""
    try:
        for mb in window:
            state = acc.add(state, micro_grad(params, mb), size=len(mb))
        grads, state = acc.finalize(state)
    except gradaccum.GradAccumError:
        raise  # another rank failed, or the group broke: nothing to join
    except Exception:
        acc.abort(state)  # let the other ranks fail now instead of at the timeout
        raise
    return grads, state


dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=2))  # torchrun sets the rest
rank, world = dist.get_rank(), dist.get_world_size()

torch.manual_seed(0)  # the same initial parameters on every rank
model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))
params = gradaccum.params_of(model)
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10, gamma=0.5)
scaler = gradaccum.boundary.LossScale(init_scale=2.0**10)
scale = scaler.init()


def loss_fn(params, batch, loss_scale):
    x, y = batch
    loss = nn.functional.mse_loss(functional_call(model, params, (x,)).squeeze(-1), y)
    return loss * loss_scale, loss.detach()  # differentiate the scaled loss; report the loss


step = gradaccum.accumulate(
    grad(loss_fn, has_aux=True), n=4, has_aux=True, sync=gradaccum.all_reduce(timeout=60)
)

applied = 0
for window in range(30):
    # The same global batch on every rank; each rank takes its share of the rows.
    data = torch.Generator().manual_seed(window)
    x = torch.randn(96, 16, generator=data)
    y = x[:, :4].sum(1)
    grads, loss = step(params, (x[rank::world], y[rank::world]), scale.scale)

    grads, finite, scale = scaler.unscale(grads, scale)  # the same decision on every rank
    if not finite:
        continue  # skip the optimizer step and the scheduler step
    grads, norm = gradaccum.boundary.clip_by_global_norm(grads, max_norm=1.0)
    gradaccum.write_grads(model, grads)
    optimizer.step()
    scheduler.step()  # once per applied window
    applied += 1

print(f"rank {rank}: {applied} steps, lr {scheduler.get_last_lr()[0]:g}, loss {float(loss):.4f}")

# -- the page's first block, and a streaming window that joins the boundary on failure ----------
data = torch.Generator().manual_seed(99)
x = torch.randn(8, 16, generator=data)
summary(model, (x[rank::world], x[rank::world, :4].sum(1)))
window = [x[i : i + 2] for i in range(0, 8, 2)]
micro_grad = gradaccum.grad(lambda p, mb: loss_fn(p, (mb, mb[:, :4].sum(1)), 1.0)[0])
acc = gradaccum.Accumulator(n=4, sync=gradaccum.all_reduce())
grads, state = joined(acc, acc.init(params), window, micro_grad, params)

# -- the streaming continuation ------------------------------------------------------------------
acc = gradaccum.Accumulator(n=4, sync=gradaccum.all_reduce(timeout=60))
micro_grad = grad(lambda p, b: loss_fn(p, b, 1.0), has_aux=True)

state = acc.init(params)
for i in range(4 * 5):  # 5 windows of 4 micro-batches, on every rank
    data = torch.Generator().manual_seed(1000 * (rank + 1) + i)
    x = torch.randn(8 + 8 * rank, 16, generator=data)  # 8 rows on rank 0, 16 on rank 1
    g, _ = micro_grad(params, (x, x[:, :4].sum(1)))
    state = acc.add(state, g, size=len(x))
    if acc.is_complete(state):
        grads, state = acc.finalize(state)  # the boundary: every rank, every window
        gradaccum.write_grads(model, grads)
        optimizer.step()
        scheduler.step()

# Checkpoint mid-window: the partial sums are this rank's own, so save one file per rank.
g, _ = micro_grad(params, (x, x[:, :4].sum(1)))
state = acc.add(state, g, size=len(x))
torch.save(acc.state_dict(state), f"accumulator-rank{rank}.pt")
resumed = acc.load_state_dict(
    acc.init(params), torch.load(f"accumulator-rank{rank}.pt", weights_only=True)
)
assert resumed.micro_step == 1
print(f"rank {rank}: every multi-process block of the page ran")
dist.destroy_process_group()
