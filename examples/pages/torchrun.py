"""The code of docs/torchrun.md, runnable: each python block of the page is a fragment of it.

The page's training script, with the page's other snippets where they go: the broadcast of rank
0's parameters, the global loss, and the same loop over a ``DistributedSampler``. Run it as the
page says (the tests run it on 2 processes)::

    torchrun --standalone --nproc_per_node 2 examples/pages/torchrun.py
"""

import datetime
import math
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.func import functional_call
from torch.utils.data import DataLoader, DistributedSampler

import gradaccum


def setup() -> torch.device:
    local_rank = int(os.environ["LOCAL_RANK"])  # set by torchrun: this process's index here
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)  # one GPU per process
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device, timeout=datetime.timedelta(minutes=5))
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=5))
    return device


def train(device: torch.device, rank: int, world: int) -> None:
    # The same dataset on every rank (in a real job: the same files, read lazily).
    data = torch.Generator().manual_seed(1234)
    X = torch.randn(10_000, 20, generator=data, dtype=torch.float64)
    Y = (X[:, :5].sum(1) > 0).long() + (X[:, 5:10].sum(1) > 0).long()

    torch.manual_seed(0)  # the same initial parameters on every rank
    model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 3))
    model = model.to(device, torch.float64)
    params = gradaccum.params_of(model)  # after .to(): shares storage with the parameters
    with torch.no_grad():
        for tensor in model.state_dict().values():
            dist.broadcast(tensor, src=0)
    torch.manual_seed(1 + rank)  # from here on, per-rank randomness (dropout, augmentation)

    global_batch, epochs = 512, 3
    windows_per_epoch = math.ceil(len(X) / global_batch)  # the same on every rank
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(
        optimizer,
        T_max=epochs * windows_per_epoch,  # counted in windows, not micro-batches
    )

    def loss_fn(params, batch):
        x, y = batch
        return nn.functional.cross_entropy(functional_call(model, params, (x,)), y)

    step = gradaccum.accumulate(
        gradaccum.grad_and_value(loss_fn),  # backward into the buckets; overlapped all_reduce
        n=4,
        has_aux=True,
        sync=gradaccum.all_reduce(timeout=60),
    )
    for epoch in range(epochs):
        # One shuffle, the same on every rank; each rank takes every world-th row of a batch.
        order = torch.randperm(len(X), generator=torch.Generator().manual_seed(epoch))
        for start in range(0, len(X), global_batch):
            rows = order[start : start + global_batch][rank::world]
            grads, loss = step(params, (X[rows].to(device), Y[rows].to(device)))
            rows_here = len(rows)
            total = torch.tensor(
                [float(loss) * rows_here if rows_here else 0.0, rows_here],
                dtype=torch.float64,
                device=device,
            )
            dist.all_reduce(total)  # your collective: not recorded by record_collectives()
            global_loss = total[0].item() / total[1].item()
            gradaccum.write_grads(model, grads)
            optimizer.step()
            scheduler.step()  # once per window
        if rank == 0:
            print(f"epoch {epoch}: loss on rank 0's share of the last batch {float(loss):.4f}")
            print(f"epoch {epoch}: global loss of the last batch {global_loss:.4f}")
    with torch.no_grad():
        checksum = sum(float(p.sum()) for p in model.parameters())
    print(f"rank {rank}: parameter checksum {checksum:.15e}")
    with_sampler(torch.utils.data.TensorDataset(X, Y), model, step, params, optimizer, rank, world)


def with_sampler(dataset, model, step, params, optimizer, rank, world):
    """The page's DistributedSampler loop: one more epoch, this rank's share of the data set."""
    local_batch, epochs = 512 // world, 1
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=local_batch, sampler=sampler)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)  # a new shuffle each epoch, the same on every rank
        for batch in loader:
            grads, loss = step(params, batch)
            # the optimizer step, as above
            gradaccum.write_grads(model, grads)
            optimizer.step()
    print(f"rank {rank}: {len(loader)} windows over a DistributedSampler")


def main() -> None:
    device = setup()
    try:
        train(device, dist.get_rank(), dist.get_world_size())
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
