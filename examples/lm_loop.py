"""The whole training loop with gradaccum.loop: the job of issue 17 in under 35 lines.

A tiny causal LM in float64 on padded sequences of random lengths, trained on the mean over the
non-padding tokens of each whole global window of n = 4 micro-batches, over loaders of 21 and 20
micro-batches on 2 ranks (the last window of each epoch short, and empty on rank 1), with AdamW,
a warm-up LambdaLR stepped once per optimizer step, clipping to 1.0, a progress bar of the global
mean loss, and a mid-window checkpoint that resumes bit-identically. ``examples/lm_job.py``
holds what every version of the job shares (model, data, launcher, checks); the user code is
between the markers (docs/loop.md puts it beside DDP + no_sync and Accelerate).

It checks itself: against a one-process float64 reference that trains on each whole global
window (at most 1e-10 apart), one scheduler step per window, and a run stopped at a mid-window
checkpoint and resumed, against the uninterrupted one (bit-identical). Exit status 1 if not.
``--plot PATH`` writes the global mean loss of each window (``bar.history``, returned by
``train``) beside the reference's per-window loss, as a PNG (needs matplotlib).

Run it (a few seconds on 2 CPU cores)::

    python examples/lm_loop.py                  # one process
    python examples/lm_loop.py --nproc 2        # 2 gloo processes on 127.0.0.1
    torchrun --standalone --nproc_per_node 2 examples/lm_loop.py
    python examples/lm_loop.py --nproc 2 --rows 80   # 20 and 20 micro-batches: no empty window
    python examples/lm_loop.py --nproc 2 --plot loss.png   # its loss beside the reference's
"""

from __future__ import annotations

import sys

import torch
from lm_job import Job, TinyLM, loader, main, token_loss, warmup

import gradaccum
from gradaccum import loop


# --- the job: begin ---
def train(job: Job, rank: int, world: int):
    torch.manual_seed(job.seed)
    model = TinyLM(job.max_len)
    optimizer = torch.optim.AdamW(model.parameters(), lr=job.lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup(job))
    sync = gradaccum.all_reduce()
    data = loop.windows(loader(job, rank, world), job.n, sync=sync, epochs=job.epochs)
    step = loop.Step(
        model,
        token_loss,  # (summed token loss, token count) of a micro-batch
        optimizer=optimizer,
        scheduler=scheduler,
        clip=job.clip,
        reduction="count",
        sync=sync,
    )
    if job.resume:
        loop.load(job.checkpoint, step=step, data=data)
    with loop.progress(data) as bar:
        for window in data:
            for batch in window:
                step.add(batch)
                if (window.index, step.micro_step) == job.save_at:
                    loop.save(job.checkpoint, step=step, data=data)
                    return model, scheduler, bar.history  # stop here, as a crash would
            bar.update(step.apply())  # the global mean token loss, from the boundary
    return model, scheduler, bar.history  # bar.history: each window's StepStats


# --- the job: end ---

if __name__ == "__main__":
    sys.exit(main(train, __doc__))
