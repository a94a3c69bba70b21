"""Quickstart: gradient accumulation gives the same training run as the whole batch.

Two copies of one MLP classifier learn three interleaved spirals, side by side, on the same
batches with the same optimizer and learning-rate schedule:

- run A computes each batch's gradient with ``gradaccum.accumulate`` over ``--n`` micro-batches;
- run B computes it on the whole batch in one step.

Both write the gradient into ``.grad`` with ``gradaccum.write_grads`` and step a ``torch.optim``
optimizer and its scheduler once per batch (once per accumulation boundary). Because the
accumulated gradient equals the whole-batch gradient, the two runs stay together: the script
ends by printing the largest parameter difference between them, and exits with status 1 if it
exceeds the tolerance (1e-9 in float64, 1e-4 in float32).

Run it (under 10 s on 2 CPU cores)::

    python examples/quickstart.py
    python examples/quickstart.py --n 4 --batch-size 100 --dtype float32 --steps 500
    python examples/quickstart.py --plot loss.png   # the two loss curves (needs matplotlib)
"""

from __future__ import annotations

import argparse
import copy
import math
import sys
import time

import torch
from _plot import loss_curves
from torch import nn
from torch.func import functional_call, grad_and_value
from tqdm import tqdm

import gradaccum

DTYPES = {"float64": torch.float64, "float32": torch.float32}
TOLERANCES = {torch.float64: 1e-9, torch.float32: 1e-4}
TRAIN_POINTS = 3000


def make_spirals(
    points: int, classes: int, generator: torch.Generator, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """``classes`` interleaved noisy spiral arms in 2-D: inputs ``(points, 2)``, labels."""
    y = torch.arange(points) % classes
    r = torch.rand(points, generator=generator, dtype=torch.float64)
    theta = 4.0 * r + y * (2 * math.pi / classes)
    theta = theta + 0.2 * torch.randn(points, generator=generator, dtype=torch.float64)
    x = torch.stack([r * torch.cos(theta), r * torch.sin(theta)], dim=1)
    return x.to(dtype), y


def make_mlp(classes: int) -> nn.Module:
    return nn.Sequential(
        nn.Linear(2, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, classes)
    )


def batches(points: int, batch_size: int, generator: torch.Generator):
    """Row indices of shuffled batches, epoch after epoch (the last short batch is dropped)."""
    while True:
        order = torch.randperm(points, generator=generator)
        for start in range(0, points - batch_size + 1, batch_size):
            yield order[start : start + batch_size]


def make_optimizer(model: nn.Module, steps: int):
    optimizer = torch.optim.SGD(
        model.parameters(), lr=0.2, momentum=0.9, nesterov=True, weight_decay=1e-4
    )
    # Linear warm-up over the first 5% of the steps, then cosine decay to zero.
    warmup = max(1, steps // 20)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))

    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def optimizer_step(model, params, step_fn, batch, optimizer, scheduler) -> float:
    """One optimizer step on one batch; returns the batch's mean loss."""
    grads, loss = step_fn(params, batch)
    gradaccum.write_grads(model, grads)  # replaces .grad, no zero_grad() needed
    optimizer.step()
    scheduler.step()  # once per optimizer step, i.e. once per accumulation boundary
    return loss.item()


@torch.no_grad()
def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    return (model(x).argmax(dim=1) == y).double().mean().item()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps (default 300)")
    parser.add_argument("--n", type=int, default=8, help="micro-batches per batch (default 8)")
    parser.add_argument("--batch-size", type=int, default=256, help="rows per batch")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float64")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plot", metavar="PATH", help="write both runs' loss curves (PNG)")
    args = parser.parse_args(argv)
    if args.steps < 1 or not 1 <= args.batch_size <= TRAIN_POINTS:
        parser.error(f"need --steps >= 1 and 1 <= --batch-size <= {TRAIN_POINTS}")
    dtype = DTYPES[args.dtype]
    # The model is tiny: one intra-op thread is the fastest, also on a busy machine.
    torch.set_num_threads(1)

    gen = torch.Generator().manual_seed(args.seed)
    classes = 3
    x_train, y_train = make_spirals(TRAIN_POINTS, classes, gen, dtype)
    x_test, y_test = make_spirals(1000, classes, gen, dtype)

    torch.manual_seed(args.seed)
    model_a = make_mlp(classes).to(dtype)
    model_b = copy.deepcopy(model_a)  # the same initial weights
    opt_a, sched_a = make_optimizer(model_a, args.steps)
    opt_b, sched_b = make_optimizer(model_b, args.steps)

    def make_loss(model: nn.Module):
        def loss_fn(params: dict[str, torch.Tensor], batch) -> torch.Tensor:
            x, y = batch
            logits = functional_call(model, params, (x,))
            return nn.functional.cross_entropy(logits, y)

        return loss_fn

    # Run A: the whole-batch gradient, computed over n micro-batches. grad_and_value returns
    # (grads, loss); with has_aux=True the loss is combined too, into the whole-batch mean loss.
    step_a = gradaccum.accumulate(grad_and_value(make_loss(model_a)), args.n, has_aux=True)
    # Run B: the reference, one step on the whole batch.
    step_b = grad_and_value(make_loss(model_b))
    # Detached views of the module's parameters: optimizer.step() updates them in place.
    params_a, params_b = gradaccum.params_of(model_a), gradaccum.params_of(model_b)

    print(
        f"{args.steps} steps, batch {args.batch_size} = {args.n} micro-batches of about "
        f"{args.batch_size / args.n:g} rows, {args.dtype}"
    )
    started = time.perf_counter()
    progress = tqdm(
        zip(range(args.steps), batches(len(x_train), args.batch_size, gen)),
        total=args.steps,
        unit="step",
    )
    losses_a, losses_b = [], []
    for step, idx in progress:
        batch = (x_train[idx], y_train[idx])
        loss_a = optimizer_step(model_a, params_a, step_a, batch, opt_a, sched_a)
        loss_b = optimizer_step(model_b, params_b, step_b, batch, opt_b, sched_b)
        losses_a.append(loss_a)
        losses_b.append(loss_b)
        if step % 10 == 0 or step == args.steps - 1:
            progress.set_postfix(loss_accumulated=f"{loss_a:.4f}", loss_whole=f"{loss_b:.4f}")
    progress.close()
    elapsed = time.perf_counter() - started

    print(f"final loss      accumulated (n={args.n}) {loss_a:.6f}   whole batch {loss_b:.6f}")
    print(
        f"test accuracy   accumulated (n={args.n}) {accuracy(model_a, x_test, y_test):.2%}   "
        f"whole batch {accuracy(model_b, x_test, y_test):.2%}"
    )
    max_diff = max((params_a[k] - params_b[k]).abs().max().item() for k in sorted(params_a))
    tol = TOLERANCES[dtype]
    verdict = "OK" if max_diff <= tol else "FAILED"
    print(f"trained in {elapsed:.1f} s")
    print(f"max parameter difference: {max_diff:.3e} (tolerance {tol:g}) {verdict}")
    if args.plot:
        curves = {"whole batch": losses_b, f"accumulated, n={args.n}": losses_a}
        title = f"quickstart: batch {args.batch_size}, {args.dtype}, seed {args.seed}"
        print(f"wrote {loss_curves(args.plot, curves, title=title)}")
    return 0 if max_diff <= tol else 1


if __name__ == "__main__":
    sys.exit(main())
