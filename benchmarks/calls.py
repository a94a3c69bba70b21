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

    python benchmarks/calls.py --lm            # issue 36's host-work table

``--lm``: the extra host work of ``loop.Step``, ``accumulate`` and DDP + ``no_sync`` against a
hand-written loop, on a pre-LN transformer LM (4 and then 8 blocks, d = 64, 4 heads, vocab
512, micro-batches of 4 x 32 tokens), each a whole training window with fused AdamW,
``all_reduce()`` on a group of one (DDP over it too). Python calls are ``sys.setprofile``
"call" events (Python functions only, not builtins), per window, the median of 5 windows after
2 warm-up windows. Per micro-batch = (extra at n = 16 - extra at n = 4) / 12; per window = the
extra at n = 4 less 4 micro-batches' worth. Aten ops per micro-batch come from a dispatch mode,
counted the same way.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import sys
from collections.abc import Callable
from typing import Any

import _launch
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _bench_models import TinyLM
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils._python_dispatch import TorchDispatchMode

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


# -- issue 36: the extra host work of each training loop against a hand-written one -----------

LM_PATHS = ("hand", "ddp", "accumulate", "loop.Step")


def _lm_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def lm_window(path: str, blocks: int, n: int) -> Callable[[], None]:
    """One whole training window of ``path`` (n micro-batches, optimizer step, zeroed grads)."""
    torch.manual_seed(0)
    model = TinyLM(512, 64, 4, blocks, 32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 512, (4 * n, 33), generator=g)
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    micro = list(zip(x.chunk(n), y.chunk(n)))
    if path == "hand":

        def hand() -> None:
            for xm, ym in micro:
                (_lm_loss(model(xm), ym) / n).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        return hand
    if path == "ddp":
        ddp = DDP(model)
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3, fused=True)

        def with_ddp() -> None:
            with ddp.no_sync():
                for xm, ym in micro[:-1]:
                    (_lm_loss(ddp(xm), ym) / n).backward()
            xm, ym = micro[-1]
            (_lm_loss(ddp(xm), ym) / n).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        return with_ddp
    if path == "accumulate":
        params, buffers = gradaccum.params_of(model), gradaccum.buffers_of(model)

        def floss(p: Any, batch: Any) -> torch.Tensor:
            return _lm_loss(gradaccum.call_module(model, p, buffers, batch[0])[0], batch[1])

        step = gradaccum.accumulate(gradaccum.grad(floss), n, sync=gradaccum.all_reduce())

        def accumulated() -> None:
            gradaccum.write_grads(model, step(params, (x, y)))
            opt.step()
            opt.zero_grad(set_to_none=True)

        return accumulated
    if path == "loop.Step":

        def mloss(m: torch.nn.Module, b: Any) -> torch.Tensor:
            return _lm_loss(m(b[0]), b[1])

        st = gradaccum.loop.Step(model, mloss, opt, sync=gradaccum.all_reduce())

        def stepped() -> None:
            for mb in micro:
                st.add(mb)
            st.apply()

        return stepped
    raise ValueError(path)


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.count += 1
        return func(*args, **(kwargs or {}))


def host_work(path: str, blocks: int, n: int, windows: int = 5) -> tuple[float, float]:
    """(Python calls, aten ops) per window: the median over ``windows`` after 2 warm-ups."""
    window = lm_window(path, blocks, n)
    for _ in range(2):
        window()
    calls: list[int] = []
    for _ in range(windows):
        seen = [0]

        def count(frame: Any, event: str, arg: Any, seen: list[int] = seen) -> None:
            if event == "call":
                seen[0] += 1

        sys.setprofile(count)
        try:
            window()
        finally:
            sys.setprofile(None)
        calls.append(seen[0])
    ops = _Ops()
    with ops:
        window()
    return statistics.median(calls), float(ops.count)


def lm_table(paths: tuple[str, ...] = LM_PATHS[1:], out: str | None = None) -> None:
    print("Extra host work against the hand loop (issue 36): Python calls (setprofile 'call'")
    print("events) and aten ops; LM d=64, 4 heads, vocab 512, micro-batches 4 x 32, fused AdamW,")
    print("all_reduce() on a group of one")
    print()
    print("| path | blocks | calls per micro-batch | calls per window | aten ops per micro-batch |")
    print("|---|---|---|---|---|")
    rows = []
    for blocks in (4, 8):
        work = {(p, k): host_work(p, blocks, k) for p in ("hand", *paths) for k in (4, 16)}
        for path in paths:
            extra = {k: [a - b for a, b in zip(work[path, k], work["hand", k])] for k in (4, 16)}
            per_mb = [(extra[16][i] - extra[4][i]) / 12 for i in range(2)]
            per_window = extra[4][0] - 4 * per_mb[0]
            print(f"| {path} | {blocks} | {per_mb[0]:.0f} | {per_window:.0f} | {per_mb[1]:.1f} |")
            rows.append(
                {
                    "path": path,
                    "blocks": blocks,
                    "calls_per_micro_batch": per_mb[0],
                    "calls_per_window": per_window,
                    "ops_per_micro_batch": per_mb[1],
                }
            )
    if out:
        with open(out, "w") as f:
            json.dump(rows, f, indent=1)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--ns", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--lm", action="store_true", help="issue 36's host-work table instead")
    ap.add_argument("--paths", nargs="+", default=list(LM_PATHS[1:]), choices=LM_PATHS[1:])
    ap.add_argument("--json", default=None, help="with --lm: also write the rows here")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.lm:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_launch.free_port()))
        dist.init_process_group("gloo", rank=0, world_size=1)
        try:
            lm_table(tuple(args.paths), args.json)
        finally:
            dist.destroy_process_group()
        return
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
