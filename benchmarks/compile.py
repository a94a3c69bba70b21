"""When does ``torch.compile`` pay inside ``accumulate``? One process, side by side.

Strategies, each an ``accumulate(..., n)`` step over the same model and batch (``mlp`` and
``lm`` from ``_bench_models.py``):

- ``eager``: ``gradaccum.grad(loss_fn)``, the fast path, no compilation;
- ``compiled-loss``: ``gradaccum.grad(torch.compile(loss_fn))``: the forward and backward of
  each micro-batch run compiled (AOTAutograd), the fast path is kept;
- ``func-eager``: ``torch.func.grad(loss_fn)``;
- ``func-compiled``: ``torch.compile(torch.func.grad(loss_fn))``.

For each, the first call's time (compilation included) and the median of later steps, run
interleaved. ``break-even`` is how many steps the compilation takes to pay back against
``eager``: (first call - eager step) / (eager step - compiled step).

    python benchmarks/compile.py                       # both models, n=4, inductor
    python benchmarks/compile.py --models mlp --backend aot_eager --steps 30
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.func import functional_call

sys.path.insert(0, str(Path(__file__).parent))
import _bench_models as bm  # noqa: E402

import gradaccum  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(bm.MODELS), choices=bm.MODELS)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--backend", default="inductor")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, backend {args.backend}, n={args.n}, 1 thread")
    for name in args.models:
        spec = bm.spec(name)
        model = spec.build()
        params = gradaccum.params_of(model)
        batch = spec.make_batch(torch.Generator().manual_seed(0), spec.micro * args.n)

        def loss_fn(p, b, model=model, spec=spec):
            return spec.loss(functional_call(model, p, (b[0],)), b[1])

        torch._dynamo.reset()
        compiled_loss = torch.compile(loss_fn, backend=args.backend)
        steps = {
            "eager": gradaccum.accumulate(gradaccum.grad(loss_fn), args.n),
            "compiled-loss": gradaccum.accumulate(gradaccum.grad(compiled_loss), args.n),
            "func-eager": gradaccum.accumulate(torch.func.grad(loss_fn), args.n),
            "func-compiled": gradaccum.accumulate(
                torch.compile(torch.func.grad(loss_fn), backend=args.backend), args.n
            ),
        }
        first: dict[str, float] = {}
        for k, step in steps.items():
            t = time.perf_counter()
            step(params, batch)
            first[k] = time.perf_counter() - t
        ref = steps["eager"](params, batch)
        diffs = {
            k: max(float((step(params, batch)[p] - ref[p]).abs().max()) for p in ref)
            for k, step in steps.items()
        }
        times: dict[str, list[float]] = {k: [] for k in steps}
        order = list(steps)
        for _ in range(args.steps):
            order = order[1:] + order[:1]
            for k in order:
                t = time.perf_counter()
                steps[k](params, batch)
                times[k].append(time.perf_counter() - t)
        med = {k: statistics.median(v) for k, v in times.items()}
        print(f"\n{spec.describe}, n={args.n}, median of {args.steps} steps")
        print(
            f"  {'strategy':<15}{'first call s':>13}{'step ms':>10}{'vs eager':>10}"
            f"{'break-even steps':>18}{'max |diff|':>12}"
        )
        for k in steps:
            saving = med["eager"] - med[k]
            if k == "eager":
                even = "-"
            elif saving > 0:
                even = f"{(first[k] - med['eager']) / saving:.0f}"
            else:
                even = "never"
            print(
                f"  {k:<15}{first[k]:>13.2f}{med[k] * 1e3:>10.2f}{med[k] / med['eager']:>10.3f}"
                f"{even:>18}{diffs[k]:>12.1e}"
            )


if __name__ == "__main__":
    main()
