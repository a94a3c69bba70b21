"""Single-process overhead of ``accumulate`` against hand-written accumulation loops.

Strategies, run interleaved (round-robin, so machine drift hits all alike), median of many steps:

- ``backward``: the classic loop, ``(loss * rows / B).backward()`` into ``.grad`` per micro-batch;
- ``func-hand``: ``torch.func.grad`` per micro-batch, summed by hand with ``torch._foreach_add_``;
- ``gradaccum-func``: ``gradaccum.accumulate(lambda p, b: torch.func.grad(loss_fn)(p, b), n)``:
  the tree path (wrapped, so that accumulate does not recognise the torch.func function and
  run it on its fast path, as it does with ``accumulate(torch.func.grad(loss_fn), n)``);
- ``gradaccum``: ``gradaccum.accumulate(gradaccum.grad(loss_fn), n)``, the fast path (each
  backward adds into the accumulator in place).

``gradaccum-func / func-hand`` is the library's own overhead over the same gradient engine;
``gradaccum / backward`` is the fast path against the classic loop (same engine too).

    python benchmarks/overhead.py                 # MLP of ~2M parameters, n in 1 4 8 16
    python benchmarks/overhead.py --small         # a tiny model: per-micro-batch Python cost shows
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.func import functional_call, grad

import gradaccum


def _strategies(model, params, loss_fn, g_fn, x, y, mbs, step, fast):
    def backward() -> None:
        model.zero_grad(set_to_none=True)
        for xb, yb in mbs:
            (loss_fn(dict(model.named_parameters()), (xb, yb)) * (len(xb) / len(x))).backward()

    def func_hand() -> None:
        acc = None
        for xb, yb in mbs:
            g = list(g_fn(params, (xb, yb)).values())
            if acc is None:
                acc = [t.mul(len(xb)) for t in g]
            else:
                torch._foreach_add_(acc, g, alpha=len(xb))
        torch._foreach_div_(acc, len(x))

    def ours_func() -> None:
        step(params, (x, y))

    def ours() -> None:
        fast(params, (x, y))

    return {
        "backward": backward,
        "func-hand": func_hand,
        "gradaccum-func": ours_func,
        "gradaccum": ours,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ns", type=int, nargs="+", default=[1, 4, 8, 16])
    parser.add_argument("--micro", type=int, default=64, help="rows per micro-batch")
    parser.add_argument("--steps", type=int, default=15, help="timed steps per strategy")
    parser.add_argument("--small", action="store_true", help="tiny model (overhead-bound)")
    args = parser.parse_args()
    torch.manual_seed(0)
    hidden, d_in = (16, 8) if args.small else (1024, 256)
    model = torch.nn.Sequential(
        torch.nn.Linear(d_in, hidden),
        torch.nn.GELU(),
        torch.nn.Linear(hidden, hidden),
        torch.nn.GELU(),
        torch.nn.Linear(hidden, 10),
    )
    params = gradaccum.params_of(model)
    n_params = sum(p.numel() for p in params.values())

    def loss_fn(params, batch):
        xb, yb = batch
        return torch.nn.functional.cross_entropy(functional_call(model, params, (xb,)), yb)

    print(
        f"model: {n_params / 1e6:.2f}M params, micro-batch {args.micro} rows, "
        f"{torch.get_num_threads()} threads, median of {args.steps} steps"
    )
    print(
        f"{'n':>3} {'backward ms':>12} {'func-hand ms':>13} {'ga-func ms':>11} {'ga ms':>8} "
        f"{'ga-func/func-hand':>18} {'ga/backward':>12} {'us/micro (ga-func - func-hand)':>31}"
    )
    g_fn = grad(loss_fn)
    for n in args.ns:
        x = torch.randn(args.micro * n, d_in)
        y = torch.randint(0, 10, (args.micro * n,))
        mbs = list(zip(x.chunk(n), y.chunk(n), strict=True))
        # Wrapped: a bare torch.func.grad function would be recognised and take the fast path.
        step = gradaccum.accumulate(lambda p, b: g_fn(p, b), n)
        fast = gradaccum.accumulate(gradaccum.grad(loss_fn), n)

        fns = _strategies(model, params, loss_fn, g_fn, x, y, mbs, step, fast)
        times: dict[str, list[float]] = {k: [] for k in fns}
        for k in fns:  # warm-up
            fns[k]()
        for _ in range(args.steps):
            for k, fn in fns.items():
                t0 = time.perf_counter()
                fn()
                times[k].append(time.perf_counter() - t0)
        med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        per_micro = (med["gradaccum-func"] - med["func-hand"]) / n * 1e3
        print(
            f"{n:>3} {med['backward']:>12.2f} {med['func-hand']:>13.2f} "
            f"{med['gradaccum-func']:>11.2f} {med['gradaccum']:>8.2f} "
            f"{med['gradaccum-func'] / med['func-hand']:>18.3f} "
            f"{med['gradaccum'] / med['backward']:>12.3f} {per_micro:>31.1f}"
        )


if __name__ == "__main__":
    main()
