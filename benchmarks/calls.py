"""Python function calls per accumulated step, counted by cProfile: the overhead noise cannot move.

    python benchmarks/calls.py                 # n = 1 and 4, 200 steps each
    python benchmarks/calls.py --ns 1 4 16 --steps 50

One process: ``accumulate(gradaccum.grad_and_value(loss), n, has_aux=True)`` (the loss as aux)
on a small MLP written in plain torch ops (3 layers, 8 rows per micro-batch, no
``functional_call``, whose own calls would hide the library's), the step the fast path runs. The
count is cProfile's total of Python-level calls (primitive and recursive, builtins included)
over ``--steps`` steps after two warm-up steps, divided by the steps. It does not depend on the
machine's speed or load, so it is the number to compare before and after a change to the hot
path (``benchmarks/suite.py`` gives the times, against DDP in the same run).

A second table counts the same over ``sync=all_reduce()`` on a one-process gloo group (the
boundary's collectives and the fingerprint included).
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats

import _launch
import torch
import torch.distributed as dist

import gradaccum


def model_and_loss() -> tuple[dict[str, torch.Tensor], object]:
    torch.manual_seed(0)
    sizes = [(16, 32), (32, 32), (32, 1)]
    params = {}
    for i, (a, b) in enumerate(sizes):
        params[f"w{i}"] = torch.randn(a, b) / a**0.5
        params[f"b{i}"] = torch.zeros(b)

    def loss(p: dict[str, torch.Tensor], batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        h = torch.tanh(x @ p["w0"] + p["b0"])
        h = torch.tanh(h @ p["w1"] + p["b1"])
        out = (h @ p["w2"] + p["b2"]).squeeze(-1)
        return ((out - y) ** 2).mean()

    return params, loss


def calls_per_step(n: int, steps: int, sync: object) -> float:
    params, loss = model_and_loss()
    step = gradaccum.accumulate(gradaccum.grad_and_value(loss), n, has_aux=True, sync=sync)
    batch = (torch.randn(8 * n, 16), torch.randn(8 * n))
    for _ in range(2):
        step(params, batch)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        step(params, batch)
    prof.disable()
    return pstats.Stats(prof).total_calls / steps  # type: ignore[attr-defined]


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--ns", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--steps", type=int, default=200)
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"Python calls per step (cProfile, {args.steps} steps, one process)")
    print(f"{'n':>4}  {'sync=None':>10}  {'all_reduce()':>12}")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_launch.free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        for n in args.ns:
            local = calls_per_step(n, args.steps, None)
            synced = calls_per_step(n, args.steps, gradaccum.all_reduce())
            print(f"{n:>4}  {local:>10.0f}  {synced:>12.0f}")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
