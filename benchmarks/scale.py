"""Hybrid sharding (HSDP) on a 2x2 mesh: gradaccum's policies against FSDP2's no-sync knobs.

    python benchmarks/scale.py            # the full run, about a minute on 2 cores
    python benchmarks/scale.py --quick    # a tiny model, n = 2, 3 steps: a smoke test
    python benchmarks/scale.py --layers 4 --width 512 --n 8 --steps 8 --no-ddp

Four processes (gloo on 127.0.0.1, 1 thread each) form the mesh
``init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))``: dim 1 ("shard")
stands for the GPUs of a node (the intra-node tier), dim 0 ("replicate") for the nodes (the
inter-node tier). The model is an MLP: ``--layers`` blocks of Linear(width, width) + GELU, then a
head Linear(width, 10); cross-entropy; ``--micro`` rows per micro-batch per rank;
``torch.optim.SGD(lr=0.05, momentum=0.9)``, one step per window of ``--n`` micro-batches.
Strategies, each with its own copy of the model, run round-robin in the same processes (one
optimizer step each per round, the order rotating):

- ``ga-every``, ``ga-boundary``, ``ga-mixed``: ``sp = gradaccum.shard(params, mesh)`` and
  ``gradaccum.reduce_scatter(sp, policy=...)`` with ``"every"``, ``"boundary"``, and
  ``{"weights": "every", "biases": "boundary"}`` (two parameter groups). Params are gathered
  once per window; the gradient shards are all-reduced across the replicate dim once per window.
- ``fsdp2-no-grad-sync``: FSDP2 ``fully_shard`` on every block and on the root, same mesh (HSDP),
  ``model.set_requires_gradient_sync(False)`` for micro-batches 1..n-1: it reduce-scatters and
  all-reduces only in the last micro-batch's backward (holding unsharded gradients till then).
- ``fsdp2-no-all-reduce``: the same with ``model.set_requires_all_reduce(False)`` for 1..n-1: it
  reduce-scatters every micro-batch and all-reduces across replicas only at the last.
- ``fsdp2-keep-params``: ``fsdp2-no-grad-sync`` with ``fully_shard(...,
  reshard_after_forward=False)`` and ``model.set_reshard_after_backward(False)`` for 1..n-1: the
  params are all-gathered once per window, as gradaccum's are (like for like on the gathers).
- ``ddp-no_sync`` (``--no-ddp`` to leave it out): torch DDP over the 4 ranks, ``no_sync()`` but
  for the last micro-batch; its all-reduce spans both tiers.

Bytes are tensor bytes per rank and optimizer step, the convention of
``gradaccum.sync.Collective.nbytes``: a reduce-scatter counts its full input, an all-gather its
full output, an all-reduce its tensor. gradaccum's come from ``record_collectives()``; FSDP2's
from wrapping the ``torch.distributed`` functions it calls (``all_gather_single``,
``reduce_scatter_single``, ``all_reduce``, and the other collectives, which it does not call
here), each mapped to its mesh dim by its process group; DDP's the same way (a comm hook that calls
``dist.all_reduce``). Counted
on the last step. Link bytes of a ring are smaller by (k-1)/k (reduce-scatter, all-gather) or
larger by 2(k-1)/k (all-reduce) over k ranks: see ``docs/scale.md``.

Checks (the exit status is 1 if one fails):

- gradaccum's bytes per tier equal the formula of ``docs/scale.md`` for this model: with P the
  parameter elements, b = 4 bytes, S = 2 shards, n micro-batches, P_e of them in ``every`` groups,
  intra = (n P_e + (P - P_e)) b [gradients] + P b [params, once per window] + 32 [fingerprint
  and weight], inter = P b / S [gradient shards] + 32. (No padding: every bucket here has an even
  number of elements.)
- every strategy ends with the same parameters as ``ga-boundary`` (max |diff| <= 1e-5).

On a 2-core machine, 4 processes share 2 cores and gloo runs over loopback: the step times measure
the work each strategy does (compute, copies, Python, the collectives' CPU cost), not what the
links would cost. Read the bytes as the result, the times as overhead.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import _launch
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

import gradaccum

WORLD = 4
SHAPE = (2, 2)
DIMS = ("replicate", "shard")
GA = ("ga-every", "ga-boundary", "ga-mixed")
FSDP = ("fsdp2-no-grad-sync", "fsdp2-no-all-reduce", "fsdp2-keep-params")
STRATEGIES = (*GA, *FSDP, "ddp-no_sync")
POLICIES: dict[str, Any] = {
    "ga-every": "every",
    "ga-boundary": "boundary",
    "ga-mixed": {"weights": "every", "biases": "boundary"},
}
REF = "fsdp2-no-grad-sync"  # step-time ratios are against it
PARAMS_REF = "ga-boundary"  # parameters are compared with it
LR, MOMENTUM = 0.05, 0.9
TOL = 1e-5
SMALL = 16  # bytes of the fingerprint all-reduce, and of the weight all-reduce, per mesh dim
COUNTED = ("all_reduce", "reduce_scatter_single", "reduce_scatter_tensor", "all_gather_single")
COUNTED += ("all_gather_into_tensor", "all_gather", "reduce_scatter", "broadcast")
KIB = 1024


# ------------------------------------------------------------------------------- the model


def build(layers: int, width: int) -> nn.Module:
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(layers)]
    model = nn.Sequential(*blocks, nn.Linear(width, 10))
    return model


def _group_of(path: str) -> str:
    return "biases" if "bias" in path else "weights"


def batches(job: dict[str, Any], rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Two global batches (seeded); this rank's rows of each."""
    rows = job["micro"] * job["n"]
    out = []
    for i in range(2):
        gen = torch.Generator().manual_seed(1234 + i)
        x = torch.randn(rows * WORLD, job["width"], generator=gen)
        y = torch.randint(0, 10, (rows * WORLD,), generator=gen)
        out.append((x[rank * rows : (rank + 1) * rows], y[rank * rows : (rank + 1) * rows]))
    return out


# ---------------------------------------------------------------- counting FSDP2's collectives


class DistCounter:
    """Wraps the ``torch.distributed`` collectives; logs (kind, dim, numel, nbytes) while on."""

    def __init__(self, mesh: Any) -> None:
        self.dims = {id(mesh.get_group(d)): d for d in DIMS}
        self.on = False
        self.saved: dict[str, Any] = {}

    def _wrap(self, name: str, fn: Any) -> Any:
        @functools.wraps(fn)
        def counted(*args: Any, **kwargs: Any) -> Any:
            if self.on:
                tensor = self._tensor(name, args, kwargs)
                group = kwargs.get("group")
                if group is None:
                    pos = {"all_reduce": 2, "reduce_scatter_single": 3}.get(name)
                    group = args[pos] if pos is not None and len(args) > pos else None
                dim = "world" if group is None else self.dims.get(id(group), "other")
                numel = sum(t.numel() for t in tensor)
                nbytes = sum(t.numel() * t.element_size() for t in tensor)
                self.log.append((name, dim, numel, nbytes))
            return fn(*args, **kwargs)

        return counted

    @staticmethod
    def _tensor(name: str, args: Any, kwargs: Any) -> list[torch.Tensor]:
        # What goes on the wire, by gradaccum's convention: the full input of a reduce-scatter,
        # the full output of an all-gather, the tensor of an all-reduce or broadcast.
        if name in ("all_reduce", "broadcast"):
            t = kwargs.get("tensor", args[0] if args else None)
        elif name.startswith("reduce_scatter"):
            t = kwargs.get("input", kwargs.get("input_list", args[1] if len(args) > 1 else None))
        else:
            t = kwargs.get("output_tensor", kwargs.get("tensor_list", args[0] if args else None))
        return list(t) if isinstance(t, (list, tuple)) else [t]

    def __enter__(self) -> DistCounter:
        for name in COUNTED:
            if hasattr(dist, name):
                self.saved[name] = getattr(dist, name)
                setattr(dist, name, self._wrap(name, self.saved[name]))
        return self

    def __exit__(self, *_: Any) -> None:
        for name, fn in self.saved.items():
            setattr(dist, name, fn)


def _ddp_hook(_state, bucket):  # no annotations: DDP checks them against its own types
    # dist.all_reduce, so that DistCounter counts it (DDP's own reducer would bypass it).
    fut = dist.all_reduce(bucket.buffer(), async_op=True).get_future()
    return fut.then(lambda f: f.value()[0].div_(dist.get_world_size()))


# ------------------------------------------------------------------------------ strategies


class Strategy:
    """One strategy on one rank: a window of n micro-batches, then ``opt.step()``."""

    def __init__(self, name: str, job: dict[str, Any], mesh: Any, counter: DistCounter) -> None:
        self.name, self.n, self.counter = name, job["n"], counter
        model = build(job["layers"], job["width"])
        self.names = [k for k, _ in model.named_parameters()]
        self.model = model
        if name in GA:

            def loss_fn(params: Any, batch: Any) -> torch.Tensor:
                x, y = batch
                return F.cross_entropy(functional_call(model, params, (x,)), y)

            self.sp = gradaccum.shard(
                gradaccum.params_of(model), mesh, bucket_mb=job["bucket_mb"], param_groups=_group_of
            )
            model.to("meta")
            sync = gradaccum.reduce_scatter(self.sp, policy=POLICIES[name])
            self.step = gradaccum.accumulate(gradaccum.grad(loss_fn), self.n, sync=sync)
            self.opt = torch.optim.SGD(self.sp.shards, lr=LR, momentum=MOMENTUM)
        elif name in FSDP:
            from torch.distributed.fsdp import fully_shard

            # fsdp2-keep-params: the params stay gathered for the window; else FSDP2's default.
            keep = {"reshard_after_forward": False} if name == "fsdp2-keep-params" else {}
            for block in list(model)[:-1]:
                fully_shard(block, mesh=mesh, **keep)
            fully_shard(model, mesh=mesh, **keep)
            self.opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
        elif name == "ddp-no_sync":
            from torch.nn.parallel import DistributedDataParallel as DDP

            self.ddp = DDP(model, bucket_cap_mb=job["bucket_mb"])
            self.ddp.register_comm_hook(None, _ddp_hook)
            self.opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
        else:
            raise ValueError(f"unknown strategy {name!r}; choose from {STRATEGIES}")

    def run(self, batch: Any) -> list[tuple[str, str, int, int]]:
        """One optimizer step; return its collectives (kind, dim, numel, nbytes)."""
        n = self.n
        if self.name in GA:
            with gradaccum.sync.record_collectives() as rec:
                grads = self.step(self.sp, batch)
            self.sp.write_grads(grads)
            log = [(c.kind, str(c.dim), c.numel, c.nbytes) for c in rec]
        else:
            micro = list(zip(batch[0].chunk(n), batch[1].chunk(n)))
            self.counter.log, self.counter.on = [], True
            try:
                for i, (x, y) in enumerate(micro):
                    last = i == n - 1
                    ctx: Any = contextlib.nullcontext()
                    if self.name == "fsdp2-no-grad-sync":
                        self.model.set_requires_gradient_sync(last)
                    elif self.name == "fsdp2-keep-params":
                        self.model.set_requires_gradient_sync(last)
                        self.model.set_reshard_after_backward(last)
                    elif self.name == "fsdp2-no-all-reduce":
                        self.model.set_requires_all_reduce(last)
                    else:
                        ctx = contextlib.nullcontext() if last else self.ddp.no_sync()
                    with ctx:
                        module = self.ddp if self.name == "ddp-no_sync" else self.model
                        (F.cross_entropy(module(x), y) / n).backward()
            finally:
                self.counter.on = False
            log = self.counter.log
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return log

    def full_params(self) -> torch.Tensor:
        """The full parameters, flat, in ``named_parameters`` order (communicates)."""
        if self.name in GA:
            tree = self.sp.gather()
        else:
            tree = {}
            for k, p in self.model.named_parameters():
                tree[k] = p.full_tensor() if hasattr(p, "full_tensor") else p
        return torch.cat([tree[k].detach().reshape(-1) for k in self.names])


# ----------------------------------------------------------------------------- job on a rank


def _job(rank: int, world: int, job: dict[str, Any]) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", SHAPE, mesh_dim_names=DIMS)
    data = batches(job, rank)
    names = job["strategies"]
    times: dict[str, list[float]] = {k: [] for k in names}
    logs: dict[str, list[tuple[str, str, int, int]]] = {}
    with DistCounter(mesh) as counter:
        runs = {k: Strategy(k, job, mesh, counter) for k in names}
        for s in range(job["steps"]):
            order = names[s % len(names) :] + names[: s % len(names)]
            for k in order:
                dist.barrier()
                t0 = time.perf_counter()
                logs[k] = runs[k].run(data[s % 2])
                times[k].append(time.perf_counter() - t0)
    params = {k: runs[k].full_params() for k in names}
    out: dict[str, Any] = {"times": times, "logs": logs, "gradaccum": gradaccum.__file__}
    if rank == 0:
        ref = params[PARAMS_REF]
        out["diffs"] = {k: float((p - ref).abs().max()) for k, p in params.items()}
    return out


# ------------------------------------------------------------------------------ the parent


def expected(name: str, n: int, p: int, p_every: int, b: int) -> dict[str, int]:
    """gradaccum's bytes per rank and step by tier, from the formula of docs/scale.md."""
    s = SHAPE[1]
    pe = {"ga-every": p, "ga-boundary": 0, "ga-mixed": p_every}[name]
    return {
        "intra grads": (n * pe + (p - pe)) * b,
        "intra params": p * b,
        "inter grads": p * b // s,
        "small": 4 * SMALL,
    }


def tiers(log: list[tuple[str, str, int, int]]) -> dict[str, Any]:
    """Bytes and counts per tier; 'small' is the 16-byte fingerprint and weight all-reduces."""
    out: dict[str, Any] = Counter()
    for kind, dim, _numel, nbytes in log:
        if nbytes <= SMALL and dim in DIMS:
            out["small"] += nbytes
            continue
        tier = {"shard": "intra", "replicate": "inter"}.get(dim, dim)
        what = "params" if kind.startswith("all_gather") else "grads"
        out[f"{tier} {what}"] += nbytes
        out[f"{tier} {what} count"] += 1
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=(__doc__ or "").splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--quick", action="store_true", help="a tiny model, n = 2, 3 steps")
    parser.add_argument("--n", type=int, help="micro-batches per optimizer step (default 8)")
    parser.add_argument("--steps", type=int, help="optimizer steps per strategy (default 10)")
    parser.add_argument("--layers", type=int, help="hidden blocks (default 4)")
    parser.add_argument("--width", type=int, help="their width, even (default 512)")
    parser.add_argument("--micro", type=int, help="rows per micro-batch per rank (default 16)")
    parser.add_argument("--bucket-mb", type=float, help="gradaccum's and DDP's buckets (1 MiB)")
    parser.add_argument("--no-ddp", action="store_true", help="leave DDP + no_sync out")
    args = parser.parse_args(argv)
    q = args.quick
    args.n = args.n or (2 if q else 8)
    args.steps = args.steps or (3 if q else 10)
    args.layers = args.layers or (2 if q else 4)
    args.width = args.width or (64 if q else 512)
    args.micro = args.micro or (4 if q else 16)
    args.bucket_mb = args.bucket_mb or (1 / 64 if q else 1.0)
    if min(args.n, args.steps, args.layers, args.width, args.micro) < 1 or args.width % 2:
        parser.error("--n, --steps, --layers, --width and --micro must be positive, width even")
    names = [s for s in STRATEGIES if not (args.no_ddp and s == "ddp-no_sync")]
    t_start = time.perf_counter()

    model = build(args.layers, args.width)
    p = sum(t.numel() for t in model.parameters())
    p_every = sum(t.numel() for k, t in model.named_parameters() if _group_of(k) == "weights")
    # The formula has no padding: every leaf, hence every bucket, divides by the shard size.
    assert all(t.numel() % SHAPE[1] == 0 for t in model.parameters())
    b = 4
    argv_shown = " ".join(sys.argv[1:] if argv is None else argv)
    print(
        f"python benchmarks/scale.py {argv_shown}".rstrip()
        + f"; torch {torch.__version__}, gradaccum {gradaccum.__version__} "
        f"({Path(gradaccum.__file__).parent}), "
        f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} at the start"
    )
    print(
        f"== MLP {args.layers} x (Linear({args.width}, {args.width}) + GELU) + Linear("
        f"{args.width}, 10): P = {p:,} float32 params ({p * b / KIB:,.1f} KiB), "
        f"{p_every:,} of them weights; {WORLD} gloo processes on a 2x2 mesh (replicate, shard); "
        f"n = {args.n}, {args.micro} rows per micro-batch per rank; {args.steps} steps each, "
        f"round-robin ==",
        flush=True,
    )
    job = {**vars(args), "strategies": names, "pg_timeout": 120}
    ranks = _launch.launch(_job, job, WORLD, 100 if q else 300, what="scale")

    where = {r["gradaccum"] for r in ranks}
    if where != {gradaccum.__file__}:
        print(f"note: the ranks imported gradaccum from {sorted(where)}, not {gradaccum.__file__}")
    # Step time: per step the slower rank; median over the steps after the first.
    med = {}
    for k in names:
        steps = [max(ts) for ts in zip(*(r["times"][k] for r in ranks))]
        med[k] = 1e3 * statistics.median(steps[1:] or steps)
    cols = ["intra grads", "intra params", "inter grads", "world grads", "small"]
    print("\nbytes per rank and optimizer step, KiB (count), by tier (rank 0, last step):")
    print("  intra = the shard dim (within a node), inter = the replicate dim (across nodes),")
    print("  world = all 4 ranks (DDP's all-reduce spans both tiers); small = the 16-byte")
    print("  fingerprint and weight all-reduces, both dims.\n")
    header = "| strategy | intra grads | intra params | inter grads | all 4 ranks | small B |"
    print(header + " ms/step | vs " + REF + " |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    measured = {}
    for k in names:
        t = tiers(ranks[0]["logs"][k])
        measured[k] = t
        cells = []
        for c in cols[:-1]:
            cells.append(f"{t[c] / KIB:,.1f} ({t[c + ' count']})" if t[c] else "0")
        cells.append(str(t["small"]))
        print(f"| {k} | " + " | ".join(cells) + f" | {med[k]:.1f} | {med[k] / med[REF]:.2f} |")
    pairs = [("ga-boundary", "fsdp2-keep-params"), ("ga-every", "fsdp2-no-all-reduce")]
    like = [f"{a} / {f} {med[a] / med[f]:.2f}" for a, f in pairs if a in med and f in med]
    if like:
        print(f"\nthe same gradient bytes per tier: {', '.join(like)}")
    for r, rank in enumerate(ranks[1:], 1):
        for k in names:
            if tiers(rank["logs"][k]) != measured[k]:
                print(f"note: rank {r} counted other bytes than rank 0 for {k}")

    print(f"\nformula (docs/scale.md), P = {p:,}, P_e = {p_every:,} (weights), b = {b}, S = 2, ")
    print(f"n = {args.n}: intra grads = (n P_e + P - P_e) b, intra params = P b, ")
    print("inter grads = P b / S, small = 4 x 16 B:")
    ok = True
    for k in names:
        if k not in GA:
            continue
        want = expected(k, args.n, p, p_every, b)
        got = {c: measured[k][c] for c in want}
        # Every rank, not only rank 0, must have sent what the formula says.
        good = all({c: tiers(r["logs"][k])[c] for c in want} == want for r in ranks)
        ok &= good
        print(f"  {k:<12} expected {want}\n  {'':<12} measured {got}: {'OK' if good else 'NO'}")
    for k in names:
        if k not in FSDP:
            continue
        n_rs = args.n if k == "fsdp2-no-all-reduce" else 1
        want_f = {"intra grads": n_rs * p * b, "inter grads": p * b // 2}
        got_f = {c: measured[k][c] for c in want_f}
        print(
            f"  {k}: gradients, expected {want_f}, measured {got_f}: "
            f"{'same' if got_f == want_f else 'DIFFERENT'} (not part of the exit status); "
            f"params all-gathered {measured[k]['intra params count']} times "
            f"({measured[k]['intra params'] / (p * b):.1f} P b)"
        )

    if "ddp-no_sync" in measured:
        got_d = measured["ddp-no_sync"]["world grads"]
        print(
            f"  ddp-no_sync: all-reduce over the 4 ranks, expected P b = {p * b}, measured "
            f"{got_d}: {'same' if got_d == p * b else 'DIFFERENT'} (not part of the exit status)"
        )

    diffs = ranks[0]["diffs"]
    agree = all(d <= TOL for d in diffs.values())
    print(f"\nparams after {args.steps} steps, max |diff| from {PARAMS_REF}:")
    print("  " + ", ".join(f"{k} {d:.1e}" for k, d in diffs.items()))
    print(
        "\nstep times: 4 processes on "
        f"{os.cpu_count()} cores over loopback gloo measure work and overhead, not link speed."
    )
    print(
        f"formula check: {'OK' if ok else 'FAILED'}; params agree (<= {TOL:g}): "
        f"{'yes' if agree else 'NO'}; {time.perf_counter() - t_start:.0f} s"
    )
    return 0 if ok and agree else 1


if __name__ == "__main__":
    sys.exit(main())
