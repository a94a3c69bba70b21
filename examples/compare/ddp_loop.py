"""The job of issue 17 with plain DDP and ``no_sync``: the anchor that docs/loop.md compares with.

The same job as ``examples/lm_loop.py`` (see ``examples/lm_job.py``), written with
``DistributedDataParallel`` as a careful user would to make it exact: every rank makes as many
optimizer steps per epoch as the longest rank needs (an all-reduce of the loader lengths), a rank
whose window is empty still joins the gradient all-reduce (a backward of zero), the token count
of each global window is all-reduced before its first backward (a second all-reduce per window),
the global loss for the bar is a third, and the checkpoint bundles the model, optimizer,
scheduler, the window's accumulated gradients, the data position and the random states by hand.
It checks itself the same way; it runs in one process as a world of one.

    python examples/compare/ddp_loop.py --nproc 2
"""

from __future__ import annotations

import contextlib
import itertools
import math
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from lm_job import IGNORE, Job, TinyLM, loader, main, token_loss, warmup  # noqa: E402


# --- the job: begin ---
def train(job: Job, rank: int, world: int):
    torch.manual_seed(job.seed)
    model = DDP(TinyLM(job.max_len))
    optimizer = torch.optim.AdamW(model.parameters(), lr=job.lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup(job))
    data = loader(job, rank, world)
    longest = torch.tensor([len(data)])  # every rank steps as often as the longest one needs
    dist.all_reduce(longest, op=dist.ReduceOp.MAX)
    per_epoch = math.ceil(longest.item() / job.n)
    epoch0, window0, done, saved = 0, 0, 0, None
    if job.resume:
        saved = torch.load(f"{job.checkpoint}/rank{rank}.pt", weights_only=False)
        model.module.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        scheduler.load_state_dict(saved["scheduler"])
        epoch0, window0, done = saved["epoch"], saved["window"], saved["done"]
    bar = tqdm(total=job.epochs * per_epoch, initial=epoch0 * per_epoch + window0, disable=rank)
    for epoch in range(epoch0, job.epochs):
        epoch_rng = saved["epoch_rng"] if saved else torch.get_rng_state()
        torch.set_rng_state(epoch_rng)  # the shuffle is drawn when the first batch is read
        batches = iter(data)
        for _ in range(window0 * job.n):
            next(batches)
        for w in range(window0, per_epoch):
            window = list(itertools.islice(batches, job.n))
            if saved:
                torch.set_rng_state(saved["rng"])
            tokens = torch.tensor(float(sum((b["labels"] != IGNORE).sum() for b in window)))
            dist.all_reduce(tokens)  # the window's global token count, before any backward
            loss_sum = saved["loss_sum"] if saved else torch.zeros((), dtype=torch.float64)
            for p, g in zip(model.parameters(), saved["grads"] if saved else []):
                p.grad = g
            for i, batch in enumerate(window[done:], start=done):
                with model.no_sync() if i < len(window) - 1 else contextlib.nullcontext():
                    summed, _ = token_loss(model, batch)
                    (summed * world / tokens).backward()  # DDP averages over the ranks
                loss_sum += summed.detach()
                if (epoch * per_epoch + w, i + 1) == job.save_at:
                    grads = [p.grad.clone() for p in model.parameters()]
                    state = {"model": model.module.state_dict(), "grads": grads, "done": i + 1}
                    state |= {"optimizer": optimizer.state_dict(), "epoch": epoch, "window": w}
                    state |= {"scheduler": scheduler.state_dict(), "epoch_rng": epoch_rng}
                    state |= {"rng": torch.get_rng_state(), "loss_sum": loss_sum}
                    Path(job.checkpoint).mkdir(parents=True, exist_ok=True)
                    torch.save(state, f"{job.checkpoint}/rank{rank}.pt")
                    return model.module, scheduler
            if not window:  # this rank's data ran out: join the gradient all-reduce with zeros
                (model(torch.zeros(1, 1, dtype=torch.long)).sum() * 0).backward()
            dist.all_reduce(loss_sum)
            bar.set_postfix(loss=f"{loss_sum.item() / tokens.item():.4f}")
            bar.update()
            torch.nn.utils.clip_grad_norm_(model.parameters(), job.clip)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            done, saved = 0, None
        window0 = 0
    bar.close()
    return model.module, scheduler


# --- the job: end ---

if __name__ == "__main__":
    sys.exit(main(train, __doc__))
