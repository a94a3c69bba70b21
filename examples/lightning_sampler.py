"""Lightning shuffles the training data of a distributed strategy, even with ``shuffle=False``.

Under a distributed strategy (``DDPStrategy``, also on one process) Lightning replaces the
training DataLoader's sampler with torch's ``DistributedSampler(shuffle=True,
seed=PL_GLOBAL_SEED or 0)`` and calls ``set_epoch(epoch)`` before each epoch (Lightning 2.6:
``_process_dataloader`` passes ``shuffle=True`` for the training stage, and
``_get_distributed_sampler`` takes the seed from the ``PL_GLOBAL_SEED`` environment variable,
which ``L.seed_everything(seed)`` sets). So the global order of epoch ``e`` is
``torch.randperm(len(dataset), generator=torch.Generator().manual_seed(seed + e))``, and rank
``r`` of ``world`` takes every ``world``-th index of it from the ``r``-th on. A loop that
accumulates over the ranks' batches accumulates over windows of that order, not of the
dataset's. ``Trainer(use_distributed_sampler=False)`` keeps the DataLoader's own sampler (then
shard the data yourself).

The script records the indices each ``training_step`` receives on each rank, from a
``DataLoader(torch.arange(12), batch_size=2, shuffle=False)``, and checks them against that
formula for 2 epochs: with the default seed, after ``L.seed_everything(7)``, and with
``use_distributed_sampler=False``. It creates the gloo process group itself, and Lightning's
``DDPStrategy`` uses it: torchrun's, or a world of one on 127.0.0.1. It prints what it saw on
rank 0 and exits with status 1 if a check fails. Run it (a few seconds, most of it importing
Lightning)::

    python examples/lightning_sampler.py
    torchrun --standalone --nproc_per_node 2 examples/lightning_sampler.py
"""

from __future__ import annotations

import datetime
import os
import socket
import sys
import warnings

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities.warnings import PossibleUserWarning
from torch import nn
from torch.utils.data import DataLoader

ROWS, BATCH, EPOCHS = 12, 2, 2

# Lightning asks for DataLoader workers on machines with many cores; Lightning 2.6.6 with torch
# 2.13 trips over a deprecation in torch's pytree (its own code, not this script's).
warnings.filterwarnings("ignore", ".*does not have many workers", PossibleUserWarning)
warnings.filterwarnings(
    "ignore",
    r"`isinstance\(treespec, LeafSpec\)` is deprecated",
    FutureWarning,
    r"lightning\.pytorch\.utilities\._pytree",
)


class Recorder(L.LightningModule):
    """Trains nothing: keeps the indices of every batch, per epoch."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.layer = nn.Linear(1, 1)  # DDP wraps a module with parameters
        self.seen: list[list[int]] = []

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)

    def on_train_epoch_start(self) -> None:
        self.seen.append([])

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.seen[-1] += batch.tolist()


def init_distributed() -> tuple[int, int]:
    """The default gloo process group: torchrun's, or a world of one on 127.0.0.1."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    timeout = datetime.timedelta(seconds=60)
    if "RANK" in os.environ:  # torchrun
        dist.init_process_group("gloo", timeout=timeout)
    else:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        url = f"tcp://127.0.0.1:{port}"
        dist.init_process_group("gloo", init_method=url, rank=0, world_size=1, timeout=timeout)
    return dist.get_rank(), dist.get_world_size()


def fit(world: int, **kwargs) -> list[list[list[int]]]:
    """Every rank's indices, per epoch: ``seen[rank][epoch]``."""
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=DDPStrategy(process_group_backend="gloo"),
        max_epochs=EPOCHS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    )
    recorder = Recorder()
    trainer.fit(recorder, DataLoader(torch.arange(ROWS), batch_size=BATCH, shuffle=False))
    seen: list = [None] * world
    dist.all_gather_object(seen, recorder.seen)
    return seen


def shuffled(seed: int, epoch: int, rank: int, world: int) -> list[int]:
    """What a DistributedSampler(shuffle=True, seed=seed) gives rank ``rank`` in ``epoch``."""
    order = torch.randperm(ROWS, generator=torch.Generator().manual_seed(seed + epoch))
    return order[rank::world].tolist()


def main() -> int:
    torch.set_num_threads(1)
    rank, world = init_distributed()
    lines = [
        f"{world} process(es), DDPStrategy; DataLoader(torch.arange({ROWS}), "
        f"batch_size={BATCH}, shuffle=False), {EPOCHS} epochs"
    ]
    ok = True
    try:
        os.environ.pop("PL_GLOBAL_SEED", None)
        default = fit(world)
        for epoch in range(EPOCHS):
            saw = ", ".join(f"rank {r} saw {default[r][epoch]}" for r in range(world))
            lines.append(f"epoch {epoch}: {saw}")
        for seed, seen in ((0, default), (7, None)):
            if seen is None:
                L.seed_everything(seed, verbose=False)  # sets PL_GLOBAL_SEED
                seen = fit(world)
            match = [
                all(seen[r][e] == shuffled(seed, e, r, world) for r in range(world))
                for e in range(EPOCHS)
            ]
            ok = ok and all(match)
            how = "default seed" if seed == 0 else f"after L.seed_everything({seed})"
            lines.append(
                f"{how}: each epoch e is torch.randperm({ROWS}, generator=torch.Generator()"
                f".manual_seed({seed} + e))[rank::{world}]: {match}"
            )
        kept = fit(world, use_distributed_sampler=False)
        same = all(kept[r][e] == list(range(ROWS)) for r in range(world) for e in range(EPOCHS))
        ok = ok and same
        lines.append(
            f"use_distributed_sampler=False: every rank saw the DataLoader's order, "
            f"0..{ROWS - 1}, in every epoch: {same}"
        )
        if rank == 0:
            print(*lines, "OK" if ok else "FAILED", sep="\n", flush=True)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
