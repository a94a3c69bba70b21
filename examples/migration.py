"""The loops of docs/migration.md, runnable: DDP + no_sync against gradaccum, step for step.

Every code block of the migration page is a fragment of this file (the doc tests check that its
lines are here, in order). Run on 2 processes, or on one (a world of one)::

    torchrun --standalone --nproc_per_node 2 examples/migration.py
    python examples/migration.py

It trains the same classifier (float64, AdamW, clipping, a cosine schedule) with

1. DDP + ``no_sync`` (the page's "before"), and
2. ``gradaccum.accumulate(..., sync=gradaccum.all_reduce())`` (its "after"),

from the same initial weights on the same batches, and checks that they end with the same
parameters (they should: equal micro-batches on equal shares). Then it runs the page's streaming
loop (``Accumulator`` over a ``DistributedSampler``), checking that every rank holds the same
parameters, and the token-level loop on a tiny language model, checking its first window's
gradient against the token mean over the whole global batch. ``--accelerate`` also runs the
page's Accelerate loop (needs ``pip install accelerate``; not run by the tests). Exits 1 if a check
fails.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import socket
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.func import functional_call
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

import gradaccum

TOL = 1e-10


def init() -> tuple[int, int]:
    """The default process group: torchrun's, or a world of one on 127.0.0.1."""
    timeout = datetime.timedelta(seconds=120)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if "RANK" in os.environ:
        dist.init_process_group("gloo", timeout=timeout)
    else:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1, timeout=timeout
        )
    return dist.get_rank(), dist.get_world_size()


def make_model() -> nn.Module:
    torch.manual_seed(0)  # the same initial parameters on every rank, and for every loop
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 3)).double()


def global_batches(steps: int, rows: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(steps, rows, 8, generator=g, dtype=torch.float64)
    return [(xs, (xs[:, :3] + 0.3 * xs[:, 3:6]).argmax(1)) for xs in x]


def ddp_no_sync(model, loss_fn, loader, n, steps, device):
    """The page's "DDP + no_sync" tab."""
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=steps)

    for x, y in loader:  # this rank's batch
        optimizer.zero_grad()
        chunks = list(zip(x.chunk(n), y.chunk(n)))
        for i, (xb, yb) in enumerate(chunks):
            last = i == len(chunks) - 1
            # Forward AND backward inside no_sync(), except for the last micro-batch.
            with contextlib.nullcontext() if last else ddp.no_sync():
                loss = loss_fn(ddp(xb), yb) / len(chunks)
                loss.backward()
        torch.nn.utils.clip_grad_norm_(ddp.parameters(), max_norm=1.0)
        optimizer.step()
        scheduler.step()


def with_gradaccum(model, loss_fn, loader, n, steps):
    """The page's "gradaccum" tab of the DDP section."""
    params = gradaccum.params_of(model)  # the plain module: no wrapper
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=steps)

    def batch_loss(params, batch):
        x, y = batch
        return loss_fn(functional_call(model, params, (x,)), y)

    step = gradaccum.accumulate(
        gradaccum.grad_and_value(batch_loss), n=n, has_aux=True, sync=gradaccum.all_reduce()
    )
    for x, y in loader:  # this rank's batch
        grads, loss = step(params, (x, y))  # the global batch's gradient, on every rank
        grads, norm = gradaccum.boundary.clip_by_global_norm(grads, max_norm=1.0)
        gradaccum.write_grads(model, grads)  # replaces .grad: no zero_grad()
        optimizer.step()
        scheduler.step()


def with_accelerate(model, loss_fn, loader, n, steps):
    """The page's "Accelerate" tab (only with --accelerate)."""
    from accelerate import Accelerator

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=steps)
    accelerator = Accelerator(gradient_accumulation_steps=n)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)

    for x, y in loader:  # one micro-batch per iteration
        with accelerator.accumulate(model):
            loss = loss_fn(model(x), y)
            accelerator.backward(loss)  # divides the loss by n
            optimizer.step()  # does nothing until the window is complete
            scheduler.step()
            optimizer.zero_grad()


def streaming(model, loss_fn, dataset, n, steps, rank, world, micro_batch_size):
    """The page's "gradaccum" tab of the Accelerate section: Accumulator over a sampler."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=steps)

    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, seed=0)
    loader = DataLoader(dataset, batch_size=micro_batch_size, sampler=sampler)
    params = gradaccum.params_of(model)
    micro_grad = gradaccum.grad(lambda p, x, y: loss_fn(functional_call(model, p, (x,)), y))
    acc = gradaccum.Accumulator(n=n, sync=gradaccum.all_reduce())

    def apply(grads):
        gradaccum.write_grads(model, grads)
        optimizer.step()
        scheduler.step()  # once per window

    state = acc.init(params)
    for x, y in loader:  # one micro-batch per iteration, the same count on every rank
        state = acc.add(state, micro_grad(params, x, y), size=len(x))
        if acc.is_complete(state):
            grads, state = acc.finalize(state)
            apply(grads)
    if state.micro_step > 0:  # a short last window, on every rank alike
        grads, state = acc.finalize(state)  # weighted by what it holds, not divided by n
        apply(grads)


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 11, width: int = 8) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(vocab, width)
        self.out = nn.Linear(width, vocab)
        self.double()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.embed(tokens).cumsum(1)))


def token_level(model, loader, n):
    """The page's token-level section; returns the first window's gradient."""
    params = gradaccum.params_of(model)
    windows = []

    def apply(grads):
        windows.append(grads)

    PAD = -100

    def summed_loss(params, tokens, labels):
        logits = functional_call(model, params, (tokens,))
        loss = nn.functional.cross_entropy(
            logits.flatten(0, 1), labels.flatten(), ignore_index=PAD, reduction="sum"
        )
        return loss, (labels != PAD).sum()  # the loss to differentiate, and the count

    micro_grad = gradaccum.grad(summed_loss, has_aux=True)
    acc = gradaccum.Accumulator(n=n, reduction="count", sync=gradaccum.all_reduce())

    state = acc.init(params)
    for tokens, labels in loader:
        g, count = micro_grad(params, tokens, labels)
        state = acc.add(state, g, count=count)
        if acc.is_complete(state):
            grads, state = acc.finalize(state)  # sum of gradients / tokens, over all ranks
            apply(grads)
    return windows[0]


def token_batches(world: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A global window of padded sequences: n micro-batches of 2 per rank, random lengths."""
    g = torch.Generator().manual_seed(2)
    rows = world * n * 2
    tokens = torch.randint(0, 11, (rows, 7), generator=g)
    lengths = torch.randint(1, 8, (rows,), generator=g)
    labels = tokens.roll(-1, 1).masked_fill(torch.arange(7) >= lengths[:, None], -100)
    return tokens, labels


def say(line: str) -> None:
    """Print a whole line in one write: the ranks share stdout, and their lines must not mix."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("-n", type=int, default=4, help="micro-batches per window")
    parser.add_argument("--accelerate", action="store_true", help="also run the Accelerate loop")
    args = parser.parse_args(argv)
    rank, world = init()
    torch.set_num_threads(1)
    device, n, steps = torch.device("cpu"), args.n, args.steps
    loss_fn = nn.functional.cross_entropy
    ok = True
    try:
        batches = global_batches(steps, 8 * world)  # 8 rows per rank: n=4 micro-batches of 2
        loader = [(x[rank::world], y[rank::world]) for x, y in batches]  # this rank's share

        models = [make_model(), make_model()]
        ddp_no_sync(models[0], loss_fn, loader, n, steps, device)
        with_gradaccum(models[1], loss_fn, loader, n, steps)
        a, b = (gradaccum.params_of(m) for m in models)
        diff = max((a[k] - b[k]).abs().max().item() for k in a)
        ok &= diff <= TOL
        say(f"rank {rank}: DDP + no_sync vs gradaccum, max parameter difference {diff:.2e}")

        model = make_model()
        dataset = torch.utils.data.TensorDataset(*(torch.cat(t) for t in zip(*batches)))
        streaming(model, loss_fn, dataset, n, steps, rank, world, micro_batch_size=2)
        flat = torch.cat([p.detach().flatten() for p in model.parameters()])
        spread = flat.clone()
        dist.all_reduce(spread, op=dist.ReduceOp.MAX)
        same = bool(torch.equal(spread, flat))
        ok &= same
        say(
            f"rank {rank}: Accumulator over a DistributedSampler, equal params on all ranks: {same}"
        )

        lm = TinyLM()
        tokens, labels = token_batches(world, n)
        mine = [
            (t, lab) for t, lab in zip(tokens[rank::world].split(2), labels[rank::world].split(2))
        ]
        grads = token_level(lm, mine, n)

        def token_mean(params):
            logits = functional_call(lm, params, (tokens,))
            return nn.functional.cross_entropy(
                logits.flatten(0, 1), labels.flatten(), ignore_index=-100
            )

        expected = torch.func.grad(token_mean)(gradaccum.params_of(lm))
        diff = max((grads[k] - expected[k]).abs().max().item() for k in grads)
        ok &= diff <= TOL
        say(f"rank {rank}: token-level window vs the global token mean, max difference {diff:.2e}")

        if args.accelerate:
            with_accelerate(make_model(), loss_fn, loader, n, steps)
            say(f"rank {rank}: the Accelerate loop ran")
    finally:
        dist.destroy_process_group()
    say(f"rank {rank}: {'OK' if ok else 'FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
