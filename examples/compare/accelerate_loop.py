"""The job of issue 17 with Hugging Face Accelerate: the other anchor of docs/loop.md.

The same job as ``examples/lm_loop.py`` (see ``examples/lm_job.py``), written with
``accelerate.Accelerator`` as a careful user would to make it exact. What its defaults would get
wrong is avoided by hand: the scheduler is prepared with ``step_scheduler_with_optimizer=False``
(by default a prepared scheduler steps once per process at each optimizer step), the loader is
not prepared (``even_batches=True`` would repeat samples on the shorter rank, ``False`` lets the
ranks' windows drift apart), the window boundaries, the token count of each global window and
the global loss are computed by hand, an empty window joins the gradient all-reduce with a zero
backward, and ``save_state`` is completed by the window's gradients and the data position
(it saves neither). It checks itself the same way.

Needs ``pip install accelerate``::

    python examples/compare/accelerate_loop.py --nproc 2
"""

from __future__ import annotations

import contextlib
import itertools
import math
import sys
from pathlib import Path

import torch
from accelerate import Accelerator
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from lm_job import IGNORE, Job, TinyLM, loader, main, token_loss, warmup  # noqa: E402


# --- the job: begin ---
def train(job: Job, rank: int, world: int):
    torch.manual_seed(job.seed)
    accelerator = Accelerator(cpu=True, step_scheduler_with_optimizer=False)
    model = TinyLM(job.max_len)
    optimizer = torch.optim.AdamW(model.parameters(), lr=job.lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup(job))
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    data = loader(job, rank, world)  # not prepared: it would pad or desynchronise the ranks
    longest = accelerator.gather(torch.tensor([len(data)])).max().item()
    per_epoch = math.ceil(longest / job.n)
    epoch0, window0, done, saved = 0, 0, 0, None
    if job.resume:
        accelerator.load_state(job.checkpoint)
        saved = torch.load(f"{job.checkpoint}/position{rank}.pt", weights_only=False)
        epoch0, window0, done = saved["epoch"], saved["window"], saved["done"]
        saved["rng"] = torch.get_rng_state()  # as load_state restored it
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
            count = sum((b["labels"] != IGNORE).sum() for b in window)
            tokens = accelerator.reduce(torch.tensor(float(count)), reduction="sum")
            loss_sum = saved["loss_sum"] if saved else torch.zeros((), dtype=torch.float64)
            for p, g in zip(model.parameters(), saved["grads"] if saved else []):
                p.grad = g
            for i, batch in enumerate(window[done:], start=done):
                last = i == len(window) - 1
                with contextlib.nullcontext() if last else accelerator.no_sync(model):
                    summed, _ = token_loss(model, batch)
                    accelerator.backward(summed * world / tokens)  # DDP averages over ranks
                loss_sum += summed.detach()
                if (epoch * per_epoch + w, i + 1) == job.save_at:
                    accelerator.save_state(job.checkpoint)
                    grads = [p.grad.clone() for p in model.parameters()]
                    state = {"grads": grads, "done": i + 1, "epoch": epoch, "window": w}
                    state |= {"epoch_rng": epoch_rng, "loss_sum": loss_sum}
                    torch.save(state, f"{job.checkpoint}/position{rank}.pt")
                    return accelerator.unwrap_model(model), scheduler
            if not window:  # this rank's data ran out: join the gradient all-reduce with zeros
                accelerator.backward(model(torch.zeros(1, 1, dtype=torch.long)).sum() * 0)
            loss = accelerator.reduce(loss_sum, reduction="sum") / tokens
            bar.set_postfix(loss=f"{loss.item():.4f}")
            bar.update()
            accelerator.clip_grad_norm_(model.parameters(), job.clip)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            done, saved = 0, None
        window0 = 0
    bar.close()
    return accelerator.unwrap_model(model), scheduler


# --- the job: end ---

if __name__ == "__main__":
    sys.exit(main(train, __doc__))
