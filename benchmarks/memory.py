"""Peak memory against n: accumulate vs a naive loop whose autograd graph grows with n.

Each configuration runs in a fresh process (peak RSS is a high-water mark). The micro-batch size
is fixed, so the batch grows with n: a correct accumulation keeps one micro-batch's activations
alive at a time, and its peak stays flat; the naive loop (``total_loss += loss`` and one
``backward``) keeps every micro-batch's graph and grows. ``accumulator`` is the streaming form
(``Accumulator.add`` per micro-batch, then ``finalize``), whose running sums the returned
gradients alias: its peak must stay flat too.

    python benchmarks/memory.py            # prints a table and ratios against n=1

Reading it: compare each strategy with itself across n. Between strategies the n=1 rows differ
by torch.func's one-time cost (the first ``torch.func.grad`` call raises RSS by about 100 MiB on
CPU whatever the model; plain ``loss.backward()`` does not pay it). RSS is coarse (glibc's
allocator keeps freed pages), and the batch itself grows with n here.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys

D_IN, HIDDEN, MICRO = 64, 1024, 256


def _child(strategy: str, n: int) -> None:
    import torch
    from torch.func import functional_call, grad

    import gradaccum

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(D_IN, HIDDEN),
        torch.nn.GELU(),
        torch.nn.Linear(HIDDEN, HIDDEN),
        torch.nn.GELU(),
        torch.nn.Linear(HIDDEN, HIDDEN),
        torch.nn.GELU(),
        torch.nn.Linear(HIDDEN, 10),
    )
    x, y = torch.randn(MICRO * n, D_IN), torch.randint(0, 10, (MICRO * n,))
    params = gradaccum.params_of(model)

    def loss_fn(params, batch):
        xb, yb = batch
        return torch.nn.functional.cross_entropy(functional_call(model, params, (xb,)), yb)

    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for _ in range(2):
        if strategy == "gradaccum":
            grads = gradaccum.accumulate(grad(loss_fn), n)(params, (x, y))
            del grads
        elif strategy == "accumulator":  # streaming: one add per micro-batch, then finalize
            acc = gradaccum.Accumulator(n)
            state = acc.init(params)
            for xb, yb in zip(x.chunk(n), y.chunk(n), strict=True):
                state = acc.add(state, grad(loss_fn)(params, (xb, yb)), size=len(xb))
            grads, state = acc.finalize(state)
            del grads
        else:  # naive: keep every micro-batch's graph alive until one backward
            total = 0.0
            for xb, yb in zip(x.chunk(n), y.chunk(n), strict=True):
                total = total + loss_fn(dict(model.named_parameters()), (xb, yb)) / n
            total.backward()
            model.zero_grad(set_to_none=True)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(
        json.dumps(
            {
                "strategy": strategy,
                "n": n,
                "peak_mib": peak / 1024,
                "growth_mib": (peak - base) / 1024,
            }
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ns", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args.child[0], int(args.child[1]))
        return
    rows = []
    for strategy in ("gradaccum", "accumulator", "naive"):
        for n in args.ns:
            out = subprocess.run(
                [sys.executable, __file__, "--child", strategy, str(n)],
                check=True,
                capture_output=True,
                text=True,
                timeout=600,
            ).stdout
            rows.append(json.loads(out.strip().splitlines()[-1]))
    print(f"micro-batch {MICRO} rows, MLP {D_IN}-{HIDDEN}x3-10; peak RSS of a fresh process")
    print("(growth: peak above the same process's RSS after imports and set-up)")
    n0 = args.ns[0]
    print(
        f"{'strategy':<10} {'n':>3} {'peak MiB':>9} {'vs n=' + str(n0):>8} "
        f"{'growth MiB':>11} {'vs n=' + str(n0):>8}"
    )
    for r in rows:
        first = next(q for q in rows if q["strategy"] == r["strategy"])
        print(
            f"{r['strategy']:<10} {r['n']:>3} {r['peak_mib']:>9.1f} "
            f"{r['peak_mib'] / first['peak_mib']:>8.3f} {r['growth_mib']:>11.1f} "
            f"{r['growth_mib'] / max(first['growth_mib'], 1e-9):>8.3f}"
        )


if __name__ == "__main__":
    main()
