"""Streaming accumulation: a DataLoader of micro-batches, a window schedule, a mid-window resume.

``gradaccum.Accumulator`` is the form of gradient accumulation for loops that receive one
micro-batch at a time. This script shows, on generated data:

1. A training loop over a ``DataLoader`` that yields micro-batches (the epoch ends with a short
   micro-batch and a short window, which ``finalize`` weights exactly), with a schedule of the
   window size: 2 micro-batches per optimizer step at first, then 4, then 8. The optimizer and
   the LR scheduler step once per window.
2. A checkpoint taken in the middle of a window: the accumulator state (``acc.state_dict``), the
   model, the optimizer and the scheduler go through ``torch.save`` and
   ``torch.load(..., weights_only=True)`` into a fresh model, optimizer and accumulator state;
   training goes on, and the final parameters are compared with an uninterrupted run. They
   must be bit-identical (``torch.equal``); the script exits with status 1 if they are not.
3. BatchNorm: running statistics thread through the micro-batches with
   ``gradaccum.call_module`` (inside the loss) and ``gradaccum.update_buffers`` (after each
   micro-batch, outside the gradient transform).

Run it (a few seconds on 2 CPU cores)::

    python examples/streaming.py
    python examples/streaming.py --epochs 3 --micro-batch-size 10 --seed 1
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys
import tempfile
from pathlib import Path

import torch
from torch import nn
from torch.func import functional_call, grad_and_value
from torch.utils.data import DataLoader, TensorDataset

import gradaccum


def schedule(window: int) -> int:
    """Micro-batches per optimizer step: 2 for windows 0-3, 4 for windows 4-7, then 8."""
    return min(8, 2 ** (1 + window // 4))


def make_data(points: int, seed: int) -> TensorDataset:
    """Four Gaussian blobs in 8 dimensions."""
    gen = torch.Generator().manual_seed(seed)
    centres = 2.0 * torch.randn(4, 8, generator=gen)
    y = torch.randint(0, 4, (points,), generator=gen)
    x = centres[y] + torch.randn(points, 8, generator=gen)
    return TensorDataset(x, y)


def make_model(seed: int, *, batch_norm: bool = False) -> nn.Module:
    torch.manual_seed(seed)
    norm = [nn.BatchNorm1d(32)] if batch_norm else []
    return nn.Sequential(nn.Linear(8, 32), *norm, nn.ReLU(), nn.Linear(32, 4))


def make_optimizer(model: nn.Module):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.97**step)
    return optimizer, scheduler


def micro_batches(data: TensorDataset, size: int, seed: int, epoch: int) -> DataLoader:
    """The epoch's micro-batches, shuffled reproducibly (so a resumed run sees the same ones)."""
    gen = torch.Generator().manual_seed(seed * 1000 + epoch)
    return DataLoader(data, batch_size=size, shuffle=True, drop_last=False, generator=gen)


def train(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    acc: gradaccum.Accumulator,
    state: gradaccum.streaming.AccumState,
    args: argparse.Namespace,
    *,
    start: tuple[int, int] = (0, 0),
    stop: tuple[int, int] | None = None,
    log: bool = False,
) -> tuple[gradaccum.streaming.AccumState, tuple[int, int] | None]:
    """Train from micro-batch ``start = (epoch, index)``, until ``stop`` or the last epoch.

    Returns the accumulator state and where it stopped (``None`` when it ran to the end).
    """
    data = make_data(args.points, args.seed)
    params = gradaccum.params_of(model)

    def loss_fn(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor):
        return nn.functional.cross_entropy(functional_call(model, params, (x,)), y)

    grad_fn = grad_and_value(loss_fn)
    windows: list[int] = []  # micro-batches per window finalized, in this epoch

    def boundary(state: gradaccum.streaming.AccumState) -> gradaccum.streaming.AccumState:
        windows.append(state.micro_step)
        grads, state = acc.finalize(state)
        gradaccum.write_grads(model, grads)
        optimizer.step()
        scheduler.step()
        return state

    for epoch in range(start[0], args.epochs):
        skip = start[1] if epoch == start[0] else 0
        loader = micro_batches(data, args.micro_batch_size, args.seed, epoch)
        windows.clear()
        losses = []
        for i, (x, y) in enumerate(itertools.islice(loader, skip, None), start=skip):
            if (epoch, i) == stop:
                return state, stop
            grads, loss = grad_fn(params, x, y)
            losses.append(loss.item())
            state = acc.add(state, grads, size=len(x))  # weighted by rows: exact when ragged
            if acc.is_complete(state):
                state = boundary(state)
        if state.micro_step > 0:  # the epoch ends with a short window
            state = boundary(state)
        if log:
            print(
                f"  epoch {epoch}: {len(losses)} micro-batches (the last {len(x)} rows), "
                f"{len(windows)} optimizer steps on windows of {windows} micro-batches, "
                f"mean loss {sum(losses) / len(losses):.4f}"
            )
    return state, None


def resume_demo(args: argparse.Namespace) -> bool:
    print("1. DataLoader of micro-batches, window schedule 2 -> 4 -> 8, uninterrupted run")
    acc = gradaccum.Accumulator(n=schedule)
    model = make_model(args.seed)
    optimizer, scheduler = make_optimizer(model)
    state = acc.init(gradaccum.params_of(model))
    state, _ = train(model, optimizer, scheduler, acc, state, args, log=True)
    print(f"  {state.window} optimizer steps, lr now {scheduler.get_last_lr()[0]:.2e}")
    reference = {k: v.clone() for k, v in model.state_dict().items()}

    print("2. the same run, interrupted mid-window, saved, reloaded and resumed")
    model = make_model(args.seed)
    optimizer, scheduler = make_optimizer(model)
    state = acc.init(gradaccum.params_of(model))
    stop = (args.epochs - 1, 5)  # in the middle of a window of the last epoch
    state, where = train(model, optimizer, scheduler, acc, state, args, stop=stop)
    assert where == stop
    assert state.micro_step > 0, "the checkpoint should fall in the middle of a window"
    print(
        f"  stopped at epoch {where[0]} micro-batch {where[1]}: window {state.window} holds "
        f"{state.micro_step} of {acc.window_size(state)} micro-batches"
    )
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "checkpoint.pt"
        torch.save(
            {
                "model": model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
                "accumulator": acc.state_dict(state),
                "position": list(where),
            },
            path,
        )
        del model, optimizer, scheduler, state
        checkpoint = torch.load(path, weights_only=True)

    # Everything fresh: another initialisation, a new Accumulator (same schedule) and state.
    model = make_model(args.seed + 1)
    model.load_state_dict(checkpoint["model"])
    optimizer, scheduler = make_optimizer(model)
    optimizer.load_state_dict(checkpoint["optimizer"])
    scheduler.load_state_dict(checkpoint["scheduler"])
    acc = gradaccum.Accumulator(n=schedule)
    params = gradaccum.params_of(model)
    state = acc.load_state_dict(acc.init(params), checkpoint["accumulator"])
    print(
        f"  resumed: window {state.window} holds {state.micro_step} of "
        f"{acc.window_size(state)} micro-batches"
    )
    start = (checkpoint["position"][0], checkpoint["position"][1])
    state, _ = train(model, optimizer, scheduler, acc, state, args, start=start)

    resumed = model.state_dict()
    same = all(torch.equal(reference[k], resumed[k]) for k in reference)
    max_diff = max((reference[k] - resumed[k]).abs().max().item() for k in reference)
    print(
        f"  resumed parameters bit-identical to the uninterrupted run: {same} "
        f"(max difference {max_diff:.1e})"
    )
    return same


def batch_norm_demo(args: argparse.Namespace) -> bool:
    print("3. BatchNorm: running statistics threaded through the micro-batches")
    data = make_data(args.points, args.seed)
    model = make_model(args.seed, batch_norm=True)
    optimizer, scheduler = make_optimizer(model)
    acc = gradaccum.Accumulator(n=4)
    params, buffers = gradaccum.params_of(model), gradaccum.buffers_of(model)

    def loss_fn(params, buffers, x, y):
        # call_module returns the updated buffers instead of mutating them (torch.func refuses
        # mutation inside grad); they travel out as aux.
        logits, new_buffers = gradaccum.call_module(model, params, buffers, x)
        return nn.functional.cross_entropy(logits, y), new_buffers

    grad_fn = grad_and_value(loss_fn, has_aux=True)
    state, seen = acc.init(params), 0
    for epoch in range(args.epochs):
        for x, y in micro_batches(data, args.micro_batch_size, args.seed, epoch):
            grads, (loss, new_buffers) = grad_fn(params, buffers, x, y)
            gradaccum.update_buffers(buffers, new_buffers)  # outside the transform, in order
            seen += 1
            state = acc.add(state, grads, size=len(x))
            if acc.is_complete(state):
                grads, state = acc.finalize(state)
                gradaccum.write_grads(model, grads)
                optimizer.step()
                scheduler.step()
        if state.micro_step > 0:
            grads, state = acc.finalize(state)
            gradaccum.write_grads(model, grads)
            optimizer.step()
            scheduler.step()

    tracked = int(model[1].num_batches_tracked)
    model.eval()  # predicts with the running statistics
    x, y = data.tensors
    with torch.no_grad():
        accuracy = (model(x).argmax(dim=1) == y).double().mean().item()
    print(
        f"  {seen} micro-batches, {state.window} optimizer steps; BatchNorm "
        f"num_batches_tracked = {tracked}; eval accuracy (running statistics) {accuracy:.1%}"
    )
    ok = tracked == seen
    print(f"  num_batches_tracked == micro-batches seen: {ok}")
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--points", type=int, default=1000, help="rows in the data set")
    parser.add_argument("--micro-batch-size", type=int, default=24)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.epochs < 1 or args.micro_batch_size < 2:
        parser.error("need --epochs >= 1 and --micro-batch-size >= 2")
    if math.ceil(args.points / args.micro_batch_size) <= 5:
        parser.error("--points / --micro-batch-size must give more than 5 micro-batches")
    if args.points % args.micro_batch_size == 1:
        parser.error("the last micro-batch would have 1 row, too few for BatchNorm in training")

    # The models are tiny: one intra-op thread is the fastest, also on a busy machine.
    torch.set_num_threads(1)

    ok = resume_demo(args)
    ok = batch_norm_demo(args) and ok
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
