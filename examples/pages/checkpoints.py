"""The code of docs/checkpoints.md that needs processes, runnable: its block is a fragment of it.

A checkpoint every K micro-batches on ranks whose data is uneven (11 and 9 micro-batches in
windows of 4: the last window holds 3 on rank 0 and 1 on rank 1). The program trains once
without a stop, saving at every K-th micro-batch position, then resumes from each save in turn
and checks that the parameters end bit-identical to the uninterrupted run. The tests run it on 2
processes (it writes ``ckpt/`` in the working directory)::

    torchrun --standalone --nproc_per_node 2 examples/pages/checkpoints.py
"""

import datetime

import torch
import torch.distributed as dist
from torch import nn

import gradaccum
from gradaccum import loop

dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=2))  # torchrun sets the rest
rank = dist.get_rank()
N, K = 4, 5  # micro-batches per window; a checkpoint every K micro-batch positions


def micro_batches():
    """This rank's data: 11 micro-batches on rank 0, 9 on rank 1 (uneven)."""
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(11 if rank == 0 else 9, 2, 4, generator=g)
    return [(xb, xb.sum(1, keepdim=True)) for xb in x]


def mse(model, batch):
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


def due(index, position):
    """Whether a checkpoint is due after micro-batch `position` (1..N) of window `index`."""
    return (index * N + position) % K == 0


def train(resume_from=None, save_to="ckpt"):
    """Train from the start (or `resume_from`), saving every K positions; the final weights."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    data = loop.windows(micro_batches(), N, sync=gradaccum.all_reduce())
    step = loop.Step(model, mse, optimizer, data=data)  # under the sync of data
    saved = []

    def save(index, position):  # every rank saves at the same (index, position)
        saved.append(f"{save_to}/{index}-{position}")
        loop.save(saved[-1], step)

    restarted = None
    if resume_from is not None:
        loop.load(resume_from, step)
        restarted = data.window  # the window the save was taken in: it goes on, saving nothing
    for window in data:
        saving = window.index != restarted
        for batch in window:
            step.add(batch)
            if saving and due(window.index, step.micro_step):  # after the K-th add
                save(window.index, step.micro_step)
        # A rank whose window is shorter: the saves due after its last micro-batch, here
        # (the other ranks reach those positions in this window and save there).
        for position in range(step.micro_step + 1, N + 1):
            if saving and due(window.index, position):
                save(window.index, position)
        step.apply()
    return model.weight.detach().clone(), saved


whole, saves = train()
for path in saves:
    resumed, _ = train(resume_from=path, save_to="ckpt/again")
    assert torch.equal(resumed, whole), f"rank {rank}: resumed from {path}, other weights"
print(f"rank {rank}: {len(saves)} saves ({', '.join(saves)}), each resumes bit-identically")
dist.destroy_process_group()
