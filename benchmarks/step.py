"""``loop.Step`` against ``accumulate`` and DDP + ``no_sync``, on 2 gloo processes.

    python benchmarks/step.py                      # mlp, n = 1 4 16, 3 rounds of 20 steps
    python benchmarks/step.py --model lm --ns 1 4 --rounds 5 --steps 30
    python benchmarks/step.py --quick              # tiny model, few steps: a smoke test

Four contenders over the same initial model and batches, each stepping
``torch.optim.SGD(lr=0.01, momentum=0.9)`` once per global batch of ``n`` micro-batches per rank
(the models and data of ``benchmarks/suite.py``):

- ``ddp-no_sync``: torch DDP, ``no_sync()`` except on the last micro-batch (the reference);
- ``ddp-twin``: the same again on its own copy: this run's noise floor;
- ``gradaccum``: ``accumulate(gradaccum.grad_and_value(loss), n, sync=all_reduce())``,
  ``write_grads``, ``optimizer.step()``;
- ``step``: ``gradaccum.loop.Step(model, loss, opt, sync=all_reduce())``: ``add`` per
  micro-batch, ``apply()``; ``step-data``: the same fed by ``gradaccum.loop.windows`` (so
  ``Step`` knows each window's last micro-batch).

All contenders run interleaved in one pair of processes, one optimizer step each per round, the
order rotating every round, after one warm-up step each; a step's time is the slower rank's.
Each ``--rounds`` is a fresh pair of processes. Printed per n: the median over the rounds of the
paired ratio (the median over the steps of the same-round ratio to ``ddp-no_sync``), with the
range over the rounds. The parameters of every contender must match the reference's.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _bench_models as bm  # noqa: E402
import _launch  # noqa: E402
import suite  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import gradaccum  # noqa: E402

NAMES = ("ddp-no_sync", "ddp-twin", "gradaccum", "step", "step-data")
REL_TOL = 1e-4


def _step_strategy(spec: bm.ModelSpec, n: int, feed: list[bm.Batch] | None) -> suite.Strategy:
    """``loop.Step`` over a fresh copy of the model; with ``feed``, fed by ``windows`` over it.

    ``feed``: the global batches the strategy will be stepped with, in order (one epoch of
    windows over their micro-batches, agreed once, as a training run's data is).
    """
    model = spec.build()
    opt = torch.optim.SGD(model.parameters(), lr=suite.LR, momentum=suite.MOMENTUM)
    sync = gradaccum.all_reduce()

    def loss(module: torch.nn.Module, batch: bm.Batch) -> torch.Tensor:
        return spec.loss(module(batch[0]), batch[1])

    if feed is None:
        step = gradaccum.loop.Step(model, loss, opt, sync=sync)

        def run(batch: bm.Batch) -> None:
            for mb in suite._micro(batch, n):
                step.add(mb)
            step.apply()

        return suite.Strategy(model, run)

    micro = [mb for batch in feed for mb in suite._micro(batch, n)]
    windows = gradaccum.loop.windows(micro, n, sync=sync)
    step = gradaccum.loop.Step(model, loss, opt, data=windows)
    it = iter(windows)

    def run_data(_batch: bm.Batch) -> None:  # the next window of the feed holds its micro-batches
        for mb in next(it):
            step.add(mb)
        step.apply()

    return suite.Strategy(model, run_data)


def _make(
    name: str, spec: bm.ModelSpec, n: int, world: int, feed: list[bm.Batch]
) -> suite.Strategy:
    if name == "step":
        return _step_strategy(spec, n, None)
    if name == "step-data":
        return _step_strategy(spec, n, feed)
    return suite.make_strategy(name, spec, n, world)


def _job(rank: int, world: int, job: dict[str, Any]) -> dict[int, Any]:
    spec = bm.spec(job["model"], job["quick"])
    out = {}
    for n in job["ns"]:
        names = list(job["names"])
        batches = suite._batches(spec, n, rank, world, suite.N_BATCHES)
        order = [batches[(s + 1) % suite.N_BATCHES] for s in range(-1, job["steps"])]
        strategies = {name: _make(name, spec, n, world, order) for name in names}
        for name in names:
            strategies[name].step(batches[0])
        times: dict[str, list[float]] = {name: [] for name in names}
        gc.collect()
        gc.disable()
        try:
            for s in range(job["steps"]):
                batch = batches[(s + 1) % suite.N_BATCHES]
                k = s % len(names)
                for name in names[k:] + names[:k]:
                    dist.barrier()
                    t0 = time.perf_counter()
                    strategies[name].step(batch)
                    times[name].append(time.perf_counter() - t0)
                gc.collect()
        finally:
            gc.enable()
        ref = [p.detach() for p in strategies[names[0]].module.parameters()]
        scale = max(float(p.abs().max()) for p in ref)
        diffs = {
            name: max(
                float((a - b.detach()).abs().max())
                for a, b in zip(ref, strategies[name].module.parameters(), strict=True)
            )
            / scale
            for name in names
        }
        out[n] = {"times": times, "diffs": diffs}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="mlp", choices=bm.MODELS)
    parser.add_argument("--ns", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--names", nargs="+", default=list(NAMES), choices=NAMES)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.rounds = 3, 1
    names = args.names if args.names[0] == "ddp-no_sync" else ["ddp-no_sync", *args.names]
    job = {
        "model": args.model,
        "quick": args.quick,
        "ns": args.ns,
        "steps": args.steps,
        "names": names,
        "pg_timeout": 600,
    }
    ratios: dict[str, dict[int, list[float]]] = {name: {n: [] for n in args.ns} for name in names}
    ok = True
    for r in range(args.rounds):
        ranks = _launch.launch(_job, job, 2, timeout=3600, what=f"step benchmark round {r}")
        for n in args.ns:
            steps = {
                name: [max(ts) for ts in zip(*(rk[n]["times"][name] for rk in ranks), strict=True)]
                for name in names
            }
            for name in names:
                pairs = zip(steps[name], steps[names[0]], strict=True)
                ratios[name][n].append(statistics.median(t / b for t, b in pairs))
                diff = max(rk[n]["diffs"][name] for rk in ranks)
                if diff > REL_TOL:
                    print(f"round {r} n={n} {name}: parameters differ by {diff:.2e} (relative)")
                    ok = False
            base = 1e3 * statistics.median(steps[names[0]])
            print(f"round {r} n={n}: ddp-no_sync {base:.1f} ms/step")
    print(
        f"\n{args.model}, 2 gloo processes, paired ratio to ddp-no_sync: median over "
        f"{args.rounds} round(s) of {args.steps} steps [min-max]"
    )
    print(f"  {'contender':<14}" + "".join(f"{'n=' + str(n):>22}" for n in args.ns))
    for name in names:
        cells = []
        for n in args.ns:
            rs = ratios[name][n]
            cells.append(f"{statistics.median(rs):.3f} [{min(rs):.2f}-{max(rs):.2f}]")
        print(f"  {name:<14}" + "".join(f"{c:>22}" for c in cells))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
