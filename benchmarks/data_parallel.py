"""Data-parallel step time on 2 gloo processes (127.0.0.1): gradaccum against torch DDP.

Strategies, interleaved round-robin on every rank (so machine drift hits all alike), median of
many optimizer steps:

- ``ddp-naive``: DDP syncing every micro-batch (the loop people write first);
- ``ddp-no_sync``: DDP with forward and backward inside ``no_sync()`` except the last micro-batch;
- ``gradaccum``: ``accumulate(grad(loss), n, sync=all_reduce())`` + ``write_grads``;
- ``gradaccum-autograd``: the same transform over a step function built on
  ``torch.autograd.grad`` (the module's own parameters, no torch.func).

Each step ends with ``optimizer.step()``. The script also counts the collectives and bytes
gradaccum issues per optimizer step, and checks that all strategies end with the same parameters.

    python benchmarks/data_parallel.py               # ~1.3M-param MLP, n in 1 4 8
    python benchmarks/data_parallel.py --ns 1 4 8 16 --steps 30
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import socket
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.func import functional_call, grad
from torch.nn.parallel import DistributedDataParallel as DDP

import gradaccum


def _model(d_in: int, hidden: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(d_in, hidden),
        torch.nn.GELU(),
        torch.nn.Linear(hidden, hidden),
        torch.nn.GELU(),
        torch.nn.Linear(hidden, 10),
    )


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, out: Any) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=300),
    )
    try:
        out.put((rank, _bench(rank, world, args)))
    finally:
        dist.destroy_process_group()


def _bench(rank: int, world: int, args: argparse.Namespace) -> dict[str, Any]:
    return {n: _bench_n(rank, n, args) for n in args.ns}


def _bench_n(rank: int, n: int, args: argparse.Namespace) -> dict[str, Any]:
    names = ("naive", "no_sync", "ga", "ga_autograd")
    models = {name: _model(args.d_in, args.hidden) for name in names}
    ddp = {k: DDP(models[k]) for k in ("naive", "no_sync")}
    opts = {k: torch.optim.SGD(m.parameters(), lr=1e-3) for k, m in models.items()}
    ga_model = models["ga"]

    def loss_fn(params: Any, batch: Any, model: torch.nn.Module = ga_model) -> torch.Tensor:
        xb, yb = batch
        return torch.nn.functional.cross_entropy(functional_call(model, params, (xb,)), yb)

    step = gradaccum.accumulate(grad(loss_fn), n, sync=gradaccum.all_reduce())
    rows = args.micro * n
    gen = torch.Generator().manual_seed(1000 + rank)
    batches = [
        (
            torch.randn(rows, args.d_in, generator=gen),
            torch.randint(0, 10, (rows,), generator=gen),
        )
        for _ in range(4)
    ]

    def ddp_step(key: str, x: torch.Tensor, y: torch.Tensor) -> None:
        model, opt = ddp[key], opts[key]
        opt.zero_grad(set_to_none=True)
        for i, (xb, yb) in enumerate(zip(x.chunk(n), y.chunk(n))):
            quiet = key == "no_sync" and i < n - 1
            with model.no_sync() if quiet else contextlib.nullcontext():
                (torch.nn.functional.cross_entropy(model(xb), yb) / n).backward()
        opt.step()

    def ga_step(x: torch.Tensor, y: torch.Tensor) -> None:
        grads = step(gradaccum.params_of(ga_model), (x, y))
        gradaccum.write_grads(ga_model, grads)
        opts["ga"].step()

    # The same transform over a torch.autograd step function: the module's own parameters,
    # no torch.func (whose per-call cost is what separates gradaccum from a backward loop).
    ag_model = models["ga_autograd"]
    ag_params = dict(ag_model.named_parameters())

    def autograd_grad(params: Any, batch: Any) -> dict[str, torch.Tensor]:
        xb, yb = batch
        loss = torch.nn.functional.cross_entropy(ag_model(xb), yb)
        return dict(zip(params, torch.autograd.grad(loss, list(params.values())), strict=True))

    ag_step = gradaccum.accumulate(autograd_grad, n, sync=gradaccum.all_reduce())

    def ga_autograd_step(x: torch.Tensor, y: torch.Tensor) -> None:
        gradaccum.write_grads(ag_model, ag_step(ag_params, (x, y)))
        opts["ga_autograd"].step()

    strategies = {
        "ddp-naive": lambda x, y: ddp_step("naive", x, y),
        "ddp-no_sync": lambda x, y: ddp_step("no_sync", x, y),
        "gradaccum": ga_step,
        "gradaccum-autograd": ga_autograd_step,
    }
    for fn in strategies.values():  # warm-up (DDP's first step builds its buckets)
        fn(*batches[0])
    times: dict[str, list[float]] = {name: [] for name in strategies}
    log: list[gradaccum.Collective] = []
    for s in range(args.steps):
        for name, fn in strategies.items():
            dist.barrier()
            with gradaccum.record_collectives() as step_log:
                t0 = time.perf_counter()
                fn(*batches[s % len(batches)])
                times[name].append(time.perf_counter() - t0)
            if name == "gradaccum":
                log.extend(step_log)
    params = [[p.detach() for p in m.parameters()] for m in models.values()]
    diff = max(
        float((a - b).abs().max())
        for other in params[1:]
        for a, b in zip(params[0], other, strict=True)
    )
    return {
        "ms": {k: 1e3 * statistics.median(v) for k, v in times.items()},
        "collectives": len(log) / args.steps,
        "bytes": sum(c.nbytes for c in log) / args.steps,
        "diff": diff,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ns", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--micro", type=int, default=32, help="rows per micro-batch per rank")
    parser.add_argument("--steps", type=int, default=15, help="timed steps per strategy")
    parser.add_argument("--d-in", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=1024)
    args = parser.parse_args()
    n_params = sum(p.numel() for p in _model(args.d_in, args.hidden).parameters())
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, 2, port, args, out)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=3600) for _ in procs)
    for p in procs:
        p.join()
    print(
        f"2 gloo processes on 127.0.0.1, 1 thread each; MLP {n_params / 1e6:.2f}M params; "
        f"{args.micro} rows per micro-batch per rank; median of {args.steps} steps (rank 0)"
    )
    print(
        f"{'n':>3} {'naive ms':>9} {'no_sync ms':>11} {'ga ms':>7} {'ga-autograd ms':>15} "
        f"{'naive/ns':>9} {'ga/ns':>6} {'ga-ag/ns':>9} {'ga colls':>9} {'ga MB/step':>11} "
        f"{'max diff':>9}"
    )
    for n, r in results[0].items():
        ms = r["ms"]
        ns = ms["ddp-no_sync"]
        print(
            f"{n:>3} {ms['ddp-naive']:>9.1f} {ns:>11.1f} {ms['gradaccum']:>7.1f} "
            f"{ms['gradaccum-autograd']:>15.1f} {ms['ddp-naive'] / ns:>9.3f} "
            f"{ms['gradaccum'] / ns:>6.3f} {ms['gradaccum-autograd'] / ns:>9.3f} "
            f"{r['collectives']:>9g} {r['bytes'] / 2**20:>11.2f} {r['diff']:>9.1e}"
        )
    print("ns = DDP + no_sync; ga-autograd = accumulate over a torch.autograd.grad step function")


if __name__ == "__main__":
    main()
