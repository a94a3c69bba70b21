"""Data-parallel training with a compressed boundary reduction: fewer bytes per optimizer step.

Every rank holds its shard of each global batch (generated from a shared seed), splits it into
``-n`` micro-batches and accumulates their gradient with ``gradaccum.accumulate(..., sync=...)``.
Nothing is communicated inside the window; at the boundary the window's gradient crosses the
group by the reduction that ``--reduce`` picks:

- ``exact``: ``gradaccum.all_reduce()``, float32, the whole gradient (the reference);
- ``bf16`` / ``fp16``:
  ``gradaccum.compression.compressed_all_reduce(torch.bfloat16 / torch.float16)``, each rank's
  share of the gradient rounded to 16 bits on the wire: half the bytes;
- ``topk``: ``gradaccum.compression.topk_all_reduce(ratio=--ratio)``, the largest ``ratio`` of
  the elements (values and int64 indices, all-gathered), the rest kept in an error-feedback
  buffer and sent later;
- ``powersgd``: ``gradaccum.compression.powersgd(rank=--powersgd-rank)``, each weight matrix
  sent as two thin factors (one power iteration per window), with error feedback.

The compressed reductions are ``gradaccum.custom_reduce`` functions: before calling them,
gradaccum sums the window's rows and a failure flag over the group (a 32-byte all_reduce; it
also checks that the ranks agree on the gradient tree) and divides each rank's sums by the
global rows, so every rank's share is at the scale of the gradient and the shares add up to the
exact gradient of the global batch. The script prints what ``gradaccum.sync.record_collectives()``
logged per optimizer step and how that compares with the exact all_reduce's bytes, and checks
that every rank ends with the same parameters.

With ``--check``, every rank also trains a second copy of the model, in lockstep on the same
batches, with the exact ``gradaccum.all_reduce()``, and compares the held-out losses: the script
exits with status 1 when the compressed run's loss exceeds the exact run's by more than the
method's tolerance (relative: 1e-6 for exact, 2% for bf16 and fp16, 5% for powersgd, 15% for topk
at the defaults; a smaller ``--ratio`` needs more ``--steps``).

Run it (a few seconds on 2 CPU cores)::

    torchrun --standalone --nproc_per_node 2 examples/compression.py --reduce bf16 --check
    torchrun --standalone --nproc_per_node 2 examples/compression.py --reduce topk --ratio 0.1
    python examples/compression.py --reduce fp16 --check   # one process: a world of one
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import socket
import sys
import time
from collections import defaultdict

import torch
import torch.distributed as dist
from torch import nn
from torch.func import functional_call
from tqdm import tqdm

import gradaccum

D_IN, CLASSES = 16, 4
TOLERANCES = {"exact": 1e-6, "bf16": 0.02, "fp16": 0.02, "topk": 0.15, "powersgd": 0.05}


def make_sync(reduce: str, args: argparse.Namespace):
    """The boundary reduction that ``--reduce`` names."""
    if reduce == "exact":
        return gradaccum.all_reduce()
    if reduce == "bf16":
        return gradaccum.compression.compressed_all_reduce(torch.bfloat16)
    if reduce == "fp16":
        return gradaccum.compression.compressed_all_reduce(torch.float16)
    if reduce == "powersgd":
        return gradaccum.compression.powersgd(rank=args.powersgd_rank)
    return gradaccum.compression.topk_all_reduce(ratio=args.ratio)


def init_distributed(device: str) -> torch.device:
    """Initialise the default process group from torchrun's environment; return this rank's device.

    Without torchrun (``python examples/compression.py``) it makes a world of one on 127.0.0.1.
    """
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    cuda = device == "cuda" or (
        device == "auto" and torch.cuda.is_available() and torch.cuda.device_count() >= local_world
    )
    timeout = datetime.timedelta(seconds=120)
    if cuda:
        here = torch.device("cuda", local_rank)
        torch.cuda.set_device(here)
        backend, kwargs = "nccl", {"device_id": here}
    else:
        here = torch.device("cpu")
        backend, kwargs = "gloo", {}
        if int(os.environ.get("WORLD_SIZE", 1)) == local_world:
            # Every rank is on this machine: keep gloo's traffic on the loopback interface.
            os.environ.setdefault("GLOO_SOCKET_IFNAME", loopback_interface())
    if "RANK" in os.environ:  # launched by torchrun, which sets RANK, WORLD_SIZE, MASTER_*
        dist.init_process_group(backend, timeout=timeout, **kwargs)
    else:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group(
            backend,
            init_method=f"tcp://127.0.0.1:{port}",
            rank=0,
            world_size=1,
            timeout=timeout,
            **kwargs,
        )
    return here


def loopback_interface() -> str:
    names = [name for _, name in getattr(socket, "if_nameindex", list)()]
    return "lo0" if "lo0" in names and "lo" not in names else "lo"  # macOS calls it lo0


def make_teacher(seed: int):
    """A fixed random network whose (noisy) argmax labels the inputs: a learnable task."""
    gen = torch.Generator().manual_seed(seed)
    w1 = torch.randn(D_IN, 32, generator=gen)
    w2 = torch.randn(32, CLASSES, generator=gen)

    def label(x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
        scores = torch.tanh(x @ w1 / D_IN**0.5) @ w2
        return (scores + 0.3 * torch.randn(scores.shape, generator=gen)).argmax(dim=1)

    return label


def make_data(label, rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows`` generated points (CPU); the same on every rank for the same seed."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, D_IN, generator=gen)
    return x, label(x, gen)


def make_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(D_IN, 128), nn.Tanh(), nn.Linear(128, 128), nn.Tanh(), nn.Linear(128, CLASSES)
    )


class Run:
    """One model, its optimizer and schedule, and its accumulated step under one reduction."""

    def __init__(self, args: argparse.Namespace, reduce: str, device: torch.device) -> None:
        self.model = make_model(args.seed).to(device)  # the same initial weights on every rank
        self.params = gradaccum.params_of(self.model)  # views: optimizer.step() updates them
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1, momentum=0.9)
        steps = args.steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(  # cosine decay to zero
            self.optimizer, lambda i: 0.5 * (1 + math.cos(math.pi * i / steps))
        )
        self.sync = make_sync(reduce, args)
        model = self.model

        def loss_fn(params: dict[str, torch.Tensor], batch) -> torch.Tensor:
            x, y = batch
            return nn.functional.cross_entropy(functional_call(model, params, (x,)), y)

        self.step = gradaccum.accumulate(
            gradaccum.grad_and_value(loss_fn), args.n, has_aux=True, sync=self.sync
        )

    def train_step(self, shard) -> tuple[torch.Tensor, list[gradaccum.sync.Collective]]:
        with gradaccum.sync.record_collectives() as log:
            grads, loss = self.step(self.params, shard)  # the (estimated) global gradient
        gradaccum.write_grads(self.model, grads)
        self.optimizer.step()
        self.scheduler.step()  # once per optimizer step, i.e. once per window
        return loss, log

    def evaluate(self, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
        with torch.no_grad():
            out = self.model(x)
        loss = nn.functional.cross_entropy(out, y).item()
        return loss, (out.argmax(1) == y).double().mean().item()

    def ranks_differ(self) -> int:
        """Elements of this rank's parameters that are not bit-identical to rank 0's (max)."""
        flat = torch.cat([p.detach().reshape(-1) for p in self.model.parameters()])
        ref = flat.clone()
        dist.broadcast(ref, src=0)
        differ = (flat.view(torch.int32) != ref.view(torch.int32)).sum().reshape(1).double()
        dist.all_reduce(differ, op=dist.ReduceOp.MAX)
        return int(differ.item())


def per_step_bytes(logs: list[list[gradaccum.sync.Collective]]) -> dict[str, float]:
    """Mean bytes per optimizer step, by collective and purpose, over the steps after the first."""
    later = logs[1:] or logs
    total: dict[str, float] = defaultdict(float)
    for log in later:
        for c in log:
            total[f"{c.kind} ({c.purpose}, {str(c.dtype).removeprefix('torch.')})"] += c.nbytes
    return {k: v / len(later) for k, v in total.items()}


def train(args: argparse.Namespace, device: torch.device) -> int:
    rank, world = dist.get_rank(), dist.get_world_size()

    def say(*lines: str) -> None:
        if rank == 0:
            print(*lines, sep="\n", flush=True)

    label = make_teacher(args.seed)
    run = Run(args, args.reduce, device)
    exact = Run(args, "exact", device) if args.check else None
    # What the exact all_reduce would send per step: its bucket plan (nothing is communicated).
    exact_bytes = sum(b.nbytes for b in gradaccum.all_reduce().plan(run.params))
    rows = [len(part) for part in torch.arange(args.batch).tensor_split(world)]
    say(
        f"{world} rank(s), {dist.get_backend()} on {device.type}; {args.steps} steps, global batch "
        f"{args.batch} rows = {rows} per rank, {args.n} micro-batches per rank",
        f"reduction: {args.reduce} = {getattr(run.sync, 'name', 'all_reduce()')}; "
        f"{sum(p.numel() for p in run.params.values())} float32 parameters",
    )

    logs: list[list[gradaccum.sync.Collective]] = []
    started = time.perf_counter()
    progress = tqdm(range(args.steps), unit="step", disable=rank != 0)
    for i in progress:
        # Each rank generates the whole global batch from the shared seed and keeps its shard.
        x, y = make_data(label, args.batch, seed=args.seed * 100_000 + i)
        x, y = x.to(device), y.to(device)
        shard = (x.tensor_split(world)[rank], y.tensor_split(world)[rank])
        loss, log = run.train_step(shard)
        logs.append(log)
        if exact is not None:
            exact.train_step(shard)  # the same batch, the exact all_reduce
        if i % 10 == 0 or i == args.steps - 1:
            progress.set_postfix(loss_rank0=f"{loss.item():.4f}")
    progress.close()
    elapsed = time.perf_counter() - started

    x_eval, y_eval = make_data(label, 4000, seed=args.seed * 100_000 - 1)
    x_eval, y_eval = x_eval.to(device), y_eval.to(device)
    final, accuracy = run.evaluate(x_eval, y_eval)
    by_purpose = per_step_bytes(logs)
    sent = sum(by_purpose.values())
    differ = run.ranks_differ()
    say(
        f"trained in {elapsed:.1f} s",
        "bytes per optimizer step (gradaccum's collectives, mean over steps 2..): "
        + ", ".join(f"{k}: {v:,.0f}" for k, v in by_purpose.items()),
        f"bytes per step: {sent:,.0f}, {sent / exact_bytes:.3f} x the exact all_reduce's "
        f"{exact_bytes:,}",
        f"final held-out loss: {final:.4f} (accuracy {accuracy:.1%})",
        f"parameters bit-identical on every rank: {differ == 0}",
    )
    ok = differ == 0
    if exact is not None:
        ref, ref_accuracy = exact.evaluate(x_eval, y_eval)
        excess = (final - ref) / ref
        tol = TOLERANCES[args.reduce]
        good = math.isfinite(final) and excess <= tol
        ok = ok and good
        say(
            f"exact all_reduce's held-out loss: {ref:.4f} (accuracy {ref_accuracy:.1%})",
            f"loss vs exact: {excess:+.2%} (tolerance {tol * 100:g}%) {'OK' if good else 'FAILED'}",
        )
    say("OK" if ok else "FAILED")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reduce", choices=sorted(TOLERANCES), default="bf16")
    parser.add_argument(
        "--ratio", type=float, default=0.01, help="topk: fraction sent (default 0.01)"
    )
    parser.add_argument(
        "--powersgd-rank", type=int, default=4, help="powersgd: rank of the factors (default 4)"
    )
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps (default 200)")
    # Not --n: torchrun would take it for an abbreviation of its own --nnodes / --nproc-per-node.
    parser.add_argument(
        "-n", "--micro-batches", dest="n", type=int, default=4, help="per rank (default 4)"
    )
    parser.add_argument("--batch", type=int, default=128, help="global batch rows (default 128)")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--check", action="store_true", help="compare with the exact all_reduce")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", 1))
    if args.steps < 1 or args.n < 1 or args.batch < world:
        parser.error(f"need --steps >= 1, -n >= 1 and --batch >= the number of ranks ({world})")
    if not 0 < args.ratio <= 1 or args.powersgd_rank < 1:
        parser.error("need 0 < --ratio <= 1 and --powersgd-rank >= 1")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: PyTorch sees no CUDA device here; use --device cpu")
    # The model is tiny: one intra-op thread per rank is the fastest, also on a busy machine.
    torch.set_num_threads(1)

    device = init_distributed(args.device)
    try:
        return train(args, device)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
