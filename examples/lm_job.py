"""The job of issue 17, shared by examples/lm_loop.py and the versions in examples/compare/.

What is the same in every version lives here and is not counted: the model, the dataset, the
padding collate function, how each rank's shard and loader are built, the launcher, and the
checks. Each version is a function ``train(job, rank, world) -> (model, scheduler)`` written
between the markers ``# --- the job: begin ---`` and ``# --- the job: end ---``: that is the
user code, counted by ``count_lines`` (non-blank lines that are not only a comment, of the
ruff-formatted file). A version may return a third item, its per-window global mean losses
(floats, or ``StepStats``: ``examples/lm_loop.py`` returns its progress bar's ``history``),
which ``--plot PATH`` draws beside the reference's.

The job:

- a tiny causal LM in float64 over padded sequences of random lengths (labels -100 on padding);
- the loss: the mean over the non-padding tokens of the whole global window;
- ``n = 4`` micro-batches of 2 sequences per window, over a loader whose length is not a
  multiple of ``n``: with 81 sequences on 2 ranks, 21 and 20 micro-batches, so the last window
  of each epoch holds 1 micro-batch on rank 0 and none on rank 1; two epochs;
- AdamW with a warm-up ``LambdaLR`` stepped once per optimizer step, clipping to 1.0;
- a tqdm bar of the global mean loss; a mid-window checkpoint that resumes bit-identically.

``main(train)`` runs a version and checks it: its parameters against a one-process float64
reference that trains on each whole global window (the same micro-batches of every rank, one
backward; at most 1e-10 apart), the number of scheduler and optimizer steps against the number of
windows, and a run stopped at a mid-window checkpoint and resumed against the uninterrupted one
(``torch.equal``). It exits with status 1 if a check fails. With ``--plot PATH``, rank 0 also
writes a PNG of the version's per-window global mean loss beside the reference's (the whole
window's token-mean loss before each optimizer step), and checks that they agree (<= 1e-10).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import math
import os
import re
import socket
import sys
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _plot import loss_curves
from torch import nn
from torch.utils.data import DataLoader, Subset

VOCAB, PAD, IGNORE = 24, 0, -100
BEGIN, END = "# --- the job: begin ---", "# --- the job: end ---"
TOLERANCE = 1e-10


@dataclass(frozen=True)
class Job:
    rows: int = 81  # sequences in the dataset, split over the ranks
    micro_batch: int = 2  # sequences per micro-batch
    n: int = 4  # micro-batches per window
    epochs: int = 2
    max_len: int = 16
    lr: float = 3e-3
    warmup: int = 4  # optimizer steps of linear warm-up
    clip: float = 1.0
    seed: int = 0
    checkpoint: str = ""  # a directory
    save_at: tuple[int, int] | None = None  # (window, micro-batches added): save there, stop
    # (a crash, as far as the run is concerned)
    resume: bool = False


class TinyLM(nn.Module):
    """Token and position embeddings, one pre-norm causal attention block, a linear head."""

    def __init__(self, max_len: int = 16, dim: int = 32, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.tokens, self.positions = nn.Embedding(VOCAB, dim), nn.Embedding(max_len, dim)
        self.norm1, self.norm2, self.norm_out = (nn.LayerNorm(dim) for _ in range(3))
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.head = nn.Linear(dim, VOCAB)
        self.double()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        b, t = tokens.shape
        h = self.tokens(tokens) + self.positions(torch.arange(t, device=tokens.device))
        q, k, v = self.qkv(self.norm1(h)).view(b, t, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        a = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = h + self.proj(a.transpose(1, 2).reshape(b, t, -1))
        h = h + self.mlp(self.norm2(h))
        return self.head(self.norm_out(h))


def dataset(job: Job) -> list[torch.Tensor]:
    """``job.rows`` token sequences of 3..max_len tokens (1..VOCAB-1), fixed by a seed."""
    g = torch.Generator().manual_seed(1234)
    lengths = torch.randint(3, job.max_len + 1, (job.rows,), generator=g).tolist()
    return [torch.randint(1, VOCAB, (length,), generator=g) for length in lengths]


def pad(sequences: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """A micro-batch: inputs padded with PAD, next-token labels padded with -100."""
    inputs = nn.utils.rnn.pad_sequence([s[:-1] for s in sequences], True, PAD)
    labels = nn.utils.rnn.pad_sequence([s[1:] for s in sequences], True, IGNORE)
    return {"input_ids": inputs, "labels": labels}


def loader(job: Job, rank: int, world: int) -> DataLoader:
    """This rank's loader: every ``world``-th sequence (the ranks may differ in length),
    shuffled with the global torch RNG each epoch, ``job.micro_batch`` sequences a micro-batch.
    """
    shard = Subset(dataset(job), range(rank, job.rows, world))
    return DataLoader(shard, batch_size=job.micro_batch, shuffle=True, collate_fn=pad)


def token_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, Any]:
    """The summed cross-entropy over the micro-batch's tokens (not padding), and their count."""
    logits = model(batch["input_ids"])
    summed = nn.functional.cross_entropy(
        logits.flatten(0, 1), batch["labels"].flatten(), reduction="sum"
    )
    return summed, (batch["labels"] != IGNORE).sum()


def warmup(job: Job):
    return lambda step: min(1.0, (step + 1) / job.warmup)


# -- the reference ------------------------------------------------------------------------------


def reference(job: Job, world: int) -> tuple[nn.Module, list[float], list[int]]:
    """One process: every global window (the micro-batches of all ranks) in one backward.

    The ranks' loaders shuffle with the global RNG, from the same state on every rank (the
    seed, then the model's initialisation); each epoch is replayed here rank by rank.
    Returns the model, each window's loss (the token mean over the whole global window, before
    its optimizer step; one per window) and the ranks' micro-batches per epoch.
    """
    torch.manual_seed(job.seed)
    model = TinyLM(job.max_len)
    optimizer = torch.optim.AdamW(model.parameters(), lr=job.lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup(job))
    loaders = [loader(job, r, world) for r in range(world)]
    losses = []
    for _ in range(job.epochs):
        state = torch.get_rng_state()
        per_rank = []
        for one in loaders:
            torch.set_rng_state(state)
            per_rank.append(list(one))
        for k in range(max(math.ceil(len(b) / job.n) for b in per_rank)):
            micro = [mb for b in per_rank for mb in b[k * job.n : (k + 1) * job.n]]
            parts = [token_loss(model, mb) for mb in micro]
            count = sum(c for _, c in parts)
            loss = sum(s for s, _ in parts) / count
            loss.backward()
            losses.append(loss.item())
            nn.utils.clip_grad_norm_(model.parameters(), job.clip)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
    return model, losses, [len(b) for b in per_rank]


# -- counting lines -----------------------------------------------------------------------------


def count_lines(path: str | Path) -> int:
    """User code: the non-blank lines between the markers that are not only a comment."""
    text = Path(path).read_text()
    match = re.search(rf"^{re.escape(BEGIN)}$(.*?)^{re.escape(END)}$", text, re.S | re.M)
    if match is None:
        raise ValueError(f"{path}: no '{BEGIN}' ... '{END}' markers")
    lines = [line.strip() for line in match.group(1).splitlines()]
    return sum(1 for line in lines if line and not line.startswith("#"))


# -- running and checking -----------------------------------------------------------------------


def _steps(scheduler: Any) -> tuple[int, int]:
    """(scheduler steps, optimizer steps) of a scheduler (Accelerate's wrapper unwrapped)."""
    scheduler = getattr(scheduler, "scheduler", scheduler)
    optimizer = getattr(scheduler.optimizer, "optimizer", scheduler.optimizer)
    state = next(iter(optimizer.state.values()))
    return scheduler.last_epoch, int(state["step"])


def check(
    train, job: Job, rank: int, world: int, save_at: tuple[int, int] | None, plot: str | None
) -> bool:
    def say(*lines: str) -> None:
        if rank == 0:
            print(*lines, sep="\n", flush=True)

    model, scheduler, *reported = train(job, rank, world)
    ref, ref_losses, lengths = reference(job, world)
    windows = len(ref_losses)
    diff = max((p - q).abs().max().item() for p, q in zip(model.parameters(), ref.parameters()))
    steps = _steps(scheduler)
    verdict = [diff, float(steps != (windows, windows))]
    say(
        f"{world} process(es); micro-batches per rank {lengths}, n={job.n}, {job.epochs} "
        f"epochs: {windows} windows",
        f"scheduler steps {steps[0]}, optimizer steps {steps[1]}, windows {windows} "
        f"{'OK' if steps == (windows, windows) else 'FAILED'}",
    )
    if save_at is not None:
        with tempfile.TemporaryDirectory() as tmp:
            folder = _shared_dir(tmp)
            stopped = replace(job, checkpoint=folder, save_at=save_at)
            train(stopped, rank, world)
            resumed = train(replace(stopped, save_at=None, resume=True), rank, world)[0]
            same = all(torch.equal(p, q) for p, q in zip(model.parameters(), resumed.parameters()))
        verdict.append(float(not same))
    if plot:
        verdict.append(_plot(plot, reported, ref_losses, job, rank, world))
    if dist.is_initialized():
        t = torch.tensor(verdict, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        verdict = t.tolist()
    ok = verdict[0] <= TOLERANCE and not any(verdict[1:])
    say(
        f"max parameter difference vs the whole-window reference: {verdict[0]:.3e} "
        f"(tolerance {TOLERANCE:g}) {'OK' if verdict[0] <= TOLERANCE else 'FAILED'}"
    )
    if save_at is not None:
        say(
            f"resumed from a checkpoint at window {save_at[0]} after micro-batch {save_at[1]}: "
            f"bit-identical to the uninterrupted run: {not verdict[2]}"
        )
    say("OK" if ok else "FAILED")
    return ok


def _plot(
    path: str, reported: list[Any], ref_losses: list[float], job: Job, rank: int, world: int
) -> float:
    """On rank 0, draw the version's per-window losses beside the reference's; 1.0 if they
    differ by more than the tolerance (or the version reported none), else 0.0.
    """
    if rank != 0:
        return 0.0
    if not reported:
        print(f"--plot {path}: train() returned no per-window losses to plot FAILED", flush=True)
        return 1.0
    losses = [float(getattr(s, "loss", s)) for s in reported[0]]
    if len(losses) != len(ref_losses):
        print(f"--plot: {len(losses)} losses for {len(ref_losses)} windows FAILED", flush=True)
        return 1.0
    diff = max(abs(a - b) for a, b in zip(losses, ref_losses))
    curves = {"whole-window reference": ref_losses, f"accumulated, n={job.n}": losses}
    title = f"{job.rows} sequences on {world} process(es), n={job.n}, {job.epochs} epochs"
    written = loss_curves(
        path, curves, title=title, xlabel="window (optimizer step)", ylabel="global mean token loss"
    )
    print(
        f"wrote {written}: per-window loss vs the reference: max difference {diff:.3e} "
        f"{'OK' if diff <= TOLERANCE else 'FAILED'}",
        flush=True,
    )
    return float(diff > TOLERANCE)


def _shared_dir(tmp: str) -> str:
    """One directory for every rank (rank 0's temporary one)."""
    if not dist.is_initialized():
        return tmp
    names = [tmp]
    dist.broadcast_object_list(names, src=0)
    return names[0]


def _environ(rank: int, world: int, port: int) -> None:
    """What torchrun sets (Accelerate reads it too), for a process this script starts."""
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )


def _rank_main(
    rank: int,
    world: int,
    port: int,
    train,
    job: Job,
    save_at: tuple[int, int] | None,
    plot: str | None,
) -> None:
    if port:
        _environ(rank, world, port)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # the model is tiny: one thread per process
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    try:
        ok = check(train, job, dist.get_rank(), dist.get_world_size(), save_at, plot)
        dist.barrier()  # nothing in flight when the first rank tears its connections down
    finally:
        dist.destroy_process_group()
    if not ok:
        sys.exit(1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main(train, description: str, argv: list[str] | None = None) -> int:
    """Run ``train`` on ``--nproc`` gloo processes (or under torchrun) and check it."""
    parser = argparse.ArgumentParser(description=description.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=1, help="gloo processes to start")
    parser.add_argument("--rows", type=int, default=Job.rows, help="sequences (default 81)")
    parser.add_argument("--epochs", type=int, default=Job.epochs)
    parser.add_argument("--save-at", default="7,2", help="window,micro-batch of the checkpoint")
    parser.add_argument("--no-resume-check", action="store_true")
    parser.add_argument(
        "--plot", metavar="PATH", help="write the per-window loss beside the reference's (PNG)"
    )
    args = parser.parse_args(argv)
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        parser.error("--plot needs matplotlib: pip install -e '.[plot]' (or drop --plot)")
    window, micro = (int(x) for x in args.save_at.split(","))
    job = Job(rows=args.rows, epochs=args.epochs)
    save_at = None if args.no_resume_check else (window, micro)
    if "RANK" in os.environ:  # under torchrun
        try:
            _rank_main(0, 0, 0, train, job, save_at, args.plot)
        except SystemExit:
            return 1
        return 0
    world, port = args.nproc, free_port()
    if world == 1:
        try:
            _rank_main(0, 1, port, train, job, save_at, args.plot)
        except SystemExit:
            return 1
        return 0
    try:
        mp.start_processes(
            _rank_main, args=(world, port, train, job, save_at, args.plot), nprocs=world
        )
    except mp.ProcessExitedException:
        return 1
    return 0
