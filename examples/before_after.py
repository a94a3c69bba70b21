"""Before and after: a plain PyTorch accumulation loop, then the same loop with gradaccum.loop.

The README and the docs' home page open with these two loops (their code blocks are fragments
of this file). Both train the same small model from the same DataLoader of micro-batches, with
n = 4 micro-batches per optimizer step. This script runs both, and a reference that takes one
backward over each whole window's rows, in float64, and checks:

- with 96 rows (12 micro-batches of 8 rows: 3 whole windows), the plain loop and
  gradaccum.loop end with the same parameters (at most 1e-12 apart), the reference's too;
- with ``--rows 84`` (the first 84 rows: 11 micro-batches, the last of 4 rows, so the last
  window holds 3 micro-batches), gradaccum.loop still ends with the reference's parameters,
  and the plain loop does not: it never steps the last window, and would weight its 4-row
  micro-batch as much as the others.

It exits with status 1 if a check fails. Run it (a second on a CPU)::

    python examples/before_after.py
    python examples/before_after.py --rows 84
"""

from __future__ import annotations

import argparse
import sys

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from gradaccum import loop

TOLERANCE = 1e-12


def setup(rows: int):
    """The model, optimizer, DataLoader and n of every version, from the same seed."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 32), nn.Tanh(), nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    dataset = TensorDataset(torch.randn(96, 10), torch.randn(96, 1))
    if rows < 96:  # --rows: the first rows only
        dataset = torch.utils.data.Subset(dataset, range(rows))
    loader = DataLoader(dataset, batch_size=8)  # micro-batches of 8 rows
    n = 4  # micro-batches per optimizer step
    return model, optimizer, loader, n


def plain(model, optimizer, loader, n):
    """Before: the usual accumulation loop, ``loss / n`` and ``backward()`` per micro-batch."""
    for i, (x, y) in enumerate(loader):
        loss = nn.functional.mse_loss(model(x), y)
        (loss / n).backward()
        if (i + 1) % n == 0:
            optimizer.step()
            optimizer.zero_grad()


def loss_fn(model, batch):
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


def with_gradaccum(model, optimizer, loader, n):
    """After: the same loop with gradaccum.loop."""
    data = loop.windows(loader, n)  # windows of n micro-batches
    step = loop.Step(model, loss_fn, optimizer, data=data)
    for window in data:
        for batch in window:
            step.add(batch)  # forward and backward of one micro-batch
        step.apply()  # one optimizer step per window


def whole_windows(model, optimizer, loader, n):
    """The reference: one backward over all the rows of each window, then one step."""
    batches = list(loader)
    for start in range(0, len(batches), n):
        x, y = (torch.cat(part) for part in zip(*batches[start : start + n]))
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()


def train(version, rows: int) -> list[torch.Tensor]:
    model, optimizer, loader, n = setup(rows)
    version(model, optimizer, loader, n)
    return [p.detach().clone() for p in model.parameters()]


def difference(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((p - q).abs().max().item() for p, q in zip(a, b))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=96, help="train on the first rows (1 to 96)")
    args = parser.parse_args(argv)
    if not 1 <= args.rows <= 96:
        parser.error(f"--rows {args.rows}: expected 1 to 96, the rows of the dataset")
    torch.set_default_dtype(torch.float64)  # a tight check; the loops are the same in float32
    micro = -(-args.rows // 8)
    windows = -(-micro // 4)
    print(f"{args.rows} rows: {micro} micro-batches of up to 8 rows, n = 4: {windows} windows")
    reference = train(whole_windows, args.rows)
    before, after = train(plain, args.rows), train(with_gradaccum, args.rows)
    exact = difference(after, reference) <= TOLERANCE
    print(
        f"gradaccum.loop vs one backward per whole window: {difference(after, reference):.3e} "
        f"(tolerance {TOLERANCE:g}) {'OK' if exact else 'FAILED'}"
    )
    same = difference(before, after) <= TOLERANCE
    print(f"plain loop vs gradaccum.loop: {difference(before, after):.3e} (same: {same})")
    # The plain loop is right exactly when the micro-batches fill whole windows of equal rows.
    expected = args.rows % (8 * 4) == 0
    ok = exact and same == expected
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
