"""The benchmark suite: gradaccum against DDP, Accelerate and hand-written loops, on CPU.

    python benchmarks/suite.py                          # everything, ~5-10 minutes on 2 cores
    python benchmarks/suite.py --quick                  # tiny models, few steps: a smoke test
    python benchmarks/suite.py --models lm --ns 1 8 --strategies ddp-no_sync gradaccum
    python benchmarks/suite.py --no-memory --steps 30 --out /tmp/bench

Three sections per model (``mlp``: ~3.2M-parameter MLP, 32 rows per micro-batch per rank;
``lm``: ~1.1M-parameter causal transformer LM, 8 x 64 tokens per micro-batch per rank), each
over the accumulation steps ``n`` (``--ns``). The micro-batch is fixed, so the batch per rank is
``n`` micro-batches. Every strategy has its own copy of the same initial model, sees the same
batches and steps ``torch.optim.SGD(lr=0.01, momentum=0.9)`` once per batch.

1. Two processes (gloo on 127.0.0.1, 1 thread each; each rank gets its own shard of every
   global batch):

   - ``ddp-naive``: torch DDP, syncing every micro-batch;
   - ``ddp-no_sync``: DDP, forward and backward inside ``no_sync()`` except the last micro-batch
     (the reference of the ratios);
   - ``ddp-twin``: ``ddp-no_sync`` again, on its own copy of the model: a control. Its ratio
     is this run's noise floor (two identical strategies differ by 5-7% in single rounds on 2
     cores), against which the others are read;
   - ``accelerate``: Hugging Face Accelerate, ``Accelerator(cpu=True,
     gradient_accumulation_steps=n)``, ``with accelerator.accumulate(model)``,
     ``accelerator.backward(loss)``, ``optimizer.step()`` / ``zero_grad()`` per micro-batch;
   - ``hand``: ``(loss * rows / B).backward()`` per micro-batch, then one flat all-reduce;
   - ``gradaccum-func``: ``accumulate(torch.func.grad_and_value(loss_fn), n, has_aux=True,
     sync=all_reduce())``, ``write_grads``, ``optimizer.step()`` (accumulate recognises the
     torch.func function and runs it on its autograd fast path);
   - ``gradaccum-tree``: the same step function wrapped in a lambda, so that accumulate cannot
     recognise it: the path of any step function that returns a gradient tree;
   - ``gradaccum``: the same over ``gradaccum.grad_and_value`` (torch.autograd; gradients written
     in place into the boundary buckets, the boundary all-reduce overlapping the last backward);
   - ``gradaccum-no-overlap``: ``gradaccum`` with ``all_reduce(overlap=False)``.

2. One process (no process group): ``hand`` (backward into ``.grad``, no collective),
   ``gradaccum``, ``gradaccum-func`` and ``gradaccum-tree`` (``sync=None``); the reference is
   ``hand``.

3. Memory: every (strategy, model, n) in a fresh process (a fresh pair for the two-process
   strategies) running a few optimizer steps.

How the timing is taken: all strategies of a section run interleaved in one set of processes,
round-robin, one optimizer step each per round (the order rotating every round), after one
warm-up step each, so machine drift hits all alike. Two-process steps start together (a barrier
before each) and a step's time is the slower rank's. Tables show the median over ``--steps``
rounds; results.json also keeps every step time and ``paired_ratio``, the median of the
same-round ratios. Other load on the machine shows up as noise: run it on a quiet one.
``--rounds K`` runs each timing section K times, each in fresh processes, and adds a table of
the paired ratio's median and range over the K rounds: on a small shared machine one round's
ratio moves by up to +-0.05-0.1, more than most differences worth measuring.

How to read the output, per model:

- ``step time``: median ms per optimizer step, and in parentheses its ratio to the median of
  the section's reference (``ddp-no_sync``, or ``hand`` with one process); below 1.00 is faster.
- ``collectives``: per optimizer step and rank, the collectives issued and the MiB they carry,
  counted in a separate untimed pass (a counting comm hook on fresh DDP / Accelerate models,
  ``gradaccum.sync.record_collectives()``, the hand loop's own calls).
- ``params``: the largest absolute parameter difference from the reference after all the steps
  (float32; "!" marks one above 1e-4 relative to the largest parameter). A strategy computing
  another gradient would drift far above that.
- ``memory``: the peak of the live heap (bytes that glibc's malloc has handed out and not taken
  back, ``mallinfo2``; sampled after each forward, when each backward starts and after each
  optimizer step) minus the live heap right after set-up (model, optimizer, data and wrappers
  built, no step run yet), MiB per process (the larger rank's), over ``--memory-steps`` steps,
  and its ratio to the same strategy at the first n. The first step's one-off allocations
  (gradients, momentum buffers, accumulators, DDP's buckets) are included, so compare a
  strategy with itself across n. The peak RSS growth is printed too, but it is coarse (the
  allocator keeps freed pages: expect +-10 MiB).

Outputs: ``<out>/results.json`` (machine, settings, every step time, medians, ratios,
collectives, parameter differences, memory) and ``<out>/benchmarks.png`` (per model: the
step-time ratios against n for both sections, and the memory growth against n), whose PNG
metadata names results.json and its SHA-256 (``tests/test_figures.py`` checks that they agree).
``--replot`` redraws the figure from ``<out>/results.json`` without running anything. The exit
status is 1 when some strategy's parameters disagree with the reference.

Processes are started with torch.multiprocessing's ``forkserver`` (a server that imported torch
once forks each fresh process in milliseconds, so the many memory configurations stay cheap).
``accelerate`` is skipped, with a note, when it is not installed (``pip install gradaccum[bench]``).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import datetime
import gc
import json
import os
import platform
import resource
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import _bench_models as bm
import _figures
import _launch
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.func import functional_call
from torch.nn.parallel import DistributedDataParallel as DDP

import gradaccum

TWO_PROC = (
    "ddp-naive",
    "ddp-no_sync",
    "ddp-twin",
    "accelerate",
    "hand",
    "gradaccum-func",
    "gradaccum-tree",
    "gradaccum",
    "gradaccum-no-overlap",
)
ONE_PROC = ("hand", "gradaccum", "gradaccum-func", "gradaccum-tree")
ALL = tuple(dict.fromkeys(TWO_PROC + ONE_PROC))
LR, MOMENTUM = 0.01, 0.9
REL_TOL = 1e-4  # parameters agree when max |a - b| <= REL_TOL * max |reference|
N_BATCHES = 4  # distinct global batches cycled through (pre-generated: no RNG in the timing)
REPO = Path(__file__).resolve().parent.parent


# --------------------------------------------------------------------------- what is available


def has_accelerate() -> bool:
    try:
        import accelerate  # noqa: F401
    except Exception:  # noqa: BLE001 - not installed, or broken against this torch
        return False
    return True


# --------------------------------------------------------------------------------- strategies


@dataclass(frozen=True)
class Strategy:
    module: torch.nn.Module  # the unwrapped model (DDP and Accelerate share its parameters)
    step: Callable[[bm.Batch], None]  # one optimizer step over a rank's batch (n micro-batches)


def _record(log: list[dict[str, Any]], kind: str, numel: int, nbytes: int, purpose: str) -> None:
    log.append({"kind": kind, "numel": numel, "nbytes": nbytes, "purpose": purpose})


def _counting_hook(log, bucket):  # no annotations: DDP checks them against its own types
    buf = bucket.buffer()
    _record(log, "all_reduce", buf.numel(), buf.numel() * buf.element_size(), "gradients")
    return default_hooks.allreduce_hook(None, bucket)  # type: ignore[arg-type]


def _micro(batch: bm.Batch, n: int) -> list[bm.Batch]:
    return list(zip(batch[0].chunk(n), batch[1].chunk(n), strict=True))


def make_strategy(
    name: str, spec: bm.ModelSpec, n: int, world: int, log: list[dict[str, Any]] | None = None
) -> Strategy:
    """Build ``name`` over a fresh copy of the model; with ``log``, count its collectives."""
    model = spec.build()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    loss = spec.loss

    if name in ("ddp-naive", "ddp-no_sync", "ddp-twin"):
        ddp = DDP(model)
        if log is not None:
            ddp.register_comm_hook(log, _counting_hook)
        quiet = name != "ddp-naive"  # ddp-twin: ddp-no_sync again, on its own copy

        def ddp_step(batch: bm.Batch) -> None:
            opt.zero_grad(set_to_none=True)
            for i, (xb, yb) in enumerate(_micro(batch, n)):
                with ddp.no_sync() if quiet and i < n - 1 else contextlib.nullcontext():
                    (loss(ddp(xb), yb) / n).backward()
            opt.step()

        return Strategy(model, ddp_step)

    if name == "accelerate":
        from accelerate import Accelerator

        accelerator = Accelerator(cpu=True, gradient_accumulation_steps=n)
        wrapped, acc_opt = accelerator.prepare(model, opt)
        if log is not None:
            if not isinstance(wrapped, DDP):
                raise RuntimeError(f"Accelerate did not wrap the model in DDP: {type(wrapped)}")
            wrapped.register_comm_hook(log, _counting_hook)

        def accelerate_step(batch: bm.Batch) -> None:
            # As Accelerate's docs write it: step and zero_grad every micro-batch; the prepared
            # optimizer acts only at the boundary, and backward divides the loss by n.
            for xb, yb in _micro(batch, n):
                with accelerator.accumulate(wrapped):
                    accelerator.backward(loss(wrapped(xb), yb))
                    acc_opt.step()
                    acc_opt.zero_grad()

        return Strategy(model, accelerate_step)

    if name == "hand":
        plist = list(model.parameters())

        def hand_step(batch: bm.Batch) -> None:
            opt.zero_grad(set_to_none=True)
            rows = len(batch[0])
            for xb, yb in _micro(batch, n):
                (loss(model(xb), yb) * (len(xb) / rows)).backward()
            if world > 1:
                grads = [p.grad for p in plist]
                flat = _flatten_dense_tensors(grads)
                dist.all_reduce(flat)
                if log is not None:
                    nbytes = flat.numel() * flat.element_size()
                    _record(log, "all_reduce", flat.numel(), nbytes, "gradients")
                flat.div_(world)
                for g, f in zip(grads, _unflatten_dense_tensors(flat, grads), strict=True):
                    g.copy_(f)
            opt.step()

        return Strategy(model, hand_step)

    if name in ("gradaccum", "gradaccum-func", "gradaccum-tree", "gradaccum-no-overlap"):
        params = gradaccum.params_of(model)

        def loss_fn(p: dict[str, torch.Tensor], batch: bm.Batch) -> torch.Tensor:
            xb, yb = batch
            return loss(functional_call(model, p, (xb,)), yb)

        gv: Any = gradaccum.grad_and_value
        if name == "gradaccum-func":  # recognised by accumulate: the same fast path
            gv = torch.func.grad_and_value
        elif name == "gradaccum-tree":  # any function returning a gradient tree: the tree path

            def gv(f: Any) -> Any:
                inner = torch.func.grad_and_value(f)
                return lambda p, b: inner(p, b)

        if world == 1:
            sync = None
        elif name == "gradaccum-no-overlap":
            sync = gradaccum.all_reduce(overlap=False)
        else:
            sync = gradaccum.all_reduce()
        accumulated = gradaccum.accumulate(gv(loss_fn), n, has_aux=True, sync=sync)

        def ga_step(batch: bm.Batch) -> None:
            # Free the last step's gradients before the window allocates its sums, as the other
            # strategies do (write_grads replaces .grad, so this is for memory only).
            opt.zero_grad(set_to_none=True)
            if log is None:
                grads, _ = accumulated(params, batch)
            else:
                with gradaccum.sync.record_collectives() as rec:
                    grads, _ = accumulated(params, batch)
                for c in rec:
                    _record(log, c.kind, c.numel, c.nbytes, c.purpose)
            gradaccum.write_grads(model, grads)
            opt.step()

        return Strategy(model, ga_step)

    raise ValueError(f"unknown strategy {name!r}")


def _batches(
    spec: bm.ModelSpec, n: int, rank: int, world: int, count: int, micro: int | None = None
) -> list[bm.Batch]:
    """``count`` global batches (seeded by n and index); this rank's shard of each."""
    rows = (micro or spec.micro) * n
    out = []
    for i in range(count):
        gen = torch.Generator().manual_seed(10_000 * n + i)
        x, y = spec.make_batch(gen, rows * world)
        out.append((x[rank * rows : (rank + 1) * rows], y[rank * rows : (rank + 1) * rows]))
    return out


# ----------------------------------------------------------------------------- jobs on a rank


def _time_job(rank: int, world: int, job: dict[str, Any]) -> dict[int, Any]:
    spec = bm.spec(job["model"], job["quick"])
    return {n: _time_n(rank, world, spec, n, job) for n in job["ns"]}


def _time_n(rank: int, world: int, spec: bm.ModelSpec, n: int, job: dict[str, Any]) -> Any:
    names: list[str] = list(job["strategies"])
    batches = _batches(spec, n, rank, world, N_BATCHES)
    strategies = {name: make_strategy(name, spec, n, world) for name in names}
    for name in names:  # warm-up: DDP builds its buckets, gradaccum checks the tree once
        strategies[name].step(batches[0])
    times: dict[str, list[float]] = {name: [] for name in names}
    gc.collect()
    gc.disable()
    try:
        for s in range(job["steps"]):
            batch = batches[(s + 1) % N_BATCHES]
            k = s % len(names)
            for name in names[k:] + names[:k]:
                if world > 1:
                    dist.barrier()
                t0 = time.perf_counter()
                strategies[name].step(batch)
                times[name].append(time.perf_counter() - t0)
            gc.collect()
    finally:
        gc.enable()

    ref = [p.detach() for p in strategies[job["ref"]].module.parameters()]
    scale = max(float(p.abs().max()) for p in ref)
    diffs = {}
    for name in names:
        mine = [p.detach() for p in strategies[name].module.parameters()]
        diffs[name] = max(float((a - b).abs().max()) for a, b in zip(ref, mine, strict=True))
    del strategies

    # Collectives, in an untimed pass over fresh models: one micro-batch row is enough (what
    # goes on the wire depends on the parameters, not on the rows). The first step (DDP's
    # bucket rebuild, gradaccum's one tree check) is left out.
    count_batch = _batches(spec, n, rank, world, 1, micro=1)[0]
    collectives = {}
    for name in names:
        log: list[dict[str, Any]] = []
        strategy = make_strategy(name, spec, n, world, log)
        strategy.step(count_batch)
        log.clear()
        strategy.step(count_batch)
        collectives[name] = log
        del strategy
    return {"times": times, "diffs": diffs, "scale": scale, "collectives": collectives}


def _rss_kib() -> float:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1024
    except OSError:  # not Linux: the high-water mark so far
        return float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)


def _maxrss_kib() -> float:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 1024 if sys.platform == "darwin" else float(peak)  # bytes on macOS


class _Mallinfo2(ctypes.Structure):
    _fields_ = [  # noqa: RUF012 - glibc's struct mallinfo2, all size_t
        (name, ctypes.c_size_t)
        for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
            "fsmblks", "uordblks", "fordblks", "keepcost",
        )
    ]  # fmt: skip


def _heap_bytes() -> Callable[[], float] | None:
    """Bytes malloc has handed out and not taken back (glibc's mallinfo2), or None."""
    try:
        libc = ctypes.CDLL(None)
        fn = libc.mallinfo2
    except (OSError, AttributeError):
        return None
    fn.restype = _Mallinfo2

    def live() -> float:
        info = fn()
        return float(info.uordblks + info.hblkhd)

    return live


def _memory_job(rank: int, world: int, job: dict[str, Any]) -> dict[str, float]:
    spec = bm.spec(job["model"], job["quick"])
    n = job["n"]
    live = _heap_bytes()
    peak_live = [0.0]

    def sample(*_: Any) -> None:
        if live is not None:
            peak_live[0] = max(peak_live[0], live())

    def sampled_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        # Sampled where a step's memory peaks: after the forward (the micro-batch's activations
        # alive) and when backward starts (plus the first activation gradients).
        if out.requires_grad:
            out.register_hook(sample)
        value = spec.loss(out, y)
        sample()
        return value

    batches = _batches(spec, n, rank, world, 2)
    strategy = make_strategy(
        job["strategy"], dataclasses.replace(spec, loss=sampled_loss), n, world
    )
    gc.collect()
    base = _rss_kib()
    base_live = live() if live is not None else float("nan")
    for s in range(job["steps"]):
        strategy.step(batches[s % 2])
        sample()  # after the optimizer step: gradients, accumulators, optimizer state
    peak = _maxrss_kib()
    return {
        "base_mib": base / 1024,
        "peak_mib": peak / 1024,
        "growth_mib": (peak - base) / 1024,
        "live_growth_mib": (peak_live[0] - base_live) / 2**20 if live is not None else float("nan"),
    }


JOBS = {"time": _time_job, "memory": _memory_job}


def launch(job: dict[str, Any], world: int, timeout: float) -> list[Any]:
    """The suite's job of ``job["kind"]`` on ``world`` fresh processes (``_launch.launch``)."""
    what = f"{job['kind']} job {job.get('model')} {job.get('strategy', '')} {job.get('n', '')}"
    return _launch.launch(JOBS[job["kind"]], job, world, timeout, what=what)


# ------------------------------------------------------------------------------ the parent


def _section(
    model: str, names: list[str], ref: str, world: int, args: argparse.Namespace
) -> dict[str, Any]:
    job = {
        "kind": "time",
        "model": model,
        "quick": args.quick,
        "ns": args.ns,
        "steps": args.steps,
        "strategies": names,
        "ref": ref,
        "pg_timeout": 600,
    }
    ranks = launch(job, world, timeout=3600)
    out: dict[str, Any] = {"reference": ref, "world": world, "strategies": {}}
    for name in names:
        per_n = {}
        for n in args.ns:
            # A step's time is the slower rank's (the ranks start each step together).
            steps = [max(ts) for ts in zip(*(r[n]["times"][name] for r in ranks), strict=True)]
            log = ranks[0][n]["collectives"][name]
            scale = ranks[0][n]["scale"]
            diff = max(r[n]["diffs"][name] for r in ranks)  # each rank checks its own copy
            per_n[str(n)] = {
                "median_ms": 1e3 * statistics.median(steps),
                "times_ms": [1e3 * t for t in steps],
                "collectives": len(log),
                "bytes": sum(c["nbytes"] for c in log),
                "collective_log": log,
                "param_max_abs_diff": diff,
                "param_rel_diff": diff / scale,
                "params_agree": diff <= REL_TOL * scale,
            }
        out["strategies"][name] = per_n
    for name in names:
        for n in args.ns:
            cell, base = out["strategies"][name][str(n)], out["strategies"][ref][str(n)]
            cell["ratio"] = cell["median_ms"] / base["median_ms"]
            # The median of the same-round ratios: robust to drift that spans a few rounds.
            pairs = zip(cell["times_ms"], base["times_ms"], strict=True)
            cell["paired_ratio"] = statistics.median(t / r for t, r in pairs)
    out["params_agree"] = all(
        c["params_agree"] for s in out["strategies"].values() for c in s.values()
    )
    return out


def _rounds(
    model: str, names: list[str], ref: str, world: int, args: argparse.Namespace
) -> dict[str, Any]:
    """``_section`` ``--rounds`` times (fresh processes each); the first, with every round's ratios.

    ``rounds``: each round's paired ratio per strategy and n; ``round_ratio``: their median, min
    and max. The parameters must agree with the reference in every round.
    """
    secs = [_section(model, names, ref, world, args) for _ in range(args.rounds)]
    out = secs[0]
    out["rounds"] = [
        {
            k: {n: c["paired_ratio"] for n, c in per_n.items()}
            for k, per_n in sec["strategies"].items()
        }
        for sec in secs
    ]
    out["round_ratio"] = {
        k: {
            n: {"median": statistics.median(r), "min": min(r), "max": max(r)}
            for n in out["rounds"][0][k]
            for r in [[rd[k][n] for rd in out["rounds"]]]
        }
        for k in names
    }
    out["params_agree"] = all(sec["params_agree"] for sec in secs)
    return out


def _table(title: str, names: list[str], ns: list[int], cell: Callable[[str, int], str]) -> None:
    print(title)
    print(f"  {'strategy':<22}" + "".join(f"{'n=' + str(n):>17}" for n in ns))
    for name in names:
        print(f"  {name:<22}" + "".join(f"{cell(name, n):>17}" for n in ns))


def _print_section(model: str, sec: dict[str, Any], ns: list[int], steps: int) -> None:
    s, ref = sec["strategies"], sec["reference"]
    names = list(s)
    where = "2 gloo processes" if sec["world"] > 1 else "1 process"
    _table(
        f"[{model}, {where}] step time: median ms of {steps} (ratio vs {ref})",
        names,
        ns,
        lambda k, n: f"{s[k][str(n)]['median_ms']:.1f} ({s[k][str(n)]['ratio']:.2f})",
    )
    rounds = sec.get("rounds", [])
    if len(rounds) > 1:
        rr = sec["round_ratio"]
        _table(
            f"[{model}, {where}] paired ratio vs {ref}: median [min-max] of {len(rounds)} rounds",
            names,
            ns,
            lambda k, n: (
                f"{rr[k][str(n)]['median']:.2f} [{rr[k][str(n)]['min']:.2f}-"
                f"{rr[k][str(n)]['max']:.2f}]"
            ),
        )
    if sec["world"] > 1:
        _table(
            f"[{model}, {where}] collectives per optimizer step and rank: count / MiB",
            names,
            ns,
            lambda k, n: f"{s[k][str(n)]['collectives']} / {s[k][str(n)]['bytes'] / 2**20:.2f}",
        )
    _table(
        f"[{model}, {where}] params: max |diff| vs {ref} after all steps ('!' > {REL_TOL:g} rel)",
        names,
        ns,
        lambda k, n: (
            f"{s[k][str(n)]['param_max_abs_diff']:.1e}"
            + ("" if s[k][str(n)]["params_agree"] else " !")
        ),
    )
    print(flush=True)


def _memory(model: str, names: list[str], world: int, args: argparse.Namespace) -> Any:
    out: dict[str, Any] = {}
    for name in names:
        out[name] = {}
        for n in args.memory_ns:
            job = {
                "kind": "memory",
                "model": model,
                "quick": args.quick,
                "n": n,
                "strategy": name,
                "steps": args.memory_steps,
                "pg_timeout": 300,
            }
            ranks = launch(job, world, timeout=900)
            worst = max(ranks, key=lambda r: (r["live_growth_mib"], r["growth_mib"]))
            out[name][str(n)] = {**worst, "ranks": ranks}
        first = out[name][str(args.memory_ns[0])]
        for cell in out[name].values():
            for key, ratio in (("growth_mib", "rss_ratio"), ("live_growth_mib", "ratio")):
                cell[ratio] = cell[key] / first[key] if first[key] > 0 else float("nan")
    return out


def _print_memory(model: str, mem: dict[str, Any], ns: list[int], steps: int) -> None:
    for section, where in (("two_process", "2 processes"), ("one_process", "1 process")):
        m = mem.get(section)
        if not m:
            continue
        _table(
            f"[{model}, {where}] memory: peak live heap - live heap after set-up (glibc "
            f"mallinfo2, sampled after each forward, as backward starts and after each step), "
            f"MiB per process, {steps} steps (ratio vs n={ns[0]})",
            list(m),
            ns,
            lambda k, n, m=m: (
                f"{m[k][str(n)]['live_growth_mib']:.1f} ({m[k][str(n)]['ratio']:.3f})"
            ),
        )
        _table(
            f"[{model}, {where}] memory: peak RSS - RSS after set-up, MiB per process "
            f"(coarse: the allocator keeps freed pages) (ratio vs n={ns[0]})",
            list(m),
            ns,
            lambda k, n, m=m: f"{m[k][str(n)]['growth_mib']:.1f} ({m[k][str(n)]['rss_ratio']:.2f})",
        )
    print(flush=True)


def _plot(results: dict[str, Any], path: Path, source: Path) -> bool:
    """Draw ``results`` (read from the file ``source``) to ``path``, stamped with its hash."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("note: matplotlib is not installed; no plot (pip install gradaccum[bench])")
        return False
    color = {name: f"C{i}" for i, name in enumerate(ALL)}  # one color per strategy everywhere

    def setup(ax: Any, title: str, ns: list[int]) -> None:
        ax.set_title(title, fontsize=10)
        ax.set_xscale("log", base=2)
        ax.set_xticks(ns, [str(n) for n in ns])
        ax.set_xlabel("accumulation steps n (micro-batch fixed)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)

    models = results["models"]
    fig, axes = plt.subplots(len(models), 3, figsize=(16, 4.5 * len(models)), squeeze=False)
    for row, (model, res) in zip(axes, models.items(), strict=True):
        for ax, key in zip(row[:2], ("two_process", "one_process"), strict=True):
            sec = res.get(key)
            if not sec:
                ax.set_visible(False)
                continue
            for name, per_n in sec["strategies"].items():
                ns = [int(n) for n in per_n]
                ratios = [c["ratio"] for c in per_n.values()]
                ax.plot(ns, ratios, marker="o", color=color[name], label=name)
            ax.axhline(1.0, color="grey", lw=0.8)
            where = "2 gloo processes" if key == "two_process" else "1 process"
            setup(ax, f"{model}, {where}: median step time / {sec['reference']}", ns)
        ax = row[2]
        mem = res.get("memory")
        if not mem:
            ax.set_visible(False)
            continue
        for key, ls, suffix in (("two_process", "-", ""), ("one_process", "--", " (1 proc)")):
            for name, per_n in mem.get(key, {}).items():
                ns = [int(n) for n in per_n]
                growth = [c["live_growth_mib"] for c in per_n.values()]
                ax.plot(ns, growth, ls, marker="o", color=color[name], label=name + suffix)
        setup(ax, f"{model}: peak live heap - heap after set-up, MiB per process", ns)
    fig.tight_layout()
    fig.savefig(path, dpi=110, metadata=_figures.metadata(source))
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=(__doc__ or "").splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--ns", type=int, nargs="+", help="accumulation steps (1 4 8 16)")
    parser.add_argument("--steps", type=int, help="timed steps per strategy and n (default 15)")
    parser.add_argument("--models", nargs="+", choices=bm.MODELS, default=list(bm.MODELS))
    parser.add_argument("--strategies", nargs="+", choices=ALL, default=list(ALL))
    parser.add_argument("--quick", action="store_true", help="tiny models, few steps")
    parser.add_argument(
        "--rounds", type=int, default=1, help="timing sections run K times in fresh processes"
    )
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "benchmarks")
    parser.add_argument("--no-memory", action="store_true", help="skip the memory section")
    parser.add_argument("--memory-ns", type=int, nargs="+", help="n for memory (default --ns)")
    parser.add_argument("--memory-steps", type=int, default=3, help="steps per memory config")
    parser.add_argument(
        "--replot", action="store_true", help="redraw <out>/benchmarks.png from <out>/results.json"
    )
    args = parser.parse_args(argv)
    if args.replot:  # no benchmark: the figure from the data already there
        source = args.out / "results.json"
        drawn = _plot(json.loads(source.read_text()), args.out / "benchmarks.png", source)
        return 0 if drawn else 1
    args.ns = args.ns or ([1, 2] if args.quick else [1, 4, 8, 16])
    args.steps = args.steps or (3 if args.quick else 15)
    args.memory_ns = args.memory_ns or args.ns
    if any(n < 1 for n in args.ns + args.memory_ns) or args.steps < 1 or args.rounds < 1:
        parser.error("n, --steps and --rounds must be positive")
    t_start = time.perf_counter()

    wanted = list(args.strategies)
    if "accelerate" in wanted and not has_accelerate():
        print("note: accelerate is not installed (pip install gradaccum[bench]); skipping it")
        wanted.remove("accelerate")
    two = [s for s in TWO_PROC if s in wanted]
    one = [s for s in ONE_PROC if s in wanted]
    ref2 = "ddp-no_sync" if "ddp-no_sync" in two else (two[0] if two else "")
    ref1 = "hand" if "hand" in one else (one[0] if one else "")

    # Fresh processes fork from a server that imported these once (torch._dynamo alone, which
    # the first optimizer imports lazily, costs ~1.7 s per process otherwise).
    preload = ["__main__", "torch", "torch._dynamo", "torch.func", "torch.distributed", "gradaccum"]
    mp.set_forkserver_preload(preload + (["accelerate"] if "accelerate" in two else []))
    results: dict[str, Any] = {
        "machine": {
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "python": platform.python_version(),
            "platform": platform.platform(),
            "torch": torch.__version__,
            "gradaccum": gradaccum.__version__,
            "accelerate": _version("accelerate"),
            "cpu_count": os.cpu_count(),
            "threads_per_process": 1,
            "loadavg_at_start": os.getloadavg(),  # other load on the machine shows up as noise
        },
        "settings": {
            "argv": sys.argv[1:],
            "ns": args.ns,
            "steps": args.steps,
            "rounds": args.rounds,
            "quick": args.quick,
            "memory_ns": None if args.no_memory else args.memory_ns,
            "memory_steps": args.memory_steps,
            "optimizer": f"SGD(lr={LR}, momentum={MOMENTUM})",
            "rel_tol": REL_TOL,
        },
        "models": {},
    }
    for model in args.models:
        spec = bm.spec(model, args.quick)
        n_params = sum(p.numel() for p in spec.build().parameters())
        print(
            f"== {model}: {spec.describe}; {n_params / 1e6:.2f}M params; {spec.micro} rows per "
            f"micro-batch per rank; 1 thread per process ==",
            flush=True,
        )
        res: dict[str, Any] = {"describe": spec.describe, "params": n_params, "micro": spec.micro}
        if two:
            res["two_process"] = _rounds(model, two, ref2, 2, args)
            _print_section(model, res["two_process"], args.ns, args.steps)
        if one:
            res["one_process"] = _rounds(model, one, ref1, 1, args)
            _print_section(model, res["one_process"], args.ns, args.steps)
        results["models"][model] = res
    if not args.no_memory:
        for model in args.models:
            mem = {}
            if two:
                mem["two_process"] = _memory(model, two, 2, args)
            if one:
                mem["one_process"] = _memory(model, one, 1, args)
            results["models"][model]["memory"] = mem
            _print_memory(model, mem, args.memory_ns, args.memory_steps)

    agree = all(
        sec["params_agree"]
        for res in results["models"].values()
        for key, sec in res.items()
        if key in ("two_process", "one_process")
    )
    results["params_agree"] = agree
    results["machine"]["loadavg_at_end"] = os.getloadavg()
    results["seconds"] = time.perf_counter() - t_start
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {args.out / 'results.json'}")
    if _plot(results, args.out / "benchmarks.png", args.out / "results.json"):
        print(f"wrote {args.out / 'benchmarks.png'}")
    print(
        f"parameters agree: {'yes' if agree else 'NO (see the ! above)'}; "
        f"{results['seconds']:.0f} s"
    )
    return 0 if agree else 1


def _version(name: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(name)
    except Exception:  # noqa: BLE001 - not installed
        return None


if __name__ == "__main__":
    sys.exit(main())
