"""Sharded data parallel (FSDP / ZeRO style) with gradient accumulation: explicit collectives.

Every rank keeps only its shard of the parameters: ``gradaccum.shard`` cuts them into buckets
(one set per parameter group: weights with weight decay, biases without), pads each bucket to a
multiple of the number of ranks and keeps this rank's chunk of each. AdamW steps on the flat
shard tensors (``sharded.shards``), so its two moment buffers are sharded too. Each optimizer
step is one call of ``gradaccum.accumulate(..., sync=gradaccum.reduce_scatter(sharded))`` on the
``gradaccum.sharding.Sharded`` that ``gradaccum.shard`` returned: it all-gathers the full
parameters (one ``all_gather`` per bucket), runs ``-n`` micro-batches through the model, and
returns this rank's shard of the gradient of the mean loss over the *global* batch, exact when
the ranks hold unequal rows (``--batch 45`` on 2 ranks: 23 and 22). Then
``gradaccum.boundary.clip_by_global_norm`` over the shards (one one-element ``all_reduce``),
``sharded.write_grads`` and ``optimizer.step()``. No module hooks: the module
itself is moved to the meta device and only lends its structure to ``functional_call``.

``--policy`` picks when gradients are reduce-scattered: ``boundary`` (full gradients accumulate
locally; one ``reduce_scatter`` per bucket per optimizer step), ``every`` (each micro-batch's
gradient is reduce-scattered bucket by bucket during its backward and added into a shard:
gradient memory about 1/world, ``n`` times the traffic), or ``mixed`` (``every`` for the
weights, ``boundary`` for the biases: a policy per parameter group). ``--gather micro_batch``
all-gathers the parameters before each micro-batch instead of once per step.

``--mesh RxS`` trains the same model hybrid-sharded (HSDP) over an R x S ``DeviceMesh`` of
(replicate, shard) dims instead of one flat group (R*S must be the number of processes): the
parameters are sharded over the S ranks of the shard dim and replicated over the R of the
replicate dim. Gradients are reduce-scattered within the shard dim (per micro-batch or at the
boundary, as the policy says), and the shards are all-reduced across the replicate dim once per
optimizer step, whatever ``-n`` is; the clipping norm is reduced over the shard dim. Every rank
of the mesh still takes its own part of the global batch. See docs/scale.md.

The backend follows the device: NCCL on ``cuda:LOCAL_RANK`` when there is a GPU per local rank,
otherwise gloo on the CPU (pinned to the loopback interface when all ranks run on this machine).

With ``--check``, every rank also trains a plain PyTorch reference in float64 in one process on
the whole global batch (``loss.backward()``, ``clip_grad_norm_``, AdamW with the same parameter
groups, no communication). The script prints the largest parameter difference between the two
and exits with status 1 if it exceeds the tolerance (1e-9 for a float64 run, 1e-4 for float32).
It always prints what ``gradaccum.sync.record_collectives()`` logged per optimizer step, and
fails if that differs from the count the policy predicts, on any rank.

With ``--checkpoint DIR``, each rank saves its shards and its optimizer state to
``DIR/rank<RANK>.pt`` halfway through; at the end a fresh ``Sharded`` and optimizer (from other
initial weights) load them, replay the second half, and must end bit-identical to the
uninterrupted run. Checkpoints are per rank: resume with the same number of ranks (and mesh).

Run it (a few seconds on 2 CPU cores)::

    torchrun --standalone --nproc_per_node 2 examples/fsdp.py --check
    torchrun --standalone --nproc_per_node 2 examples/fsdp.py --policy every --check
    torchrun --standalone --nproc_per_node 2 examples/fsdp.py --batch 45 --dtype float64 --check
    torchrun --standalone --nproc_per_node 2 examples/fsdp.py --policy mixed --checkpoint /tmp/ckpt
    python examples/fsdp.py --check   # one process: a world of one, the same code path
    torchrun --standalone --nproc_per_node 4 examples/fsdp.py --mesh 2x2 --check
    torchrun --standalone --nproc_per_node 4 examples/fsdp.py --mesh 2x2 --policy mixed --check
"""

from __future__ import annotations

import argparse
import collections
import copy
import datetime
import os
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.func import functional_call
from tqdm import tqdm

import gradaccum

DTYPES = {"float64": torch.float64, "float32": torch.float32}
TOLERANCES = {torch.float64: 1e-9, torch.float32: 1e-4}
D_IN, HIDDEN, CLASSES = 16, 64, 4
LR, WEIGHT_DECAY = 3e-3, 0.05
# A policy per parameter group ("decay": the weights, "no_decay": the biases), or one for all.
POLICIES: dict[str, str | dict[str, str]] = {
    "boundary": "boundary",
    "every": "every",
    "mixed": {"decay": "every", "no_decay": "boundary"},
}


def init_distributed(device: str) -> torch.device:
    """Initialise the default process group from torchrun's environment; return this rank's device.

    Without torchrun (``python examples/fsdp.py``) it makes a world of one on 127.0.0.1.
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


def make_mesh(shape: tuple[int, int] | None, device: torch.device) -> DeviceMesh | None:
    """The (replicate, shard) mesh of ``--mesh RxS``; None for one flat group (the default).

    Rank ``r * S + s`` is shard ``s`` of replica ``r``: ranks that share the replica index hold
    the same shards (on a cluster, make S the GPUs of a node, so the shard dim stays in one).
    """
    if shape is None:
        return None
    return init_device_mesh(device.type, shape, mesh_dim_names=("replicate", "shard"))


def make_teacher(seed: int):
    """A fixed random network whose (noisy) argmax labels the inputs: a learnable task."""
    gen = torch.Generator().manual_seed(seed)
    w1 = torch.randn(D_IN, 32, generator=gen, dtype=torch.float64)
    w2 = torch.randn(32, CLASSES, generator=gen, dtype=torch.float64)

    def label(x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
        scores = torch.tanh(x @ w1 / D_IN**0.5) @ w2
        noise = 0.3 * torch.randn(scores.shape, generator=gen, dtype=torch.float64)
        return (scores + noise).argmax(dim=1)

    return label


def make_data(label, rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows`` generated points (float64, CPU); the same on every rank for the same seed."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, D_IN, generator=gen, dtype=torch.float64)
    return x, label(x, gen)


def make_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(D_IN, HIDDEN),
        nn.Tanh(),
        nn.Linear(HIDDEN, HIDDEN),
        nn.Tanh(),
        nn.Linear(HIDDEN, CLASSES),
    )


def param_group(path: str) -> str:
    """The parameter group of a key path such as ``"['0.bias']"``: no weight decay on biases."""
    return "no_decay" if "bias" in path else "decay"


def make_optimizer(groups: dict[str, list[torch.Tensor]]) -> torch.optim.AdamW:
    """AdamW with weight decay on the weights only (the same for shards and for the reference)."""
    return torch.optim.AdamW(
        [
            {"params": groups["decay"], "weight_decay": WEIGHT_DECAY},
            {"params": groups["no_decay"], "weight_decay": 0.0},
        ],
        lr=LR,
    )


@dataclass
class Run:
    """One sharded training run: the shards, their optimizer and the accumulated step."""

    mesh: DeviceMesh | None
    sharded: gradaccum.sharding.Sharded
    sync: gradaccum.sharding.ReduceScatter
    optimizer: torch.optim.AdamW
    step: Callable


def build(
    args: argparse.Namespace, model: nn.Module, skeleton: nn.Module, mesh: DeviceMesh | None
) -> Run:
    """Shard ``model``'s params (rank 0's values on every rank); an optimizer and a step on them.

    Over the default group, or over ``mesh``'s shard dim with replicas along its replicate dim.
    """

    def loss_fn(params: dict[str, torch.Tensor], batch) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(functional_call(skeleton, params, (x,)), y)

    sharded = gradaccum.shard(
        gradaccum.params_of(model), mesh, bucket_mb=args.bucket_mb, param_groups=param_group
    )
    optimizer = make_optimizer({name: sharded.group_shards(name) for name in ("decay", "no_decay")})
    sync = gradaccum.reduce_scatter(sharded, policy=POLICIES[args.policy], gather=args.gather)
    # gradaccum.grad_and_value: the fast path. Each backward adds into the boundary buckets in
    # place (boundary) or reduce-scatters each bucket as soon as it is complete (every).
    step = gradaccum.accumulate(gradaccum.grad_and_value(loss_fn), args.n, has_aux=True, sync=sync)
    return Run(mesh, sharded, sync, optimizer, step)


def train_step(
    run: Run, batch, max_norm: float
) -> tuple[torch.Tensor, torch.Tensor, list[gradaccum.sync.Collective]]:
    """One optimizer step on this rank's part of a global batch; returns what it communicated."""
    with gradaccum.sync.record_collectives() as log:
        grads, loss = run.step(run.sharded, batch)  # this rank's shards of the global gradient
        # Over the mesh, the norm is reduced over the shard dim (every replica has the same).
        group = dist.group.WORLD if run.mesh is None else run.mesh
        grads, norm = gradaccum.boundary.clip_by_global_norm(grads, max_norm, group=group)
    run.sharded.write_grads(grads)
    run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=True)
    return loss, norm, log


def expected_collectives(run: Run, n: int) -> collections.Counter:
    """What one optimizer step must communicate, from the plan alone (no communication).

    Keys are (kind, purpose, elements, mesh dim); the dim is None over a flat group.
    """
    policy = dict(zip(run.sharded.names, run.sync.policies()))  # parameter group -> policy
    shard, replicate = (None, None) if run.mesh is None else ("shard", "replicate")
    replicas = run.sharded.replicas  # 1 over a flat group: nothing crosses a replicate dim
    expected: collections.Counter = collections.Counter()
    expected["all_reduce", "fingerprint", 2, shard] += 1  # the ranks agree on the layout
    for b in run.sync.plan():  # the reduce-scatter buckets (full, padded sizes)
        every = policy[param_group(b.paths[0])] == "every"
        gathers = n if run.sync.gather == "micro_batch" else 1
        expected["all_gather", "params", b.numel, shard] += gathers
        if every:
            expected["reduce_scatter", "gradients (every)", b.numel, shard] += n
        else:
            expected["reduce_scatter", "gradients", b.numel, shard] += 1
        if replicas > 1:  # this rank's shard of the bucket, once per step whatever n
            expected["all_reduce", "gradients", b.numel // run.sharded.world, replicate] += 1
    expected["all_reduce", "weight", 2, shard] += 1  # the window's rows and the failure flag
    if replicas > 1:  # the replicas agree on the layout, and sum the weight
        expected["all_reduce", "fingerprint", 2, replicate] += 1
        expected["all_reduce", "weight", 2, replicate] += 1
    expected["all_reduce", "norm", 1, shard] += 1  # clip_by_global_norm over the shards
    return expected


def describe_step(log: list[gradaccum.sync.Collective]) -> str:
    """Count and bytes per kind, purpose and mesh dim (``over shard``; none for a flat group)."""
    count: collections.Counter = collections.Counter()
    nbytes: collections.Counter = collections.Counter()
    for c in log:
        count[c.kind, c.purpose, c.dim] += 1
        nbytes[c.kind, c.purpose, c.dim] += c.nbytes
    parts = [
        f"{count[k]} {k[0]} ({k[1]}){'' if k[2] is None else f' over {k[2]}'} of {nbytes[k]} bytes"
        for k in count
    ]
    return f"{len(log)} collectives, {sum(nbytes.values())} bytes: " + ", ".join(parts)


def train(args: argparse.Namespace, device: torch.device) -> int:
    rank, world = dist.get_rank(), dist.get_world_size()
    dtype = DTYPES[args.dtype]

    def say(*lines: str) -> None:
        if rank == 0:
            print(*lines, sep="\n", flush=True)

    label = make_teacher(args.seed)
    model = make_model(args.seed).to(device, dtype)
    reference = copy.deepcopy(model).double() if args.check else None
    # The module lends its structure to functional_call; the params live in the shards.
    skeleton = copy.deepcopy(model).to("meta")
    mesh = make_mesh(args.mesh, device)
    run = build(args, model, skeleton, mesh)
    del model  # from here on, the full params exist only while gathered
    sharded = run.sharded

    rows = [len(part) for part in torch.arange(args.batch).tensor_split(world)]
    full = sum(p.numel() for p in skeleton.parameters())
    layout = (
        "" if mesh is None else f" as a {mesh.shape[0]}x{mesh.shape[1]} (replicate, shard) mesh"
    )
    say(
        f"{world} rank(s){layout}, {dist.get_backend()} on {device.type}; {args.steps} steps, "
        f"global batch {args.batch} rows = {rows} per rank, {args.n} micro-batches per rank, "
        f"{args.dtype}, policy {args.policy}, gather per {args.gather}",
        f"{full} parameters in {len(run.sync.plan())} bucket(s) of "
        f"{[b.numel for b in run.sync.plan()]} elements (padded to a multiple of "
        f"{sharded.world}); rank 0 holds {sum(s.numel() for s in sharded.shards)} of them in "
        f"shards {[tuple(s.shape) for s in sharded.shards]} of groups {list(sharded.names)}"
        f"{f', replicated on {sharded.replicas} ranks' if sharded.replicas > 1 else ''}",
    )
    if reference is not None:
        ref_optimizer = make_optimizer(
            {
                name: [p for path, p in reference.named_parameters() if param_group(path) == name]
                for name in ("decay", "no_decay")
            }
        )

    saved_at = max(1, args.steps // 2)  # with --checkpoint: save after this many steps
    checkpoint = None
    if args.checkpoint is not None:
        checkpoint = Path(args.checkpoint) / f"rank{rank}.pt"
        checkpoint.parent.mkdir(parents=True, exist_ok=True)

    def batch_of(i: int):
        # Each rank generates the whole global batch from the shared seed and keeps its part;
        # a real input pipeline would read only its part (e.g. DistributedSampler).
        x, y = make_data(label, args.batch, seed=args.seed * 100_000 + i)
        x, y = x.to(device, dtype), y.to(device)
        return x, y, (x.tensor_split(world)[rank], y.tensor_split(world)[rank])

    per_step: list[list[gradaccum.sync.Collective]] = []
    clipped = 0
    started = time.perf_counter()
    progress = tqdm(range(args.steps), unit="step", disable=rank != 0)
    for i in progress:
        x, y, part = batch_of(i)
        loss, norm, log = train_step(run, part, args.max_norm)
        per_step.append(log)
        clipped += bool(norm > args.max_norm)

        if reference is not None:  # plain PyTorch, the whole global batch, no communication
            ref_optimizer.zero_grad()
            nn.functional.cross_entropy(reference(x.double()), y).backward()
            nn.utils.clip_grad_norm_(reference.parameters(), args.max_norm)
            ref_optimizer.step()
        if checkpoint is not None and i + 1 == saved_at:
            # Between windows, accumulate holds nothing: the shards and the optimizer state
            # are the whole training state (plus the data position, here the step).
            state = {
                "step": i + 1,
                "sharded": sharded.state_dict(),
                "optimizer": run.optimizer.state_dict(),
            }
            torch.save(state, checkpoint)
        if i % 10 == 0 or i == args.steps - 1:
            loss_text = "none" if loss is None else f"{loss.item():.4f}"  # None: no rows here
            progress.set_postfix(loss_rank0=loss_text, grad_norm=f"{norm.item():.3f}")
    progress.close()
    elapsed = time.perf_counter() - started

    params = sharded.gather()  # the full params, for evaluation and the comparison
    x_eval, y_eval = make_data(label, 2000, seed=args.seed * 100_000 - 1)
    with torch.no_grad():
        logits = functional_call(skeleton, params, (x_eval.to(device, dtype),))
        accuracy = (logits.argmax(1).cpu() == y_eval).double().mean()
    say(
        f"trained in {elapsed:.1f} s; clipped {clipped} of {args.steps} windows "
        f"(max norm {args.max_norm:g}); eval accuracy {accuracy.item():.1%}",
        f"collectives in step 1: {describe_step(per_step[0])}",
        f"collectives per step after that: {describe_step(per_step[-1])}",
    )
    # Expected on every rank, whatever its rows: the same collectives in every step.
    expected = expected_collectives(run, args.n)
    as_expected = all(
        collections.Counter((c.kind, c.purpose, c.numel, c.dim) for c in log) == expected
        for log in per_step
    )

    resumed_ok = True
    if checkpoint is not None:
        # A fresh start from other initial weights: everything comes from the checkpoint.
        resumed = build(args, make_model(args.seed + 1).to(device, dtype), skeleton, mesh)
        state = torch.load(checkpoint, weights_only=True)
        resumed.sharded.load_state_dict(state["sharded"])  # first the shards...
        resumed.optimizer.load_state_dict(state["optimizer"])  # ...then the optimizer on them
        for i in range(state["step"], args.steps):
            train_step(resumed, batch_of(i)[2], args.max_norm)
        resumed_ok = all(
            torch.equal(a, b) for a, b in zip(resumed.sharded.shards, sharded.shards, strict=True)
        )

    diff = 0.0
    if reference is not None:
        diff = max(
            (params[name].double() - p).abs().max().item()
            for name, p in reference.named_parameters()
        )
    # One more collective, not gradaccum's: every rank reaches the verdict of the worst rank.
    worst = torch.tensor(
        [diff, not as_expected, not resumed_ok], dtype=torch.float64, device=device
    )
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    diff, as_expected, resumed_ok = worst[0].item(), not worst[1].item(), not worst[2].item()
    say(f"collectives as the plan predicts, in every step on every rank: {as_expected}")
    if checkpoint is not None:
        say(
            f"checkpoint: saved after step {saved_at} to {checkpoint.parent}/rank<RANK>.pt; a "
            f"fresh Sharded and AdamW loaded it and replayed steps {saved_at + 1}-{args.steps}: "
            f"bit-identical to the uninterrupted run: {resumed_ok}"
        )
    ok = as_expected and resumed_ok
    if reference is None:
        say("OK" if ok else "FAILED")
        return 0 if ok else 1
    tol = TOLERANCES[dtype]
    ok = ok and diff <= tol
    say(f"max parameter difference: {diff:.3e} (tolerance {tol:g}) {'OK' if ok else 'FAILED'}")
    return 0 if ok else 1


def mesh_shape(text: str) -> tuple[int, int]:
    """``"2x4"`` -> (2, 4): R replicas of S shards."""
    r, x, s = text.lower().partition("x")
    if not (x and r.isdigit() and s.isdigit() and int(r) >= 1 and int(s) >= 1):
        raise argparse.ArgumentTypeError(
            f"expected RxS, two positive integers (replicas x shards) such as 2x2, but got {text!r}"
        )
    return int(r), int(s)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100, help="optimizer steps (default 100)")
    # Not --n: torchrun would take it for an abbreviation of its own --nnodes / --nproc-per-node.
    parser.add_argument(
        "-n", "--micro-batches", dest="n", type=int, default=4, help="per rank (default 4)"
    )
    parser.add_argument("--batch", type=int, default=128, help="global batch rows (default 128)")
    parser.add_argument("--policy", choices=sorted(POLICIES), default="boundary")
    parser.add_argument("--gather", choices=["window", "micro_batch"], default="window")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--max-norm", type=float, default=0.5, help="gradient clipping norm")
    parser.add_argument(
        "--bucket-mb", type=float, default=0.01, help="bucket size in MiB (default 0.01: 3 buckets)"
    )
    parser.add_argument("--checkpoint", metavar="DIR", help="save halfway, resume, compare")
    parser.add_argument(
        "--mesh",
        type=mesh_shape,
        metavar="RxS",
        help="hybrid sharding over R replicas x S shards, R*S = processes (default: one group)",
    )
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--check", action="store_true", help="compare with a float64 reference")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.steps < 1 or args.n < 1 or args.batch < 1 or args.bucket_mb <= 0:
        parser.error("need --steps >= 1, -n >= 1, --batch >= 1 and --bucket-mb > 0")
    world = int(os.environ.get("WORLD_SIZE", 1))  # torchrun's; 1 without it
    if args.mesh is not None and args.mesh[0] * args.mesh[1] != world:
        r, s = args.mesh
        parser.error(
            f"--mesh {r}x{s}: expected R x S to equal the number of processes, {world}, but "
            f"{r} x {s} = {r * s}; pass --mesh RxS with R*S = {world} (e.g. --mesh 1x{world}), "
            f"or run {r * s} processes (torchrun --nproc_per_node {r * s})"
        )
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
