"""Sharded data parallel: memory and communication of gradaccum.shard + reduce_scatter, on CPU.

    python benchmarks/sharded.py                 # the full run, ~2 minutes on 2 cores
    python benchmarks/sharded.py --quick         # a tiny model, n = 1 4, 2 steps: a smoke test
    python benchmarks/sharded.py --ns 1 8 --steps 6 --strategies all_reduce every
    python benchmarks/sharded.py --bucket-mb 25 --out /tmp/sharded.json

Two processes (gloo on 127.0.0.1, 1 thread each), world size 2. The model is a deep MLP
(``--layers`` x Linear(``--width``, ``--width``) + GELU, then Linear(width, 10); 12 x 1024 by
default: 12.6M float32 parameters, 48 MiB), cross-entropy, ``--micro`` rows per micro-batch per
rank, ``torch.optim.AdamW(lr=1e-3, weight_decay=0.01)``: an optimizer state of two tensors per
parameter. The micro-batch is fixed, so a rank's batch is ``n`` micro-batches. Strategies:

- ``all_reduce``: unsharded data parallel, the reference. Every rank holds the full params,
  the full gradient and the full AdamW state; ``accumulate(gradaccum.grad(loss_fn), n,
  sync=gradaccum.all_reduce())``, ``write_grads(model, grads)``, ``opt.step()``.
- ``boundary``: ``sp = gradaccum.shard(params)``, AdamW over ``sp.shards``,
  ``reduce_scatter(sp, policy="boundary")``: the params are all-gathered once per window, the
  full gradient accumulates locally, one reduce-scatter per bucket per window.
- ``every``: ``reduce_scatter(sp, policy="every")``: each micro-batch's gradient is
  reduce-scattered bucket by bucket during its backward (at most 2 buckets in flight) into a
  shard accumulator: ``n`` times the gradient traffic, no full gradient held.
- ``every-micro_batch``: ``every`` with ``gather="micro_batch"``: the params are all-gathered
  before each micro-batch and dropped after its backward (``n`` times the gather traffic).
- ``ddp-no_sync`` (not run by default): torch DDP, ``no_sync()`` but for the last micro-batch.

``--bucket-mb`` (default 4, about one 1024 x 1024 layer) is the bucket size of every strategy,
gradaccum's (``shard``, ``all_reduce``) and DDP's. With a model this small, the default 25 MiB
would make three buckets, and ``every``, which holds up to three buckets of full gradient at a
time, would hold nearly all of it; at scale a bucket is a small part of the model, as here.

Each (strategy, n) runs in a fresh pair of processes (forkserver), ``--steps`` optimizer steps.

How memory is measured: the live heap, i.e. the bytes glibc's malloc has handed out and not
taken back (``mallinfo2``: ``uordblks + hblkhd``; torch's CPU tensors are malloc'ed). It is read
at fixed points (after each micro-batch's forward, in the backward from a tensor hook on every
Linear's output, after the window, after ``opt.step()`` and after ``zero_grad()``) and by a
background thread every ~1 ms (which sees transients such as the optimizer's temporaries and the
collectives' buffers). ``peak`` is the largest reading minus the live heap of the same process
before the model was built (imports and process group only), so it counts params, gradients,
optimizer state, activations and communication buffers; the larger rank's is shown. The parts
are exact sizes of tensors: ``params`` (the model's parameters, or this rank's shards),
``opt`` (AdamW's state), ``grads`` (what the optimizer steps with: the full gradient, or this
rank's gradient shard); ``other`` = peak - params - opt is what the step held on top at its
peak (window buffers: gathered params, gradient accumulators, buckets in flight, autograd's
gradients, activations, optimizer temporaries). ``at`` is where the peak was seen (``~``: by
the thread). Peak RSS growth over the same baseline is printed too, but it is coarse (glibc
keeps freed pages).

Collectives are counted per rank and optimizer step with ``gradaccum.sync.record_collectives()`` on
the last step (the first one has the one-off tree check in addition), by kind; DDP's with a
counting comm hook. Step time: median over the steps after the first, the slower rank's, with
the sampling thread running: secondary information, noisy on a shared machine.

Correctness: after the steps, each strategy's full params (gathered from the shards) are compared
with ``all_reduce``'s at the same n, and so is the gradient of one more window on the same batch
(AdamW is invariant to the scale of the gradient, so comparing params alone would miss a wrong
scale). The exit status is 1 when a max |difference| is above 1e-5 (float32).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import _bench_models as bm
import _launch
import suite
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.func import functional_call
from torch.nn.parallel import DistributedDataParallel as DDP

import gradaccum

STRATEGIES = ("all_reduce", "boundary", "every", "every-micro_batch", "ddp-no_sync")
DEFAULT = ("all_reduce", "boundary", "every", "every-micro_batch")
SHARDED = {  # strategy -> (policy, gather)
    "boundary": ("boundary", "window"),
    "every": ("every", "window"),
    "every-micro_batch": ("every", "micro_batch"),
}
WORLD = 2
LR, WEIGHT_DECAY = 1e-3, 0.01
TOL = 1e-5  # max |difference| of params and gradients from all_reduce's (float32)
KINDS = ("all_gather", "reduce_scatter", "all_reduce")
MIB = 2**20


# ------------------------------------------------------------------------------- the model


def model_spec(layers: int, width: int, micro: int) -> bm.ModelSpec:
    """A deep MLP: ``layers`` x (Linear(width, width), GELU), then Linear(width, 10)."""

    def build() -> torch.nn.Module:
        torch.manual_seed(0)
        mods: list[torch.nn.Module] = []
        for _ in range(layers):
            mods += [torch.nn.Linear(width, width), torch.nn.GELU()]
        return torch.nn.Sequential(*mods, torch.nn.Linear(width, 10))

    def make_batch(gen: torch.Generator, rows: int) -> bm.Batch:
        x = torch.randn(rows, width, generator=gen)
        return x, torch.randint(0, 10, (rows,), generator=gen)

    return bm.ModelSpec(
        "mlp",
        f"MLP {layers} x Linear({width}, {width}) + GELU, then Linear({width}, 10)",
        micro,
        build,
        make_batch,
        F.cross_entropy,
    )


def _spec(job: dict[str, Any]) -> bm.ModelSpec:
    return model_spec(job["layers"], job["width"], job["micro"])


def _batches(spec: bm.ModelSpec, n: int, rank: int, count: int) -> list[bm.Batch]:
    """``count`` global batches (seeded by n and index); this rank's share of each."""
    rows = spec.micro * n
    out = []
    for i in range(count):
        gen = torch.Generator().manual_seed(10_000 * n + i)
        x, y = spec.make_batch(gen, rows * WORLD)
        out.append((x[rank * rows : (rank + 1) * rows], y[rank * rows : (rank + 1) * rows]))
    return out


# ----------------------------------------------------------------------------- the sampler


class Sampler:
    """The peak of the live heap: read at fixed points and by a thread every ~1 ms."""

    def __init__(self, live: Callable[[], float], interval: float = 1e-3) -> None:
        self.live, self.interval = live, interval
        self.phase = "set-up"
        self.peak = self.peak_points = 0.0
        self.at = ""
        self.samples = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def point(self, where: str | None = None) -> None:
        """Read the live heap here (and name the phase the thread will report)."""
        if where is not None:
            self.phase = where
        value = self.live()
        with self._lock:
            self.samples += 1
            self.peak_points = max(self.peak_points, value)
            if value > self.peak:
                self.peak, self.at = value, self.phase

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            value = self.live()  # ctypes releases the GIL for the call
            with self._lock:
                self.samples += 1
                if value > self.peak:
                    self.peak, self.at = value, "~" + self.phase

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *_: Any) -> None:
        self._stop.set()
        self._thread.join()


# ------------------------------------------------------------------------------ strategies


def _nbytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _opt_bytes(opt: torch.optim.Optimizer) -> int:
    return sum(
        _nbytes(v for v in state.values() if isinstance(v, torch.Tensor))
        for state in opt.state.values()
    )


def _flat(tree: dict[str, torch.Tensor], names: list[str]) -> torch.Tensor:
    return torch.cat([tree[k].detach().reshape(-1).float() for k in names])


class Run:
    """One strategy on one rank: a window, then the optimizer step, with memory points."""

    def __init__(
        self, name: str, spec: bm.ModelSpec, n: int, bucket_mb: float, sampler: Sampler
    ) -> None:
        self.name, self.n, self.sampler = name, n, sampler
        model = spec.build()
        self.names = [k for k, _ in model.named_parameters()]
        self.micro_step = 0
        self.log: list[dict[str, Any]] = []  # DDP's collectives (a counting comm hook)

        def on_output(_mod: Any, _inp: Any, out: torch.Tensor) -> None:
            if out.requires_grad:  # sampled in the backward, when this layer's gradient is due
                out.register_hook(lambda _g: sampler.point(f"bwd {self.micro_step}/{n}"))

        for mod in model.modules():
            if isinstance(mod, torch.nn.Linear):
                mod.register_forward_hook(on_output)

        def loss_fn(params: Any, batch: bm.Batch) -> torch.Tensor:
            x, y = batch
            self.micro_step += 1  # 1-based in the phase names: "fwd 1/n" ... "bwd n/n"
            sampler.phase = f"fwd {self.micro_step}/{n}"
            value = spec.loss(functional_call(model, params, (x,)), y)
            sampler.point(f"after fwd {self.micro_step}/{n}")
            return value

        self.model = model
        if name == "all_reduce":
            self.params = gradaccum.params_of(model)
            self.opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
            sync = gradaccum.all_reduce(bucket_mb=bucket_mb)
            self.step = gradaccum.accumulate(gradaccum.grad(loss_fn), n, sync=sync)
        elif name in SHARDED:
            policy, gather = SHARDED[name]
            self.sp = gradaccum.shard(gradaccum.params_of(model), bucket_mb=bucket_mb)
            model.to("meta")  # the module keeps its structure; its params live in the shards
            self.opt = torch.optim.AdamW(self.sp.shards, lr=LR, weight_decay=WEIGHT_DECAY)
            sync = gradaccum.reduce_scatter(self.sp, policy=policy, gather=gather)
            self.step = gradaccum.accumulate(gradaccum.grad(loss_fn), n, sync=sync)
        elif name == "ddp-no_sync":
            self.ddp = DDP(model, bucket_cap_mb=bucket_mb)
            self.ddp.register_comm_hook(self.log, suite._counting_hook)
            self.opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
        else:
            raise ValueError(f"unknown strategy {name!r}; choose from {STRATEGIES}")

    def param_bytes(self) -> int:
        if hasattr(self, "sp"):
            return _nbytes(self.sp.shards)
        return _nbytes(self.model.parameters())

    def window(self, batch: bm.Batch) -> Any:
        """The window's gradient (for DDP, in ``.grad`` already)."""
        self.micro_step = 0
        if hasattr(self, "ddp"):
            n = self.n
            for i, (x, y) in enumerate(zip(batch[0].chunk(n), batch[1].chunk(n))):
                with self.ddp.no_sync() if i < n - 1 else contextlib.nullcontext():
                    self.micro_step += 1
                    self.sampler.phase = f"fwd {self.micro_step}/{n}"
                    loss = F.cross_entropy(self.ddp(x), y) / n
                    self.sampler.point(f"after fwd {self.micro_step}/{n}")
                    loss.backward()
                    del loss
            return None
        target = self.sp if hasattr(self, "sp") else self.params
        return self.step(target, batch)

    def apply(self, grads: Any) -> int:
        """Hand the gradient to the optimizer; return its bytes."""
        if hasattr(self, "sp"):
            self.sp.write_grads(grads)
            return _nbytes(grads)
        if hasattr(self, "ddp"):
            return _nbytes(p.grad for p in self.model.parameters())
        gradaccum.write_grads(self.model, grads)
        return _nbytes(grads.values())

    def full_params(self) -> torch.Tensor:
        if hasattr(self, "sp"):
            return _flat(self.sp.gather(), self.names)
        return _flat(dict(self.model.named_parameters()), self.names)

    def full_grads(self, grads: Any) -> torch.Tensor:
        if hasattr(self, "sp"):  # all-gather the gradient shards: put them in the shards a while
            with torch.no_grad():
                saved = [s.clone() for s in self.sp.shards]
                for s, g in zip(self.sp.shards, grads):
                    s.copy_(g)
                full = _flat(self.sp.gather(), self.names)
                for s, t in zip(self.sp.shards, saved):
                    s.copy_(t)
            return full
        if hasattr(self, "ddp"):
            return _flat({k: p.grad for k, p in self.model.named_parameters()}, self.names)
        return _flat(grads, self.names)


# ----------------------------------------------------------------------------- job on a rank


def _job(rank: int, world: int, job: dict[str, Any]) -> dict[str, Any]:
    spec, n, steps = _spec(job), job["n"], job["steps"]
    live = suite._heap_bytes()
    if live is None:
        raise RuntimeError("glibc's mallinfo2 is not available: no live-heap measurement")
    batches = _batches(spec, n, rank, 2)
    gc.collect()
    base_live, base_rss = live(), suite._rss_kib()
    sampler = Sampler(live)
    run = Run(job["strategy"], spec, n, job["bucket_mb"], sampler)
    gc.collect()
    setup_live = live()
    times: list[float] = []
    logs: list[list[dict[str, Any]]] = []
    grad_bytes = 0
    with sampler:
        sampler.point("after set-up")
        for s in range(steps):
            batch = batches[s % 2]
            dist.barrier()
            t0 = time.perf_counter()
            sampler.phase = "window start"
            run.log.clear()
            with gradaccum.sync.record_collectives() as rec:
                grads = run.window(batch)
            sampler.point("after window")
            grad_bytes = run.apply(grads)
            del grads
            sampler.phase = "opt.step"
            run.opt.step()
            sampler.point("after opt.step")
            run.opt.zero_grad(set_to_none=True)
            sampler.point("after zero_grad")
            times.append(time.perf_counter() - t0)
            log = [
                {"kind": c.kind, "numel": c.numel, "nbytes": c.nbytes, "purpose": c.purpose}
                for c in rec
            ] + list(run.log)
            logs.append(log)
    peak_rss = suite._maxrss_kib()
    out = {
        "peak_mib": (sampler.peak - base_live) / MIB,
        "peak_points_mib": (sampler.peak_points - base_live) / MIB,
        "at": sampler.at,
        "samples": sampler.samples,
        "setup_mib": (setup_live - base_live) / MIB,
        "rss_growth_mib": (peak_rss - base_rss) / 1024,
        "params_mib": run.param_bytes() / MIB,
        "opt_mib": _opt_bytes(run.opt) / MIB,
        "grads_mib": grad_bytes / MIB,
        "times": times,
        "first_log": logs[0],
        "log": logs[-1],
    }
    # Correctness, after the measurement: the params, then one more window's gradient.
    params = run.full_params()
    grads = run.window(batches[0])
    run.apply(grads)
    full_grads = run.full_grads(grads)
    if rank == 0:
        torch.save({"params": params, "grads": full_grads}, job["save"])
    return out


def launch(job: dict[str, Any], timeout: float) -> list[dict[str, Any]]:
    """Run ``job`` on two fresh processes; return each rank's result (raise on failure)."""
    return _launch.launch(_job, job, WORLD, timeout, what=f"{job['strategy']} n={job['n']}")


# ------------------------------------------------------------------------------ the parent


def _by_kind(log: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    out = {k: {"count": 0, "mib": 0.0} for k in KINDS}
    for c in log:
        cell = out.setdefault(c["kind"], {"count": 0, "mib": 0.0})
        cell["count"] += 1
        cell["mib"] += c["nbytes"] / MIB
    return out


def _cell(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """One (strategy, n): the larger rank's memory, the slower rank's step times."""
    worst = max(ranks, key=lambda r: r["peak_mib"])
    steps = [max(ts) for ts in zip(*(r["times"] for r in ranks))]
    timed = steps[1:] or steps
    log = ranks[0]["log"]
    return {
        **{k: v for k, v in worst.items() if k not in ("times", "first_log", "log")},
        "peak_mib_per_rank": [r["peak_mib"] for r in ranks],
        "median_ms": 1e3 * statistics.median(timed),
        "times_ms": [1e3 * t for t in steps],
        "collectives": len(log),
        "wire_mib": sum(c["nbytes"] for c in log) / MIB,
        "by_kind": _by_kind(log),
        "first_step_collectives": len(ranks[0]["first_log"]),
        "log": log,
    }


def _rows(title: str, header: list[str], rows: list[list[str]]) -> None:
    """Print a table: the first column left-aligned, the others right-aligned."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]

    def line(cells: list[str]) -> str:
        return "  " + "  ".join(
            c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))
        )

    print(title)
    print(line(header))
    for r in rows:
        print(line(r))
    print(flush=True)


def _ratio(a: float, b: float | None) -> str:
    return f"{a / b:.2f}" if b else "-"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=(__doc__ or "").splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--quick", action="store_true", help="a tiny model, n = 1 4, 2 steps")
    parser.add_argument("--ns", type=int, nargs="+", help="accumulation steps (default 1 4 16)")
    parser.add_argument("--steps", type=int, help="optimizer steps per run (default 5)")
    parser.add_argument("--strategies", nargs="+", choices=STRATEGIES, default=list(DEFAULT))
    parser.add_argument("--layers", type=int, help="hidden Linear layers (default 12)")
    parser.add_argument("--width", type=int, help="their width (default 1024)")
    parser.add_argument("--micro", type=int, help="rows per micro-batch per rank (default 16)")
    parser.add_argument("--bucket-mb", type=float, help="bucket size in MiB (default 4)")
    parser.add_argument("--out", type=Path, help="write the results as JSON to this file")
    args = parser.parse_args(argv)
    quick = args.quick
    args.ns = args.ns or ([1, 4] if quick else [1, 4, 16])
    args.steps = args.steps or (2 if quick else 5)
    args.layers = args.layers or (3 if quick else 12)
    args.width = args.width or (128 if quick else 1024)
    args.micro = args.micro or (4 if quick else 16)
    args.bucket_mb = args.bucket_mb or (1 / 16 if quick else 4.0)
    if min(args.ns) < 1 or args.steps < 1 or args.layers < 1 or args.width < 1 or args.micro < 1:
        parser.error("--ns, --steps, --layers, --width and --micro must be positive")
    if args.bucket_mb <= 0:
        parser.error("--bucket-mb must be positive")
    names = [s for s in STRATEGIES if s in args.strategies]
    ref = "all_reduce" if "all_reduce" in names else names[0]
    t_start = time.perf_counter()

    spec = model_spec(args.layers, args.width, args.micro)
    model = spec.build()
    n_params = sum(p.numel() for p in model.parameters())
    n_bytes = _nbytes(model.parameters())
    biggest = max(p.numel() * p.element_size() for p in model.parameters())
    del model
    argv_shown = " ".join(sys.argv[1:] if argv is None else argv)
    print(
        f"python benchmarks/sharded.py {argv_shown}".rstrip()
        + f"; torch {torch.__version__}, gradaccum {gradaccum.__version__}, "
        f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} at the start"
    )
    print(
        f"== {spec.describe}: {n_params / 1e6:.2f}M float32 params, {n_bytes / MIB:.1f} MiB "
        f"(largest leaf {biggest / MIB:.2f} MiB); {args.micro} rows per micro-batch per rank; "
        f"world size {WORLD} (gloo, 1 thread per process); AdamW; bucket_mb={args.bucket_mb:g}; "
        f"{args.steps} steps per run =="
    )
    print(
        "peak: the largest live-heap reading (glibc mallinfo2; after each forward, in each "
        "backward,\n  after the window, opt.step and zero_grad, and every ~1 ms from a thread) "
        "minus the live heap\n  before the model was built; the larger rank's. params / opt / "
        "grads: exact tensor sizes (this\n  rank's shards when sharded); other = peak - params - "
        "opt; at: where the peak was seen (~: thread).\n",
        flush=True,
    )

    p = n_bytes / MIB
    expected = [
        ("all_reduce", "params P + opt 2P + gradient P", f"= 4P = {4 * p:.1f} MiB"),
        ("boundary", "shards P/2 + opt P + gradient shard P/2", ""),
        ("", "+ gathered params P + full-gradient sums P", f"= 4P = {4 * p:.1f} MiB"),
        ("", "+ the reduce-scatters' buffers (all launched in the last backward)", ""),
        ("every", "P/2 + P + P/2 + gathered params P", f"= 3P = {3 * p:.1f} MiB"),
        ("", "+ a few buckets (2 in flight, 1 filling)", ""),
        ("every-micro_batch", "as every at the peak (params gathered for each micro-batch);", ""),
        ("", "only the shards are held between micro-batches", ""),
        ("ddp-no_sync", "4P + DDP's gradient buckets P", f"= 5P = {5 * p:.1f} MiB"),
    ]
    print(
        f"expected at world size {WORLD}, P = {p:.1f} MiB of params, AdamW (2 state tensors "
        f"per param):"
    )
    for name, what, total in expected:
        print(f"  {name:<18} {what:<46} {total}".rstrip())
    print("  with W ranks the sharded terms are P/W: every -> P + 4P/W, boundary -> 2P + 4P/W\n")

    preload = ["__main__", "torch", "torch._dynamo", "torch.func", "torch.distributed", "gradaccum"]
    mp.set_forkserver_preload(preload)
    cells: dict[str, dict[str, Any]] = {name: {} for name in names}
    diffs: dict[str, dict[str, tuple[float, float]]] = {name: {} for name in names}
    with tempfile.TemporaryDirectory(prefix="gradaccum-sharded-") as tmp:
        for n in args.ns:
            reference = None
            for name in [ref] + [s for s in names if s != ref]:
                save = Path(tmp) / f"{name}-{n}.pt"
                job = {
                    "strategy": name,
                    "n": n,
                    "steps": args.steps,
                    "layers": args.layers,
                    "width": args.width,
                    "micro": args.micro,
                    "bucket_mb": args.bucket_mb,
                    "save": str(save),
                    "pg_timeout": 300,
                }
                t0 = time.perf_counter()
                cells[name][str(n)] = cell = _cell(launch(job, timeout=600))
                got = torch.load(save, weights_only=True)
                save.unlink()
                if reference is None:
                    reference = got
                dp = float((got["params"] - reference["params"]).abs().max())
                dg = float((got["grads"] - reference["grads"]).abs().max())
                diffs[name][str(n)] = (dp, dg)
                cell["param_max_abs_diff"], cell["grad_max_abs_diff"] = dp, dg
                print(
                    f"  ran {name:<18} n={n:<3} peak {cell['peak_mib']:7.1f} MiB, "
                    f"{cell['median_ms']:8.1f} ms/step, {time.perf_counter() - t0:5.1f} s",
                    flush=True,
                )
            del reference
    print()

    def base(n: int) -> dict[str, Any] | None:
        return cells.get(ref, {}).get(str(n))

    rows = []
    for n in args.ns:
        for name in names:
            c = cells[name][str(n)]
            b = base(n)
            rows.append(
                [
                    name,
                    str(n),
                    f"{c['peak_mib']:.1f}",
                    _ratio(c["peak_mib"], b["peak_mib"] if b else None),
                    f"{c['params_mib']:.1f}",
                    f"{c['opt_mib']:.1f}",
                    f"{c['grads_mib']:.1f}",
                    f"{c['peak_mib'] - c['params_mib'] - c['opt_mib']:.1f}",
                    c["at"],
                    f"{c['peak_points_mib']:.1f}",
                    f"{c['rss_growth_mib']:.1f}",
                ]
            )
    _rows(
        f"memory per process, MiB (vs {ref}: ratio of peaks at the same n)",
        [
            "strategy",
            "n",
            "peak",
            f"vs {ref}",
            "params",
            "opt",
            "grads",
            "other",
            "at",
            "peak@points",
            "RSS growth",
        ],
        rows,
    )

    rows = []
    for n in args.ns:
        for name in names:
            c = cells[name][str(n)]
            k = c["by_kind"]
            rows.append(
                [
                    name,
                    str(n),
                    *(f"{k[kind]['count']} / {k[kind]['mib']:.1f}" for kind in KINDS),
                    f"{c['collectives']} / {c['wire_mib']:.1f}",
                    str(c["first_step_collectives"]),
                ]
            )
    _rows(
        "collectives per optimizer step and rank (last step): count / MiB",
        ["strategy", "n", *KINDS, "total", "first step"],
        rows,
    )

    timed = f"steps 2-{args.steps}" if args.steps > 1 else "1 step"
    rows = []
    for n in args.ns:
        for name in names:
            c = cells[name][str(n)]
            b = base(n)
            rows.append(
                [
                    name,
                    str(n),
                    f"{c['median_ms']:.1f}",
                    _ratio(c["median_ms"], b["median_ms"] if b else None),
                    f"{c['param_max_abs_diff']:.1e}",
                    f"{c['grad_max_abs_diff']:.1e}",
                ]
            )
    _rows(
        f"step time (median ms of {timed}, slower rank; secondary) and max |diff| "
        f"from {ref} (params after the steps; gradient of one more window)",
        ["strategy", "n", "ms/step", f"vs {ref}", "params diff", "grads diff"],
        rows,
    )

    agree = all(max(d) <= TOL for per_n in diffs.values() for d in per_n.values())
    print("markdown:\n")
    print(
        f"| strategy | n | peak MiB | vs {ref} | collectives/step | MiB on the wire/step |\n"
        "|---|---:|---:|---:|---:|---:|"
    )
    for n in args.ns:
        for name in names:
            c = cells[name][str(n)]
            b = base(n)
            print(
                f"| {name} | {n} | {c['peak_mib']:.1f} | "
                f"{_ratio(c['peak_mib'], b['peak_mib'] if b else None)} | {c['collectives']} | "
                f"{c['wire_mib']:.1f} |"
            )
    seconds = time.perf_counter() - t_start
    print(
        f"\nparams and gradients agree with {ref} (max |diff| <= {TOL:g}): "
        f"{'yes' if agree else 'NO'}; {seconds:.0f} s"
    )
    if args.out is not None:
        results = {
            "machine": {
                "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "python": platform.python_version(),
                "platform": platform.platform(),
                "torch": torch.__version__,
                "gradaccum": gradaccum.__version__,
                "cpu_count": os.cpu_count(),
                "loadavg_at_end": os.getloadavg(),
            },
            "settings": {
                "argv": sys.argv[1:] if argv is None else argv,
                "model": spec.describe,
                "params": n_params,
                "param_mib": n_bytes / MIB,
                "world": WORLD,
                **{k: v for k, v in vars(args).items() if k != "out"},
                "optimizer": f"AdamW(lr={LR}, weight_decay={WEIGHT_DECAY})",
                "tol": TOL,
            },
            "reference": ref,
            "results": cells,
            "agree": agree,
            "seconds": seconds,
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1) + "\n")
        print(f"wrote {args.out}")
    return 0 if agree else 1


if __name__ == "__main__":
    sys.exit(main())
