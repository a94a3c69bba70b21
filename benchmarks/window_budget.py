"""The per-window Python budget of the all-reduce fast path: what each fixed part of a window costs.

Usage::

    python benchmarks/window_budget.py            # the suite's LM (42 leaves), about 1 minute
    python benchmarks/window_budget.py --model mlp
    python benchmarks/window_budget.py --quick    # a tiny model, a few seconds (a smoke test)

Each part of a window that does not grow with the model's compute is timed on its own with
``timeit`` (the minimum of 7 repeats: these parts are pure Python and small tensors, so the
minimum is their cost without the machine's noise), in one gloo process (a group of one on a
``HashStore``: the collective is a real gloo call, without a peer's latency). The parts are then
set against one forward and backward of a micro-batch of the same model through
``functional_call`` (the median of repeated calls). The sum says how
much of a step the per-window work can explain; ``docs/benchmarks.md`` ("The noise floor") reads
it against the suite's ratios.

Then the whole call, on a model of as many leaves whose compute is nothing (a stack of 8x8
``Linear`` layers, 8 rows per micro-batch), so that what is left is Python: the hand-written loop
calling the module, the same loop through ``torch.func.functional_call`` (what a functional loss
function runs), and ``accumulate(gradaccum.grad_and_value(loss_fn), n)`` with ``write_grads``,
interleaved, the median of the thread's CPU time (``time.thread_time``: other processes on the
machine do not count).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
import timeit
from collections.abc import Callable
from typing import Any

import _bench_models as bm
import torch
import torch.distributed as dist
from torch.func import functional_call

import gradaccum
from gradaccum.sync import WindowSpec


def _min_us(f: Callable[[], Any], number: int) -> float:
    f()
    return min(timeit.repeat(f, number=number, repeat=7)) / number * 1e6


def budget(model: str, quick: bool, number: int) -> tuple[list[tuple[str, float]], float, int]:
    """``[(part, microseconds)]`` of one window, the median ms of a forward and backward, and
    the number of leaves."""
    spec = bm.spec(model, quick)
    module = spec.build()
    params = gradaccum.params_of(module)
    gen = torch.Generator().manual_seed(0)
    x, y = spec.make_batch(gen, spec.micro)
    sync = gradaccum.all_reduce()
    parts: list[tuple[str, float]] = []

    def part(name: str, f: Callable[[], Any]) -> None:
        parts.append((name, _min_us(f, number)))

    layout = sync.layout("budget", params, None, 0)
    window_spec = WindowSpec("budget", layout, "mean", 1, False, None, params, fast=True, index=0)
    part("check the layout of the params", lambda: sync.layout("budget", params, None, 0))

    def storage() -> None:
        sync.open(window_spec).storage(False)

    part("open a window and cut its bucket views", storage)
    step_fn = gradaccum.grad_and_value(
        lambda p, batch: spec.loss(functional_call(module, p, (x,)), y)
    )
    args = [params, (x, y)]
    part(
        f"alias {len(params)} leaves (what the fast path runs)",
        lambda: step_fn.alias("budget", args),
    )
    _, leaves, _ = step_fn.alias("budget", args)

    def hooks() -> None:
        handles = [
            leaf.register_post_accumulate_grad_hook(functools.partial(lambda i, t: None, i))
            for i, leaf in enumerate(leaves)
        ]
        for h in handles:
            h.remove()

    part(f"register and remove {len(leaves)} grad hooks", hooks)

    def fingerprint() -> None:
        window = sync.open(window_spec)  # the Comm holds its window weakly
        comm = window.connect(None, None, "budget")
        comm.agree(comm.probe(("budget",) * 45, torch.device("cpu")))

    part("agree on the layout's fingerprint (one gloo all-reduce)", fingerprint)
    grads = {k: v.clone() for k, v in params.items()}
    part("write_grads(model, grads)", lambda: gradaccum.write_grads(module, grads))

    def micro_batch() -> None:
        for p in module.parameters():
            p.grad = None
        spec.loss(functional_call(module, dict(module.named_parameters()), (x,)), y).backward()

    micro_batch()
    times = []
    for _ in range(5 if quick else 21):
        t0 = time.perf_counter()
        micro_batch()
        times.append(time.perf_counter() - t0)
    return parts, statistics.median(times) * 1e3, len(params)


def python_cost(leaves: int, ns: list[int], rounds: int) -> dict[int, dict[str, float]]:
    """Milliseconds per call of the three loops on a ``leaves``-leaf model that computes nothing."""
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(leaves // 2)])
    plist = list(model.parameters())
    params = gradaccum.params_of(model)

    def loss_fn(p: dict[str, torch.Tensor], batch: tuple[torch.Tensor, torch.Tensor]) -> Any:
        return (functional_call(model, p, (batch[0],)) - batch[1]).pow(2).mean()

    out = {}
    for n in ns:
        x, y = torch.randn(8 * n, 8), torch.randn(8 * n, 8)
        accumulated = gradaccum.accumulate(gradaccum.grad_and_value(loss_fn), n)

        def hand(n: int = n, x: torch.Tensor = x, y: torch.Tensor = y) -> None:
            for p in plist:
                p.grad = None
            for xb, yb in zip(x.chunk(n), y.chunk(n), strict=True):
                ((model(xb) - yb).pow(2).mean() / n).backward()

        def hand_fc(n: int = n, x: torch.Tensor = x, y: torch.Tensor = y) -> None:
            for p in plist:
                p.grad = None
            for xb, yb in zip(x.chunk(n), y.chunk(n), strict=True):
                (loss_fn(dict(model.named_parameters()), (xb, yb)) / n).backward()

        def ours(x: torch.Tensor = x, y: torch.Tensor = y, f: Any = accumulated) -> None:
            for p in plist:
                p.grad = None
            grads, _ = f(params, (x, y))
            gradaccum.write_grads(model, grads)

        loops = {"module call": hand, "functional_call": hand_fc, "gradaccum": ours}
        times: dict[str, list[float]] = {k: [] for k in loops}
        for f in loops.values():
            f()
        for _ in range(rounds):
            for k, f in loops.items():
                t0 = time.thread_time()
                f()
                times[k].append(time.thread_time() - t0)
        out[n] = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=("lm", "mlp"), default="lm")
    ap.add_argument("--quick", action="store_true", help="a tiny model, few repeats")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        parts, step_ms, leaves = budget(args.model, args.quick, 20 if args.quick else 200)
        python = python_cost(leaves, [1, 4], 20 if args.quick else 300)
    finally:
        dist.destroy_process_group()
    total = sum(us for _, us in parts)
    print(f"{args.model}: per-window parts, min of 7 timeit repeats (torch {torch.__version__})")
    for name, us in parts:
        print(f"  {name:60} {us:8.1f} us")
    print(f"  {'sum':60} {total:8.1f} us")
    print(f"one micro-batch's forward and backward: {step_ms:.2f} ms (median)")
    print(f"the sum as a share of a one-micro-batch step: {total / 1e3 / step_ms:.1%}")
    print(f"whole calls on a {leaves}-leaf model that computes nothing (ms of CPU time, median):")
    print(f"  {'n':>3} {'module call':>12} {'functional_call':>16} {'gradaccum':>10}")
    for n, row in python.items():
        fc_per_micro = (row["functional_call"] - row["module call"]) / n
        print(
            f"  {n:>3} {row['module call']:12.3f} {row['functional_call']:16.3f} "
            f"{row['gradaccum']:10.3f}   gradaccum - functional_call: "
            f"{row['gradaccum'] - row['functional_call']:.3f} ms a call; functional_call: "
            f"{fc_per_micro:.3f} ms a micro-batch"
        )


if __name__ == "__main__":
    main()
