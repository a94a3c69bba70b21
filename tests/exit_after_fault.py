"""A user's training script that meets a stalled peer, catches the error and exits normally.

``tests/test_faults.py`` runs it as a user would, ``python exit_after_fault.py FORM`` on each of
2 ranks, with the environment torchrun sets (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT``), and checks that each rank exits with code 0.

Rank 1 stalls (sleeps ``STALL`` seconds, longer than the sync's timeout ``T``) in window 1, so
rank 0's boundary collective times out. FORM says where, and with which API:

- ``loop``: ``gradaccum.loop`` (``windows`` and ``Step``); rank 1 stalls in its data loader,
  before the window's boundary, so rank 0's fingerprint exchange times out;
- ``accumulate``: ``gradaccum.accumulate`` with one bucket per leaf, overlapped with the
  backward; rank 1 stalls inside its last backward of the window, after it sent its first
  buckets, so rank 0 is left with several bucket all-reduces started and one timed out.

Each rank catches ``GradAccumError``, destroys the process group as docs/reliability.md says,
and returns: the interpreter finalizes and exits by itself (no ``os._exit``). The state lives
in module globals, as in a script written top to bottom, so the sync (and through it the
process group) lives until the interpreter finalizes: a gloo worker thread still inside an
abandoned collective then aborted the process ("terminate called without an active exception"),
in 8 of 10 runs before gradaccum drained such collectives.

Each rank prints one line ``RESULT rank=R outcome=O window=W message=M`` for the test.
"""

from __future__ import annotations

import datetime
import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

import gradaccum
from gradaccum import loop

T = float(os.environ.get("T", "1"))  # the sync's timeout, in seconds
STALL = float(os.environ.get("STALL", "3"))  # how long rank 1 sleeps in window 1
N = 4  # micro-batches per window
WINDOWS = 3
KEPT: dict[str, object] = {}  # what a script written top to bottom keeps alive to its end
PROGRESS = {"window": -1}  # the window each rank was in when it stopped


def batches(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(rank)
    f64 = torch.float64
    return [
        (torch.randn(3, 5, generator=g, dtype=f64), torch.randn(3, 1, generator=g, dtype=f64))
        for _ in range(N * WINDOWS)
    ]


class Loader:
    """A data loader over this rank's micro-batches; rank 1's stalls in window 1."""

    def __init__(self, rank: int) -> None:
        self.rank, self.data = rank, batches(rank)

    def __iter__(self):  # type: ignore[no-untyped-def]
        for i, batch in enumerate(self.data):
            if self.rank == 1 and i == N + 1:
                time.sleep(STALL)
            yield batch

    def __len__(self) -> int:
        return len(self.data)


def run_loop(rank: int) -> None:
    """``gradaccum.loop``: ``windows`` and ``Step``, as docs/loop.md writes them."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 1)).double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    sync = gradaccum.all_reduce(timeout=T)
    data = loop.windows(Loader(rank), N, sync=sync)
    step = loop.Step(model, mse, optimizer=optimizer, sync=sync)
    KEPT.update(model=model, data=data, step=step)
    for window in data:
        PROGRESS["window"] = window.index
        for batch in window:
            step.add(batch)
        step.apply()


def mse(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


def run_accumulate(rank: int) -> None:
    """``gradaccum.accumulate`` with a bucket per leaf, overlapped with the backward."""
    torch.manual_seed(0)
    params = {f"w{i}": torch.randn(5, dtype=torch.float64) for i in range(6)}
    calls = [0]

    def stall(g: torch.Tensor) -> torch.Tensor:
        time.sleep(STALL)
        return g

    def loss(p: dict[str, torch.Tensor], batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        calls[0] += 1
        x, y = batch
        w0 = p["w0"]
        if rank == 1 and calls[0] == 2 * N:  # the last backward of window 1
            w0 = w0 * 1.0
            w0.register_hook(stall)  # w0's gradient comes last: the other buckets are sent
        pred = sum(torch.tanh(x @ p[k]) for k in sorted(p) if k != "w0") + x @ w0
        return ((pred - y.squeeze(1)) ** 2).mean()

    # The group named, as a job with several groups does: the sync holds it (to the exit here).
    sync = gradaccum.all_reduce(group=dist.group.WORLD, timeout=T, bucket_mb=1e-6)
    step = gradaccum.accumulate(gradaccum.grad(loss), N, sync=sync)
    KEPT.update(params=params, step=step)
    data = batches(rank)
    for w in range(WINDOWS):
        PROGRESS["window"] = w
        x = torch.cat([b[0] for b in data[w * N : (w + 1) * N]])
        y = torch.cat([b[1] for b in data[w * N : (w + 1) * N]])
        step(params, (x, y))


def report(rank: int, outcome: str, message: str = "") -> None:
    """The line the test reads: how this rank ended, in which window."""
    first = message.splitlines()[0] if message else ""
    print(
        f"RESULT rank={rank} outcome={outcome} window={PROGRESS['window']} message={first}",
        flush=True,
    )


if __name__ == "__main__":
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    rank = dist.get_rank()
    train = run_loop if sys.argv[1] == "loop" else run_accumulate
    try:
        train(rank)
        report(rank, "returned")
    except gradaccum.GradAccumError as err:  # a peer died or stalled: this run is over
        report(rank, "GradAccumError", str(err))  # log it; restart from a checkpoint later
    finally:
        try:
            dist.destroy_process_group()
        except Exception:  # a broken group may refuse
            pass
