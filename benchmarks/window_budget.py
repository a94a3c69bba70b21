"""The per-window Python budget of the all-reduce fast path: what each fixed part of a window costs.

Usage::

    python benchmarks/window_budget.py            # the suite's LM (42 leaves), about 1 minute
    python benchmarks/window_budget.py --model mlp
    python benchmarks/window_budget.py --quick    # a tiny model, a few seconds (a smoke test)

Each part of a window that does not grow with the model's compute is timed on its own with
``timeit`` (the minimum of 7 repeats: these parts are pure Python and small tensors, so the
minimum is their cost without the machine's noise), in one gloo process (a group of one on a
``HashStore``: the collective is a real gloo call, without a peer's latency). The parts are then
set against one forward and backward of a micro-batch of the same model (its median over
interleaved repeats), which is what ``gradaccum`` and DDP + ``no_sync`` both run. The sum says how
much of a step the per-window work can explain; ``docs/benchmarks.md`` ("The noise floor") reads
it against the suite's ratios.
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


def budget(model: str, quick: bool, number: int) -> tuple[list[tuple[str, float]], float]:
    """``[(part, microseconds)]`` of one window, and the median ms of a forward and backward."""
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
    part(
        f"alias {len(params)} leaves (detach, requires_grad)",
        lambda: [v.detach().requires_grad_() for v in params.values()],
    )
    leaves = [v.detach().requires_grad_() for v in params.values()]

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
    return parts, statistics.median(times) * 1e3


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=("lm", "mlp"), default="lm")
    ap.add_argument("--quick", action="store_true", help="a tiny model, few repeats")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        parts, step_ms = budget(args.model, args.quick, 20 if args.quick else 200)
    finally:
        dist.destroy_process_group()
    total = sum(us for _, us in parts)
    print(f"{args.model}: per-window parts, min of 7 timeit repeats (torch {torch.__version__})")
    for name, us in parts:
        print(f"  {name:60} {us:8.1f} us")
    print(f"  {'sum':60} {total:8.1f} us")
    print(f"one micro-batch's forward and backward: {step_ms:.2f} ms (median)")
    print(f"the sum as a share of a one-micro-batch step: {total / 1e3 / step_ms:.1%}")


if __name__ == "__main__":
    main()
