"""Coupled losses: gradaccum.coupled against the whole batch, plain and naive accumulation, on CPU.

    python benchmarks/coupled.py                 # everything, about a minute on 2 cores
    python benchmarks/coupled.py --quick         # a small window, n = 1 2 4: a smoke test
    python benchmarks/coupled.py --ns 1 4 16 --rounds 9 --out /tmp/coupled.json

The model is a small transformer sentence encoder (token embeddings and learned positions, a
2-layer ``nn.TransformerEncoder``, d_model 64, 4 heads, feed-forward 256, no dropout, mean
pooling, a linear projection, L2 normalisation; 0.17M parameters), on ``--seq`` tokens per
sentence. The loss is multiple-negatives ranking (InfoNCE with in-batch negatives, the loss of
sentence-transformers' ``MultipleNegativesRankingLoss``): each anchor ``a_i`` against every
positive ``b_j`` of the global window, cosine similarity times 20, target ``j = i``, the mean over
the anchors. A positive is its anchor with a quarter of its tokens replaced at random. The window
is fixed (``--window`` pairs); ``n`` micro-batches split it, so a micro-batch has ``window / n``
pairs.

Four sections, in one run:

1. Exactness and naive accumulation (float64, one process). For each ``n``: the relative error
   (``||g - g_whole|| / ||g_whole||`` over all parameters) of ``coupled``'s gradient against the
   whole-batch gradient, and of naive accumulation: ``accumulate`` of each micro-batch's own
   InfoNCE (its anchors against its own positives only), the loss value too.
2. Memory (float32, one process). The peak of the live heap (glibc's ``mallinfo2``, as in
   sharded.py: read after every module's forward and by a thread every ~1 ms) during one window,
   minus the live heap just before it (params, data and nothing else): ``coupled`` for each
   ``n``; the whole batch (one forward and backward of the window, the same for every ``n``);
   and plain ``accumulate`` of a per-example loss (the squared distance of each anchor's
   embedding to its positive's) for comparison. Each runs once before it is measured.
3. Time (float32, one process, one thread). ``coupled``, plain ``accumulate`` of the per-example
   loss at the same ``n`` (the same encoder calls, one pass), and the whole batch, interleaved
   round-robin (``--rounds`` rounds, the order rotating), the median per cell.
4. Two ranks (float64, gloo on 127.0.0.1, two processes started once). The global window is
   split between the ranks (``rows.per_rank``), each rank's share over ``n`` micro-batches:
   ``coupled(..., sync=gradaccum.all_reduce())`` against the whole-batch gradient of the global
   window, and the classic ``all_gather``-without-gradient form (each rank embeds its rows with
   a graph, gathers the other ranks' embeddings as constants, back-propagates its own share and
   the gradients are summed over the ranks: the terms of the other ranks' shares for its rows
   are dropped). The collectives of ``coupled``'s first and second window are counted with
   ``gradaccum.sync.record_collectives()`` and listed.

The exit status is 1 when ``coupled``'s gradient differs from the whole batch's by more than
1e-12 (relative, float64) in one or two processes.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import _launch
import suite
import torch
import torch.distributed as dist
import torch.nn.functional as F
from sharded import Sampler
from torch import nn
from torch.func import functional_call

import gradaccum

MIB = 2**20
SCALE = 20.0  # sentence-transformers' default: cosine similarity times 20
TOL = 1e-12  # coupled against the whole batch, relative, float64
STEPS = ("coupled", "accumulate", "whole")


# ------------------------------------------------------------------------ model, data, losses


class Encoder(nn.Module):
    """Token ids ``[rows, seq]`` -> unit embeddings ``[rows, d]``."""

    def __init__(self, vocab: int, seq: int, d: int, heads: int, ff: int, layers: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(0.02 * torch.randn(seq, d))
        layer = nn.TransformerEncoderLayer(d, heads, ff, dropout=0.0, batch_first=True)
        self.body = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.proj = nn.Linear(d, d)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.body(self.tok(ids) + self.pos)
        return F.normalize(self.proj(h.mean(dim=1)), dim=-1)


class Task:
    """The encoder, its params in a dtype, a window of pairs, and the step functions."""

    def __init__(self, args: argparse.Namespace, dtype: torch.dtype, window: int) -> None:
        torch.manual_seed(0)
        self.model = Encoder(args.vocab, args.seq, 64, 4, 256, 2).to(dtype)
        self.params = {k: v.detach() for k, v in gradaccum.params_of(self.model).items()}
        self.window = window
        gen = torch.Generator().manual_seed(1)
        anchors = torch.randint(0, args.vocab, (window, args.seq), generator=gen)
        swap = torch.rand(window, args.seq, generator=gen) < 0.25
        noise = torch.randint(0, args.vocab, (window, args.seq), generator=gen)
        self.batch = (anchors, torch.where(swap, noise, anchors))

    def embed(self, params: dict[str, torch.Tensor], pairs: Any) -> dict[str, torch.Tensor]:
        """``coupled``'s ``embed``: both sides of the micro-batch's pairs."""
        a, b = pairs
        return {
            "a": functional_call(self.model, params, (a,)),
            "b": functional_call(self.model, params, (b,)),
        }

    @staticmethod
    def loss(params: Any, reps: dict[str, torch.Tensor], rows: gradaccum.Rows) -> torch.Tensor:
        """``coupled``'s ``loss``: this rank's anchors against every positive of the window."""
        sim = SCALE * reps["a"][rows.local] @ reps["b"].T
        target = rows.arange(sim.device)
        return F.cross_entropy(sim, target, reduction="sum") / rows.total

    def whole(self, params: dict[str, torch.Tensor], pairs: Any) -> torch.Tensor:
        """The objective on ``pairs`` as one batch (InfoNCE over its own rows)."""
        rows = len(pairs[0])
        return self.loss(params, self.embed(params, pairs), gradaccum.Rows(0, rows, rows, (rows,)))

    def per_example(self, params: dict[str, torch.Tensor], pairs: Any) -> torch.Tensor:
        """A loss that is a mean over pairs: what plain accumulation is exact for."""
        reps = self.embed(params, pairs)
        return (reps["a"] - reps["b"]).pow(2).sum(dim=-1).mean()

    def steps(self, n: int) -> dict[str, Callable[[], Any]]:
        """The three window steps compared for memory and time, on this task's window."""
        p, batch = self.params, self.batch
        step = gradaccum.coupled(self.embed, self.loss, n)
        plain = gradaccum.accumulate(gradaccum.grad(self.per_example), n)
        return {
            "coupled": lambda: step(p, batch),
            "accumulate": lambda: plain(p, batch),
            "whole": lambda: gradaccum.grad(self.whole)(p, batch),
        }


def _norm(tree: dict[str, torch.Tensor]) -> float:
    return math.sqrt(sum(float(v.double().pow(2).sum()) for v in tree.values()))


def rel_err(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    """``||got - want|| / ||want||`` over every leaf."""
    return _norm({k: got[k] - want[k] for k in want}) / _norm(want)


def cosine(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    dot = sum(float((got[k].double() * want[k].double()).sum()) for k in want)
    return dot / (_norm(got) * _norm(want))


# ------------------------------------------------------------------- 1. exactness and naive


def exactness(args: argparse.Namespace) -> list[dict[str, float]]:
    task = Task(args, torch.float64, args.window)
    p, batch = task.params, task.batch
    true_grads, true_loss = gradaccum.grad_and_value(task.whole)(p, batch)
    out = []
    for n in args.ns:
        grads, value = gradaccum.coupled(task.embed, task.loss, n)(p, batch)
        # Naive: each micro-batch's own InfoNCE (its anchors against its own positives only).
        naive, naive_loss = gradaccum.accumulate(gradaccum.grad_and_value(task.whole), n)(p, batch)
        out.append(
            {
                "n": n,
                "rows_per_micro_batch": args.window // n,
                "coupled_grad_rel_err": rel_err(grads, true_grads),
                "coupled_loss_abs_err": abs(float(value) - float(true_loss)),
                "true_loss": float(true_loss),
                "naive_loss": float(naive_loss),
                "naive_loss_rel_err": abs(float(naive_loss) - float(true_loss)) / float(true_loss),
                "naive_grad_rel_err": rel_err(naive, true_grads),
                "naive_grad_cosine": cosine(naive, true_grads),
                "naive_grad_norm_ratio": _norm(naive) / _norm(true_grads),
            }
        )
    return out


# ---------------------------------------------------------------------------- 2. memory


def _peak(live: Callable[[], float], run: Callable[[], Any]) -> float:
    """MiB of live heap above the start that one call of ``run`` peaks at (after a warm-up)."""
    run()  # once before: one-off allocations (autograd's, the first call's) are not counted
    gc.collect()
    base = live()
    sampler = Sampler(live)
    hook = nn.modules.module.register_module_forward_hook(lambda *_: sampler.point())
    try:
        with sampler:
            sampler.point()
            result = run()
            sampler.point()
            del result
    finally:
        hook.remove()
    return (sampler.peak - base) / MIB


def memory(args: argparse.Namespace) -> dict[str, Any]:
    live = suite._heap_bytes()
    if live is None:
        raise RuntimeError("glibc's mallinfo2 is not available: no live-heap measurement")
    # A fixed window split into n micro-batches: coupled holds one micro-batch's activations.
    task = Task(args, torch.float32, args.window)
    window: dict[str, dict[int, float]] = {k: {} for k in STEPS}
    for n in args.ns:
        for name, run in task.steps(n).items():
            if name != "whole" or not window["whole"]:  # the whole batch is the same for any n
                window[name][n] = _peak(live, run)
    # A fixed micro-batch, the window n of them: coupled stays flat, the whole batch grows.
    micro = args.window // max(args.ns)
    fixed: dict[str, dict[int, float]] = {"coupled": {}, "whole": {}}
    for n in args.ns:
        steps = Task(args, torch.float32, micro * n).steps(n)
        for name in fixed:
            fixed[name][n] = _peak(live, steps[name])
    dt = torch.float32.itemsize
    d = task.model.proj.out_features
    return {
        "window": window,
        "micro": micro,
        "fixed_micro": fixed,
        "params_mib": sum(v.numel() * dt for v in task.params.values()) / MIB,
        # What coupled keeps for the whole window besides one micro-batch's activations.
        "window_reps_mib": 2 * args.window * d * dt / MIB,
        "similarity_mib": args.window * args.window * dt / MIB,
        "inputs_mib": sum(t.numel() * t.element_size() for t in task.batch) / MIB,
    }


# ------------------------------------------------------------------------------ 3. time


def timing(args: argparse.Namespace) -> dict[str, Any]:
    task = Task(args, torch.float32, args.window)
    runs = {n: task.steps(n) for n in args.ns}
    times: dict[str, dict[int, list[float]]] = {k: {n: [] for n in args.ns} for k in STEPS}
    for n in args.ns:
        for run in runs[n].values():
            run()  # warm-up
    for r in range(args.rounds):
        for n in args.ns:
            names = STEPS[r % len(STEPS) :] + STEPS[: r % len(STEPS)]
            for name in names:
                t0 = time.perf_counter()
                runs[n][name]()
                times[name][n].append(time.perf_counter() - t0)
    coupled = times["coupled"]
    return {
        "median_ms": {
            k: {n: 1e3 * statistics.median(v) for n, v in c.items()} for k, c in times.items()
        },
        # The median of the same round's ratios: load on the machine hits both sides alike.
        "paired_ratio": {
            k: {
                n: statistics.median(c / o for c, o in zip(coupled[n], times[k][n]))
                for n in args.ns
            }
            for k in ("accumulate", "whole")
        },
    }


# --------------------------------------------------------------------------- 4. two ranks


def _ranks_job(rank: int, world: int, job: dict[str, Any]) -> dict[str, Any]:
    args = argparse.Namespace(**job["args"])
    task = Task(args, torch.float64, args.window)
    p, (a, b) = task.params, task.batch
    true_grads = gradaccum.grad(task.whole)(p, (a, b))
    per_rank = [len(part) for part in torch.arange(args.window).tensor_split(world)]
    start = sum(per_rank[:rank])
    mine = (a[start : start + per_rank[rank]], b[start : start + per_rank[rank]])
    rows = gradaccum.Rows(start, start + per_rank[rank], args.window, tuple(per_rank), rank)
    out: dict[str, Any] = {"per_rank": per_rank, "coupled": {}, "collectives": {}}
    for n in job["ns"]:
        step = gradaccum.coupled(task.embed, task.loss, n, sync=gradaccum.all_reduce())
        logs = []
        for _ in range(2):
            with gradaccum.sync.record_collectives() as rec:
                grads, value = step(p, mine)
            logs.append(
                [
                    {
                        "kind": c.kind,
                        "purpose": c.purpose,
                        "dtype": str(c.dtype).removeprefix("torch."),
                        "numel": c.numel,
                        "nbytes": c.nbytes,
                    }
                    for c in rec
                ]
            )
        out["coupled"][n] = rel_err(grads, true_grads)
        out["collectives"][n] = logs
    # The classic bug: the other ranks' embeddings gathered without a gradient.
    leaves = {k: v.detach().requires_grad_() for k, v in p.items()}
    reps = task.embed(leaves, mine)
    everyone = {}
    for key, z in reps.items():
        parts = [z.new_empty(r, *z.shape[1:]) for r in per_rank]
        dist.all_gather(parts, z.detach().contiguous())
        parts[rank] = z  # only this rank's own rows carry a graph
        everyone[key] = torch.cat(parts)
    share = task.loss(leaves, everyone, rows)
    dropped = dict(zip(leaves, torch.autograd.grad(share, list(leaves.values()))))
    for g in dropped.values():
        dist.all_reduce(g)
    out["dropped"] = rel_err(dropped, true_grads)
    out["dropped_cosine"] = cosine(dropped, true_grads)
    return out


def two_ranks(args: argparse.Namespace) -> dict[str, Any]:
    job = {"args": vars(args), "ns": args.rank_ns, "pg_timeout": 60}
    results = _launch.launch(_ranks_job, job, 2, timeout=300, what="coupled on 2 ranks")
    return {
        "per_rank": results[0]["per_rank"],
        "coupled": {n: max(r["coupled"][n] for r in results) for n in args.rank_ns},
        "dropped": max(r["dropped"] for r in results),
        "dropped_cosine": min(r["dropped_cosine"] for r in results),
        "collectives": results[0]["collectives"],
    }


# ------------------------------------------------------------------------------ the parent


def _table(header: list[str], rows: list[list[str]], left: int = 1) -> None:
    """A markdown table; the first ``left`` columns are text (left-aligned), the rest numbers."""
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join("---" if i < left else "---:" for i in range(len(header))) + "|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    print()


def report(args: argparse.Namespace, res: dict[str, Any]) -> None:
    params = sum(v.numel() for v in Task(args, torch.float32, 2).params.values())
    print(
        f"encoder: {params / 1e6:.2f}M params, {args.seq} tokens per sentence; window "
        f"{args.window} pairs; torch {torch.__version__}, {platform.machine()}\n"
    )
    print("1. exactness and naive accumulation (float64; relative errors against the whole batch)")
    _table(
        [
            "n",
            "pairs per micro-batch",
            "coupled: gradient",
            "naive: loss",
            "naive: gradient",
            "naive: cosine",
            "naive: norm / true norm",
        ],
        [
            [
                str(r["n"]),
                str(r["rows_per_micro_batch"]),
                f"{r['coupled_grad_rel_err']:.1e}",
                f"{r['naive_loss_rel_err']:.3f}",
                f"{r['naive_grad_rel_err']:.3f}",
                f"{r['naive_grad_cosine']:.3f}",
                f"{r['naive_grad_norm_ratio']:.3f}",
            ]
            for r in res["exactness"]
        ],
    )
    first = res["exactness"][0]
    print(
        f"the true loss: {first['true_loss']:.4f}; naive loss by n: "
        + ", ".join(f"{r['n']}: {r['naive_loss']:.4f}" for r in res["exactness"])
        + "\n"
    )
    mem = res["memory"]
    cells, whole = mem["window"], mem["window"]["whole"][args.ns[0]]
    print(
        f"2a. peak memory, a window of {args.window} pairs in n micro-batches (float32; live heap "
        f"above the params and data, MiB)"
    )
    _table(
        ["n", "coupled", "whole batch", "coupled / whole batch", "accumulate (per-example loss)"],
        [
            [
                str(n),
                f"{cells['coupled'][n]:.1f}",
                f"{whole:.1f}",
                f"{cells['coupled'][n] / whole:.2f}",
                f"{cells['accumulate'][n]:.1f}",
            ]
            for n in args.ns
        ],
    )
    print(
        f"kept for the whole window by coupled: representations {1024 * mem['window_reps_mib']:.0f}"
        f" KiB, the similarity matrix {1024 * mem['similarity_mib']:.0f} KiB (and its gradient), "
        f"the inputs {1024 * mem['inputs_mib']:.0f} KiB; params {mem['params_mib']:.2f} MiB\n"
    )
    fixed, n0 = mem["fixed_micro"], args.ns[0]
    print(
        f"2b. peak memory, micro-batches of {mem['micro']} pairs, a window of n of them "
        f"(float32, MiB)"
    )
    _table(
        ["n", "window", "coupled", f"coupled vs n={n0}", "whole batch", f"whole batch vs n={n0}"],
        [
            [
                str(n),
                str(n * mem["micro"]),
                f"{fixed['coupled'][n]:.1f}",
                f"{fixed['coupled'][n] / fixed['coupled'][n0]:.2f}",
                f"{fixed['whole'][n]:.1f}",
                f"{fixed['whole'][n] / fixed['whole'][n0]:.2f}",
            ]
            for n in args.ns
        ],
    )
    t, ratio = res["time"]["median_ms"], res["time"]["paired_ratio"]
    print(
        f"3. time per window (float32, 1 thread; median of {args.rounds} rounds, ms; the ratios "
        f"are medians of the same round's ratios)"
    )
    _table(
        [
            "n",
            "coupled",
            "accumulate (per-example loss)",
            "whole batch",
            "coupled / accumulate",
            "coupled / whole batch",
        ],
        [
            [
                str(n),
                f"{t['coupled'][n]:.1f}",
                f"{t['accumulate'][n]:.1f}",
                f"{t['whole'][n]:.1f}",
                f"{ratio['accumulate'][n]:.2f}",
                f"{ratio['whole'][n]:.2f}",
            ]
            for n in args.ns
        ],
    )
    ranks = res["two_ranks"]
    print(
        f"4. two gloo ranks (float64; rows per rank {ranks['per_rank']}; relative gradient "
        f"error against the whole batch of the global window)"
    )
    _table(
        ["form", "n per rank", "gradient"],
        [["coupled(sync=all_reduce())", str(n), f"{ranks['coupled'][n]:.1e}"] for n in args.rank_ns]
        + [
            [
                "all_gather without gradient (cross-rank terms dropped)",
                "1",
                f"{ranks['dropped']:.3f} (cosine {ranks['dropped_cosine']:.3f})",
            ]
        ],
    )
    print("collectives per window of coupled on 2 ranks (rank 0; record_collectives()):")
    for n in args.rank_ns:
        for w, log in enumerate(ranks["collectives"][n]):
            print(
                f"  n={n}, window {w}: {len(log)} collectives, "
                f"{sum(c['nbytes'] for c in log)} bytes"
            )
    for w, log in enumerate(ranks["collectives"][args.rank_ns[-1]]):
        print(f"window {w} of n={args.rank_ns[-1]}:")
        _table(
            ["kind", "purpose", "dtype", "elements", "bytes"],
            [[c["kind"], c["purpose"], c["dtype"], str(c["numel"]), str(c["nbytes"])] for c in log],
            left=3,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ns", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--rank-ns", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--window", type=int, default=128, help="pairs in the global window")
    parser.add_argument("--seq", type=int, default=32, help="tokens per sentence")
    parser.add_argument("--vocab", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=9, help="timing rounds")
    parser.add_argument("--quick", action="store_true", help="a small window, n = 1 2 4")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    args = parser.parse_args()
    if args.quick:
        args.ns, args.rank_ns, args.window, args.seq, args.rounds = [1, 2, 4], [1, 2], 32, 16, 2
    bad = [n for n in args.ns + args.rank_ns if args.window % n or n < 1]
    if bad:
        parser.error(f"--window {args.window} does not split into n micro-batches for n in {bad}")
    torch.set_num_threads(1)
    started = time.perf_counter()
    res = {
        "exactness": exactness(args),
        "memory": memory(args),
        "time": timing(args),
        "two_ranks": two_ranks(args),
    }
    report(args, res)
    print(f"({time.perf_counter() - started:.0f} s)")
    if args.out:
        args.out.write_text(
            json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, **res}, indent=1)
        )
    worst = max(
        [r["coupled_grad_rel_err"] for r in res["exactness"]]
        + list(res["two_ranks"]["coupled"].values())
    )
    if worst > TOL:
        print(f"FAIL: coupled's gradient is {worst:.1e} from the whole batch's (tolerance {TOL})")
        sys.exit(1)


if __name__ == "__main__":
    main()
