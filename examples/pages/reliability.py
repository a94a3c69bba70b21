"""The code of docs/reliability.md, runnable: its python block is a fragment of this file.

The restartable training loop of the page: mid-window checkpoints of every rank, and a restart
from the latest step that every rank saved. Run it twice from the same directory: the second run
resumes from the checkpoints of the first (the tests do, on 2 processes)::

    torchrun --standalone --nproc_per_node 2 examples/pages/reliability.py
"""

import datetime
import glob
import os
import re

import torch
import torch.distributed as dist
from torch import nn
from torch.func import functional_call

import gradaccum

dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=5))  # torchrun sets the rest
rank, world = dist.get_rank(), dist.get_world_size()
N, WINDOWS, CKPT_EVERY = 4, 1000, 50  # micro-batches per window; checkpoint every 50 micro-steps
os.makedirs("ckpt", exist_ok=True)

torch.manual_seed(0)  # the same initial parameters on every rank
model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))
params = gradaccum.params_of(model)
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
acc = gradaccum.Accumulator(n=N, sync=gradaccum.all_reduce(timeout=60))


def loss_fn(params, batch):
    x, y = batch
    return nn.functional.mse_loss(functional_call(model, params, (x,)).squeeze(-1), y)


micro_grad = gradaccum.grad(loss_fn)


def micro_batch(step):
    """This rank's micro-batch number `step` (window step // N): a function of the position."""
    data = torch.Generator().manual_seed(step * world + rank)
    x = torch.randn(8, 16, generator=data)
    return x, x[:, :4].sum(1)


def save(step, state):
    """This rank's checkpoint after `step` micro-steps, written atomically."""
    path = f"ckpt/step{step:09d}-rank{rank}.pt"
    torch.save(
        {
            "step": step,  # the data position: the next micro-batch is number `step`
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "accumulator": acc.state_dict(state),  # mid-window sums included
        },
        path + ".tmp",
    )
    os.replace(path + ".tmp", path)  # a crash while saving leaves the previous file


def latest_common_step():
    """The latest step for which every rank's file exists (a rank may have died saving)."""
    saved = {}
    for path in glob.glob("ckpt/step*-rank*.pt"):
        step, r = map(int, re.findall(r"\d+", os.path.basename(path)))
        saved.setdefault(step, set()).add(r)
    complete = [s for s, ranks in saved.items() if len(ranks) == world]
    return max(complete, default=None)


state, start = acc.init(params), 0
last = latest_common_step()
if last is not None:  # a restart: put back what the failed run had at that step
    ckpt = torch.load(f"ckpt/step{last:09d}-rank{rank}.pt", weights_only=True)
    model.load_state_dict(ckpt["model"])  # in place: `params` and the optimizer follow
    optimizer.load_state_dict(ckpt["optimizer"])
    try:
        state = acc.load_state_dict(acc.init(params), ckpt["accumulator"])
    except gradaccum.GradAccumError:
        acc.abort(state)  # a file of another run or model: let the other ranks fail now
        raise
    start = ckpt["step"]

try:
    for step in range(start, N * WINDOWS):
        try:
            state = acc.add(state, micro_grad(params, micro_batch(step)), size=8)
            if acc.is_complete(state):
                grads, state = acc.finalize(state)
                gradaccum.write_grads(model, grads)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
        except gradaccum.GradAccumError:
            raise  # another rank failed, or the group broke: nothing to join
        except Exception:
            acc.abort(state)  # let the other ranks fail now instead of at the timeout
            raise
        if (step + 1) % CKPT_EVERY == 0:
            save(step + 1, state)
finally:
    try:
        dist.destroy_process_group()
    except Exception:  # a broken group may refuse; the process ends anyway
        pass

print(f"rank {rank}: trained to micro-step {N * WINDOWS} from step {start}")
