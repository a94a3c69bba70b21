"""Check a version of docs/loop.md's job, and count its lines.

The three versions (``examples/lm_loop.py``, ``examples/compare/ddp_loop.py``,
``examples/compare/accelerate_loop.py``) are self-contained files with no checking code: each
defines ``TinyLM``, ``sequences``, ``pad``, ``token_loss`` and ``train(rows, path, save_at)``,
which returns the trained model, its scheduler and its per-window global mean losses. This
script imports a version and checks, on ``--nproc`` gloo processes (or under torchrun):

- its parameters against a one-process float64 reference that trains on each whole global
  window in one backward (the micro-batches of every rank; at most 1e-10 apart);
- one scheduler and one optimizer step per window;
- a run resumed from the checkpoint that a first run saved at window ``--save-at``, against
  that uninterrupted first run (``torch.equal``): the checkpoint must exist, and the resumed
  run must make fewer windows than the first;
- with ``--plot PATH``, rank 0 writes a PNG of the version's per-window loss beside the
  reference's (the whole window's token-mean loss before each optimizer step), which must
  agree (<= 1e-10).

It exits with status 1 if a check fails. ``count_lines`` and ``loop_lines`` are the counting
rule of docs/loop.md's table. Run it (a few seconds on 2 CPU cores)::

    python examples/compare/check_job.py examples/lm_loop.py               # one process
    python examples/compare/check_job.py examples/lm_loop.py --nproc 2     # 2 gloo processes
    python examples/compare/check_job.py examples/compare/ddp_loop.py --nproc 2 --rows 73
    torchrun --standalone --nproc_per_node 2 examples/compare/check_job.py examples/lm_loop.py
    python examples/compare/check_job.py examples/lm_loop.py --nproc 2 --plot loss.png
"""

from __future__ import annotations

import argparse
import ast
import datetime
import importlib.util
import math
import os
import socket
import sys
import tempfile
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _plot import loss_curves  # noqa: E402

# The job (docs/loop.md, "The job"): what the reference trains, and every version must.
SEED, LR, WARMUP, CLIP = 0, 3e-3, 4, 1.0
MICRO_BATCH, N, EPOCHS = 2, 4, 2
TOLERANCE = 1e-10


# -- counting lines -----------------------------------------------------------------------------


def _counted(text: str) -> list[int]:
    """The 1-based numbers of the counted lines of a file's text (see ``count_lines``)."""
    tree = ast.parse(text)
    docstring: set[int] = set()
    if tree.body and isinstance(tree.body[0], ast.Expr):
        first = tree.body[0].value
        if isinstance(first, ast.Constant) and isinstance(first.value, str):
            docstring = set(range(first.lineno, (first.end_lineno or first.lineno) + 1))
    return [
        number
        for number, line in enumerate(text.splitlines(), start=1)
        if line.strip() and not line.strip().startswith("#") and number not in docstring
    ]


def count_lines(path: str | Path) -> int:
    """The lines of a file that are neither blank, nor only a comment, nor in its docstring.

    The module docstring is the file's first statement, if a string; every other line counts,
    imports, class and function docstrings and the ``__main__`` block included. The files are
    ruff-formatted (``ruff format --check`` in CI), so a count is of code as ruff writes it.
    """
    return len(_counted(Path(path).read_text()))


def loop_lines(path: str | Path) -> int:
    """The counted lines of the file's training loop: its first ``for`` statement, to its end."""
    text = Path(path).read_text()
    loops = [node for node in ast.walk(ast.parse(text)) if isinstance(node, ast.For)]
    if not loops:
        raise ValueError(f"{path}: no for statement")
    first = min(loops, key=lambda node: node.lineno)
    span = range(first.lineno, (first.end_lineno or first.lineno) + 1)
    return sum(1 for number in _counted(text) if number in span)


# -- the reference ------------------------------------------------------------------------------


def load_version(path: str | Path) -> ModuleType:
    """Import a version from its file (its ``__main__`` block does not run)."""
    path = Path(path).resolve()
    spec = importlib.util.spec_from_file_location(f"job_{path.stem}", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def rank_loader(version: ModuleType, rows: int, rank: int, world: int) -> DataLoader:
    """A rank's loader as the job defines it: every ``world``-th of the version's sequences,
    micro-batches of 2 padded by its ``pad``, shuffled with the global torch RNG each epoch.
    """
    shard = version.sequences(rows)[rank::world]
    return DataLoader(shard, batch_size=MICRO_BATCH, shuffle=True, collate_fn=version.pad)


def reference(version: ModuleType, rows: int, world: int) -> tuple[nn.Module, list[float], list]:
    """One process: every global window (the micro-batches of all ranks) in one backward.

    The ranks' loaders shuffle with the global RNG, from the same state on every rank (the
    seed, then the model's initialisation); each epoch is replayed here rank by rank. The loss
    is the mean over the window's non-padding tokens (the model's logits are (batch, time,
    vocab)). Returns the model, each window's loss (before its optimizer step) and the ranks'
    micro-batches per epoch.
    """
    torch.manual_seed(SEED)
    model = version.TinyLM().double()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: min(1.0, (i + 1) / WARMUP))
    loaders = [rank_loader(version, rows, r, world) for r in range(world)]
    losses = []
    for _ in range(EPOCHS):
        state = torch.get_rng_state()
        per_rank = []
        for one in loaders:
            torch.set_rng_state(state)
            per_rank.append(list(one))
        for k in range(max(math.ceil(len(b) / N) for b in per_rank)):
            micro = [mb for b in per_rank for mb in b[k * N : (k + 1) * N]]
            inputs = [x for x, _ in micro]
            labels = torch.cat([y.flatten() for _, y in micro])
            logits = torch.cat([model(x).flatten(0, 1) for x in inputs])
            loss = nn.functional.cross_entropy(logits, labels)  # the mean over the tokens
            loss.backward()
            losses.append(loss.item())
            nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            optimizer.step()
            warmup.step()
            optimizer.zero_grad()
    return model, losses, [len(b) for b in per_rank]


# -- running and checking -----------------------------------------------------------------------


def _steps(scheduler: Any) -> tuple[int, int]:
    """(scheduler steps, optimizer steps) of a scheduler (Accelerate's wrapper unwrapped)."""
    scheduler = getattr(scheduler, "scheduler", scheduler)
    optimizer = getattr(scheduler.optimizer, "optimizer", scheduler.optimizer)
    state = next(iter(optimizer.state.values()))
    return scheduler.last_epoch, int(state["step"])


def _losses(reported: Any) -> list[float]:
    """Per-window losses: floats, or ``StepStats`` (gradaccum's ``bar.history``)."""
    return [float(getattr(s, "loss", s)) for s in reported]


def check(path: str, rows: int, rank: int, world: int, save_at: int, plot: str | None) -> bool:
    def say(*lines: str) -> None:
        if rank == 0:
            print(*lines, sep="\n", flush=True)

    version = load_version(path)
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = str(Path(_shared_dir(tmp)) / "checkpoint")
        model, scheduler, reported = version.train(rows, checkpoint, save_at)
        saved = os.path.exists(checkpoint)
        if dist.is_initialized():
            dist.barrier()  # every rank is done with the first run before any resumes
        resumed, _, again = version.train(rows, checkpoint, save_at)
        if dist.is_initialized():
            dist.barrier()  # no rank deletes the checkpoint while another reads it
    same = all(torch.equal(p, q) for p, q in zip(model.parameters(), resumed.parameters()))
    ref, ref_losses, lengths = reference(version, rows, world)
    windows = len(ref_losses)
    diff = max((p - q).abs().max().item() for p, q in zip(model.parameters(), ref.parameters()))
    steps = _steps(scheduler)
    went_on = saved and len(again) < len(reported)
    verdict = [diff, float(steps != (windows, windows)), float(not (same and went_on))]
    say(
        f"{world} process(es); micro-batches per rank {lengths}, n={N}, {EPOCHS} epochs: "
        f"{windows} windows",
        f"scheduler steps {steps[0]}, optimizer steps {steps[1]}, windows {windows} "
        f"{'OK' if steps == (windows, windows) else 'FAILED'}",
    )
    if plot:
        verdict.append(_plot(plot, _losses(reported), ref_losses, rows, rank, world))
    if dist.is_initialized():
        t = torch.tensor(verdict, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        verdict = t.tolist()
    ok = verdict[0] <= TOLERANCE and not any(verdict[1:])
    say(
        f"max parameter difference vs the whole-window reference: {verdict[0]:.3e} "
        f"(tolerance {TOLERANCE:g}) {'OK' if verdict[0] <= TOLERANCE else 'FAILED'}",
        f"checkpoint saved at window {save_at}: {saved}; the run resumed from it made "
        f"{len(again)} of {len(reported)} windows and is bit-identical to the uninterrupted "
        f"run: {not verdict[2]}",
        "OK" if ok else "FAILED",
    )
    return ok


def _plot(
    path: str, losses: list[float], ref_losses: list[float], rows: int, rank: int, world: int
) -> float:
    """On rank 0, draw the version's per-window losses beside the reference's; 1.0 if they
    differ by more than the tolerance (or the version reported none), else 0.0.
    """
    if rank != 0:
        return 0.0
    if not losses:
        print(f"--plot {path}: train() returned no per-window losses to plot FAILED", flush=True)
        return 1.0
    if len(losses) != len(ref_losses):
        print(f"--plot: {len(losses)} losses for {len(ref_losses)} windows FAILED", flush=True)
        return 1.0
    diff = max(abs(a - b) for a, b in zip(losses, ref_losses))
    curves = {"whole-window reference": ref_losses, f"accumulated, n={N}": losses}
    title = f"{rows} sequences on {world} process(es), n={N}, {EPOCHS} epochs"
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
    rank: int, world: int, port: int, path: str, rows: int, save_at: int, plot: str | None
) -> None:
    if port:
        _environ(rank, world, port)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # the model is tiny: one thread per process
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    try:
        ok = check(path, rows, dist.get_rank(), dist.get_world_size(), save_at, plot)
        dist.barrier()  # nothing in flight when the first rank tears its connections down
    finally:
        dist.destroy_process_group()
    if not ok:
        sys.exit(1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main(argv: list[str] | None = None) -> int:
    """Check a version on ``--nproc`` gloo processes (or under torchrun)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("version", help="the version's file, e.g. examples/lm_loop.py")
    parser.add_argument("--nproc", type=int, default=1, help="gloo processes to start")
    parser.add_argument("--rows", type=int, default=81, help="sequences (default 81)")
    parser.add_argument("--save-at", type=int, default=7, help="the checkpoint's window")
    parser.add_argument(
        "--plot", metavar="PATH", help="write the per-window loss beside the reference's (PNG)"
    )
    args = parser.parse_args(argv)
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        parser.error("--plot needs matplotlib: pip install -e '.[plot]' (or drop --plot)")
    run = (args.version, args.rows, args.save_at, args.plot)
    try:
        if "RANK" in os.environ:  # under torchrun
            _rank_main(0, 0, 0, *run)
        elif args.nproc == 1:
            _rank_main(0, 1, free_port(), *run)
        else:
            mp.start_processes(_rank_main, args=(args.nproc, free_port(), *run), nprocs=args.nproc)
    except (SystemExit, mp.ProcessExitedException):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
