"""Per-call overhead of two versions of gradaccum, side by side in one process.

The step-time ratios of ``suite.py`` move by 5-20% between runs on a small shared machine, which
hides a change of a few per cent in gradaccum's own per-call work. Here both versions are
imported into the same process (copied under two package names: gradaccum's imports are
relative) and timed interleaved, round by round, on a model so small that Python is most of the
step: every round sees the same machine state for both.

    git archive 003e58f | tar -x -C /tmp/before
    python benchmarks/ab_overhead.py /tmp/before/gradaccum gradaccum

Prints, for each step kind and n, the median microseconds per call of each version and their
ratio (below 1.00: the second version is faster). It uses a gloo world of one process, so
``all_reduce()`` runs its whole boundary (fingerprint, buckets, tail) without a peer.
"""

from __future__ import annotations

import argparse
import importlib
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("first", type=Path, help="a gradaccum package directory (e.g. the old one)")
    ap.add_argument("second", type=Path, help="another gradaccum package directory")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--calls", type=int, default=40, help="calls per round and configuration")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp())
    for name, src in (("ga_first", args.first), ("ga_second", args.second)):
        shutil.copytree(src, tmp / name)
    sys.path.insert(0, str(tmp))
    libs = {name: importlib.import_module(name) for name in ("ga_first", "ga_second")}
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(8)])

        def loss_fn(p: Any, b: torch.Tensor) -> torch.Tensor:
            return torch.func.functional_call(model, p, (b,)).pow(2).mean()

        steps: dict[tuple[str, int, str], Any] = {}
        for lib, ga in libs.items():
            params = ga.params_of(model)
            for n in (1, 4):
                for kind, make, sync in (
                    ("gradaccum.grad_and_value, all_reduce()", ga.grad_and_value, ga.all_reduce()),
                    ("gradaccum.grad_and_value, one process", ga.grad_and_value, None),
                    ("torch.func.grad_and_value, one process", torch.func.grad_and_value, None),
                ):
                    step = ga.accumulate(make(loss_fn), n, has_aux=True, sync=sync)
                    x = torch.randn(4 * n, 16)
                    for _ in range(20):  # warm up
                        step(params, x)
                    steps[(kind, n, lib)] = (step, params, x)
        times: dict[tuple[str, int, str], list[float]] = {k: [] for k in steps}
        for _ in range(args.rounds):
            for key, (step, params, x) in steps.items():
                start = time.perf_counter()
                for _ in range(args.calls):
                    step(params, x)
                times[key].append((time.perf_counter() - start) / args.calls * 1e6)
    finally:
        dist.destroy_process_group()
    print(f"first: {args.first}, second: {args.second}; median us per call of {args.rounds} rounds")
    for kind in dict.fromkeys(k[0] for k in steps):
        for n in (1, 4):
            a = statistics.median(times[(kind, n, "ga_first")])
            b = statistics.median(times[(kind, n, "ga_second")])
            print(f"  {kind:42} n={n}: {a:7.0f} {b:7.0f}  second/first {b / a:.3f}")


if __name__ == "__main__":
    main()
