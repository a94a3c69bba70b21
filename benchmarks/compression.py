"""Compressed boundary reductions: what they save in bytes and what they cost in loss, on CPU.

    python benchmarks/compression.py             # the full run, under a minute on 2 cores
    python benchmarks/compression.py --quick     # a smaller model, 30 steps: a smoke test
    python benchmarks/compression.py --strategies exact topk-0.1 topk-0.01 --momentum 0 --lr 0.25
    python benchmarks/compression.py --steps 600 --out /tmp/compression

Two processes (gloo on 127.0.0.1, 1 thread each), world size 2. The task is a regression with a
fixed teacher: inputs ``x ~ N(0, I)`` in 16 dimensions, targets ``teacher(x) + 0.01 * noise``,
where ``teacher`` is a random 16-4-1 tanh network; fresh rows every step, generated from a seed
that every rank shares, each rank taking half of each global batch of 128 rows. The student is a
16-256-256-1 tanh MLP (70,401 float32 parameters), trained for 300 steps with ``-n 4``
micro-batches per rank (16 rows each) and ``torch.optim.SGD(lr=0.1, momentum=0.9)`` with a
cosine decay of the learning rate to zero, one optimizer step per window:
``accumulate(gradaccum.grad_and_value(loss_fn), n=4, has_aux=True, sync=...)``, with

- ``exact``: ``gradaccum.all_reduce()``, the reference;
- ``bf16`` / ``fp16``:
  ``gradaccum.compression.compressed_all_reduce(torch.bfloat16 / torch.float16)``;
- ``topk-0.1`` / ``topk-0.01``: ``gradaccum.compression.topk_all_reduce(ratio=0.1 / 0.01)``;
- ``powersgd-4``: ``gradaccum.compression.powersgd(rank=4)``.

Every strategy starts from the same weights and sees the same batches. Recorded per strategy:
the training loss of every step (the mean over the global batch: each rank's loss weighted by
its rows, summed over the ranks by one all_reduce that is not gradaccum's), the loss on 4,096
held-out rows every 10 steps and at the end ("final loss"), and, with
``gradaccum.sync.record_collectives()``, the collectives gradaccum issued in every step: their bytes
per optimizer step (the mean over the steps after the first, split by purpose). The bytes are
``Collective.nbytes``: the size of the tensor an all_reduce reduces (what goes in), or of the
tensor an all_gather fills (what comes out: ``W`` ranks' parts).

After training, every rank's parameters are compared with rank 0's: a reduction must give every
rank the same gradient, so they must be bit-identical.

Outputs (in ``--out``, default ``docs/benchmarks``; with ``--quick`` a directory under the
temporary directory, so that a smoke run leaves the docs alone): ``compression.png`` (held-out
loss against the step, log y, one line per strategy, and the same relative to ``exact``; needs
matplotlib), ``compression.json`` (the curves and byte counts it is drawn from, whose SHA-256
the PNG's metadata holds: ``tests/test_figures.py`` checks that they agree) and
``compression_output.txt`` (everything printed). ``--replot`` redraws the figure from
``compression.json`` without running anything. The exit status is 1 when a strategy's final loss
is not finite or the ranks' parameters differ.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import io
import json
import math
import os
import platform
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import _figures
import _launch
import torch
import torch.distributed as dist
from torch import nn
from torch.func import functional_call

import gradaccum

STRATEGIES: dict[str, tuple[str, Callable[[], Any]]] = {  # name -> (what it runs, make the sync)
    "exact": ("all_reduce()", lambda: gradaccum.all_reduce()),
    "bf16": (
        "compressed_all_reduce(torch.bfloat16)",
        lambda: gradaccum.compression.compressed_all_reduce(torch.bfloat16),
    ),
    "fp16": (
        "compressed_all_reduce(torch.float16)",
        lambda: gradaccum.compression.compressed_all_reduce(torch.float16),
    ),
    "topk-0.1": (
        "topk_all_reduce(ratio=0.1)",
        lambda: gradaccum.compression.topk_all_reduce(ratio=0.1),
    ),
    "topk-0.01": (
        "topk_all_reduce(ratio=0.01)",
        lambda: gradaccum.compression.topk_all_reduce(ratio=0.01),
    ),
    "powersgd-4": ("powersgd(rank=4)", lambda: gradaccum.compression.powersgd(rank=4)),
}
WORLD = 2
D_IN, TEACHER_HIDDEN, NOISE = 16, 4, 0.01
EVAL_ROWS, EVAL_EVERY = 4096, 10
REPO = Path(__file__).resolve().parent.parent


# ------------------------------------------------------------------------- the task and model


def teacher(seed: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """A fixed random 32-64-1 tanh network: the function to learn."""
    gen = torch.Generator().manual_seed(seed)
    w1 = torch.randn(D_IN, TEACHER_HIDDEN, generator=gen) / D_IN**0.5
    w2 = torch.randn(TEACHER_HIDDEN, 1, generator=gen) / TEACHER_HIDDEN**0.5
    return lambda x: torch.tanh(x @ w1) @ w2


def make_rows(f: Callable[[torch.Tensor], torch.Tensor], rows: int, seed: int) -> Any:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, D_IN, generator=gen)
    return x, f(x) + NOISE * torch.randn(rows, 1, generator=gen)


def student(hidden: int, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(D_IN, hidden),
        nn.Tanh(),
        nn.Linear(hidden, hidden),
        nn.Tanh(),
        nn.Linear(hidden, 1),
    )


# ------------------------------------------------------------------------ one rank's training


def train_all(rank: int, world: int, job: dict[str, Any]) -> dict[str, Any]:
    """Train every strategy of ``job`` in turn on this rank; return what was recorded."""
    f = teacher(job["seed"])
    batches = [
        make_rows(f, job["batch"], seed=job["seed"] * 100_000 + i) for i in range(job["steps"])
    ]
    x_eval, y_eval = make_rows(f, EVAL_ROWS, seed=job["seed"] * 100_000 - 1)
    out: dict[str, Any] = {}

    def cosine(i: int) -> float:  # the learning rate decays to zero over the run
        return 0.5 * (1 + math.cos(math.pi * i / job["steps"]))

    for name in job["strategies"]:
        model = student(job["hidden"], job["seed"])  # the same initial weights everywhere
        params = gradaccum.params_of(model)
        opt = torch.optim.SGD(model.parameters(), lr=job["lr"], momentum=job["momentum"])
        sched = torch.optim.lr_scheduler.LambdaLR(opt, cosine)

        def loss_fn(p: dict[str, torch.Tensor], batch: Any, model: nn.Module = model) -> Any:
            x, y = batch
            return nn.functional.mse_loss(functional_call(model, p, (x,)), y)

        def held_out(model: nn.Module = model) -> float:
            with torch.no_grad():
                return nn.functional.mse_loss(model(x_eval), y_eval).item()

        sync = STRATEGIES[name][1]()
        step = gradaccum.accumulate(
            gradaccum.grad_and_value(loss_fn), job["n"], has_aux=True, sync=sync
        )
        train_loss, eval_steps, eval_loss = [], [0], [held_out()]
        per_step: list[dict[str, int]] = []
        started = time.perf_counter()
        for i, (x, y) in enumerate(batches):
            shard = (x.tensor_split(world)[rank], y.tensor_split(world)[rank])
            with gradaccum.sync.record_collectives() as log:
                grads, loss = step(params, shard)
            bytes_by_purpose: dict[str, int] = defaultdict(int)
            for c in log:
                bytes_by_purpose[f"{c.kind} ({c.purpose})"] += c.nbytes
            per_step.append(dict(bytes_by_purpose))
            gradaccum.write_grads(model, grads)
            opt.step()
            sched.step()
            # The global batch's mean loss: each rank's mean weighted by its rows (not gradaccum's).
            pair = torch.tensor([loss.item() * len(shard[0]), len(shard[0])], dtype=torch.float64)
            dist.all_reduce(pair)
            train_loss.append((pair[0] / pair[1]).item())
            if (i + 1) % EVAL_EVERY == 0 or i + 1 == len(batches):
                eval_steps.append(i + 1)
                eval_loss.append(held_out())
        seconds = time.perf_counter() - started
        # Every rank must hold the same parameters: compare with rank 0's, bit for bit.
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        ref = flat.clone()
        dist.broadcast(ref, src=0)
        differ = torch.tensor([int((flat.view(torch.int32) != ref.view(torch.int32)).sum())])
        dist.all_reduce(differ, op=dist.ReduceOp.MAX)
        out[name] = {
            "train_loss": train_loss,
            "eval_steps": eval_steps,
            "eval_loss": eval_loss,
            "bytes": per_step,
            "seconds": seconds,
            "rank_diff": int(differ),
            "params": flat.numel(),
        }
    return out


# --------------------------------------------------------------------------- the two processes


def launch(job: dict[str, Any], world: int, timeout: float) -> list[Any]:
    """Run ``train_all`` on ``world`` fresh processes; return each rank's result (or raise)."""
    return _launch.launch(train_all, job, world, timeout, what="compression", start_method="spawn")


# ---------------------------------------------------------------------------------- the parent


def summarise(res: dict[str, Any]) -> dict[str, Any]:
    """Bytes per optimizer step (mean over the steps after the first), by purpose and in all."""
    later = res["bytes"][1:] or res["bytes"]
    purposes = sorted({k for step in later for k in step})
    by = {k: sum(step.get(k, 0) for step in later) / len(later) for k in purposes}
    return {"by_purpose": by, "total": sum(by.values()), "final": res["eval_loss"][-1]}


def plot(data: dict[str, Any], path: Path, source: Path) -> bool:
    """Draw the figure from ``data`` (what ``compression.json``, the file ``source``, holds)."""
    results, sums, names, title = data["results"], data["sums"], data["names"], data["title"]
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("note: matplotlib is not installed; no plot (pip install gradaccum[bench])")
        return False
    styles = ["-", "--", ":", "-", "-", "-."]
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5))
    ref = results["exact"]
    for i, name in enumerate(names):
        res = results[name]
        color, ls = f"C{i}", styles[i % len(styles)]
        ratio = sums[name]["total"] / sums["exact"]["total"]
        label = f"{name} ({ratio:.3f}x the bytes)"
        steps = range(1, len(res["train_loss"]) + 1)
        left.plot(steps, res["train_loss"], color=color, alpha=0.15, lw=0.8)
        left.plot(res["eval_steps"], res["eval_loss"], ls, color=color, lw=1.8, label=label)
        rel = [a / b for a, b in zip(res["eval_loss"], ref["eval_loss"])]
        right.plot(res["eval_steps"], rel, ls, color=color, lw=1.8, label=label)
    left.set_yscale("log")
    left.set_ylabel("MSE (held-out: lines; training batch: faint)")
    left.set_title(title, fontsize=10)
    right.set_yscale("log")
    right.set_ylabel("held-out MSE / exact's")
    right.set_title("the same, relative to the exact all_reduce", fontsize=10)
    for ax in (left, right):
        ax.set_xlabel("optimizer step")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100, metadata=_figures.metadata(source))
    plt.close(fig)
    return True


def shown(path: Path) -> str:
    """``path`` relative to the repository when it is inside it (the output file is committed)."""
    try:
        return str(path.resolve().relative_to(REPO))
    except ValueError:
        return str(path)


def run(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    names = list(dict.fromkeys(args.strategies))
    if "exact" not in names:
        names.insert(0, "exact")  # the reference of every ratio
    n_params = sum(p.numel() for p in student(args.hidden, args.seed).parameters())
    print(
        f"compression benchmark, {datetime.date.today()}: {WORLD} gloo processes on 127.0.0.1, "
        f"1 thread each; "
        f"torch {torch.__version__}, gradaccum {gradaccum.__version__}, Python "
        f"{platform.python_version()}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}\n"
        f"task: regression on a fixed random {D_IN}-{TEACHER_HIDDEN}-1 tanh teacher "
        f"(+ {NOISE} noise, fresh rows every step); student {D_IN}-{args.hidden}-{args.hidden}-1 "
        f"tanh MLP, {n_params:,} float32 parameters\n"
        f"{args.steps} optimizer steps of SGD(lr={args.lr:g}, momentum={args.momentum:g}), "
        f"cosine decay to 0; "
        f"global batch "
        f"{args.batch} rows = {args.batch // WORLD} per rank = {args.n} micro-batches of "
        f"{args.batch // WORLD // args.n} rows\n"
        f"strategies: " + ", ".join(f"{k} = {STRATEGIES[k][0]}" for k in names),
        flush=True,
    )
    job = {
        "strategies": names,
        "steps": args.steps,
        "n": args.n,
        "batch": args.batch,
        "hidden": args.hidden,
        "seed": args.seed,
        "lr": args.lr,
        "momentum": args.momentum,
        "pg_timeout": 300,
    }
    ranks = launch(job, WORLD, timeout=args.timeout)
    results = ranks[0]
    sums = {name: summarise(results[name]) for name in names}
    ref = sums["exact"]

    print("\nbytes per optimizer step and rank (Collective.nbytes; mean over steps 2..):")
    for name in names:
        parts = ", ".join(f"{k} {v:,.0f}" for k, v in sums[name]["by_purpose"].items())
        print(f"  {name:<11} {parts}")
    first = {k: v for k, v in results["exact"]["bytes"][0].items()}
    print(f"  (exact, step 1 only: {', '.join(f'{k} {v:,}' for k, v in first.items())})")

    print("\nheld-out MSE by step:")
    print(f"  {'step':>5}  " + " ".join(f"{k:>10}" for k in names))
    ev = results["exact"]["eval_steps"]
    for j in sorted({j for j in range(len(ev)) if ev[j] % 50 == 0} | {1, len(ev) - 1}):
        print(f"  {ev[j]:>5}  " + " ".join(f"{results[k]['eval_loss'][j]:>10.3e}" for k in names))

    header = (
        f"{'strategy':<11} {'final loss':>11} {'vs exact':>9} {'bytes/step':>11} "
        f"{'vs exact':>9} {'ranks agree':>12} {'s':>6}"
    )
    print(f"\nafter {args.steps} steps (final loss: held-out MSE; loss floor {NOISE**2:.0e}):")
    print(header)
    print("-" * len(header))
    ok = True
    for name in names:
        s, res = sums[name], results[name]
        finite = math.isfinite(s["final"])
        agree = res["rank_diff"] == 0
        ok = ok and finite and agree
        print(
            f"{name:<11} {s['final']:>11.3e} {s['final'] / ref['final']:>9.2f} "
            f"{s['total']:>11,.0f} {s['total'] / ref['total']:>9.3f} "
            f"{'yes' if agree else 'NO':>12} {res['seconds']:>6.1f}"
        )
    print(
        "\n(final loss vs exact: ratio of held-out MSEs; bytes/step: all of gradaccum's "
        "collectives of one optimizer step, the weight all_reduce included; ranks agree: every "
        "rank's parameters equal rank 0's bit for bit; s: training seconds, 2 CPU processes "
        "on loopback, so not a measure of network time)"
    )
    bad = [k for k in names if not math.isfinite(sums[k]["final"])]
    if bad:
        print(f"FAILED: non-finite final loss for {', '.join(bad)}")
    if not all(results[k]["rank_diff"] == 0 for k in names):
        print("FAILED: the ranks' parameters differ")

    args.out.mkdir(parents=True, exist_ok=True)
    title = (
        f"{WORLD} ranks x {args.n} micro-batches, {n_params:,}-param MLP, "
        f"SGD(lr={args.lr:g}, momentum={args.momentum:g})"
    )
    keep = ("train_loss", "eval_steps", "eval_loss")
    data = {
        "names": names,
        "title": title,
        "results": {k: {key: results[k][key] for key in keep} for k in names},
        "sums": sums,
    }
    source = args.out / "compression.json"
    source.write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {shown(source)}")
    png = args.out / "compression.png"
    if plot(data, png, source):
        print(f"wrote {shown(png)}")
    print(f"{'OK' if ok else 'FAILED'}; {time.perf_counter() - started:.0f} s")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=(__doc__ or "").splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--quick", action="store_true", help="a smaller model, 30 steps")
    parser.add_argument("--steps", type=int, help="optimizer steps (default 300; --quick 30)")
    parser.add_argument("-n", type=int, default=4, help="micro-batches per rank (default 4)")
    parser.add_argument("--batch", type=int, default=128, help="global batch rows (default 128)")
    parser.add_argument("--hidden", type=int, help="student width (default 256; --quick 64)")
    parser.add_argument(
        "--strategies", nargs="+", choices=list(STRATEGIES), default=list(STRATEGIES)
    )
    parser.add_argument("--lr", type=float, default=0.1, help="SGD learning rate (default 0.1)")
    parser.add_argument("--momentum", type=float, default=0.9, help="SGD momentum (default 0.9)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="output directory (default docs/benchmarks)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds for the whole run")
    parser.add_argument(
        "--replot", action="store_true", help="redraw compression.png from compression.json"
    )
    args = parser.parse_args(argv)
    if args.replot:  # no benchmark: the figure from the data already there
        out = args.out or REPO / "docs" / "benchmarks"
        source = out / "compression.json"
        return 0 if plot(json.loads(source.read_text()), out / "compression.png", source) else 1
    args.steps = args.steps or (30 if args.quick else 300)
    args.hidden = args.hidden or (64 if args.quick else 256)
    if args.out is None:
        quick_dir = Path(tempfile.gettempdir()) / "gradaccum-compression-quick"
        args.out = quick_dir if args.quick else REPO / "docs" / "benchmarks"
    if args.steps < 1 or args.n < 1 or args.batch < WORLD * args.n:
        parser.error(f"need --steps >= 1, -n >= 1 and --batch >= {WORLD} * n")

    # Everything printed also goes to <out>/compression_output.txt.
    buffer = io.StringIO()

    class Tee(io.TextIOBase):
        def write(self, s: str) -> int:
            sys.__stdout__.write(s)
            buffer.write(s)
            return len(s)

        def flush(self) -> None:
            sys.__stdout__.flush()

    with contextlib.redirect_stdout(Tee()):
        try:
            status = run(args)
        except RuntimeError as err:
            print(f"FAILED: {err}")
            status = 1
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "compression_output.txt").write_text(buffer.getvalue())
    print(f"wrote {shown(args.out / 'compression_output.txt')}")
    return status


if __name__ == "__main__":
    sys.exit(main())
