"""Hostile probes of ``gradaccum.loop``: each run as a user would, and classified.

Each probe runs a small training job, or one bad call, the way a hostile (or merely unlucky) user
would, and compares the outcome with the right answer: a plain float64 PyTorch loop over the same
global window (``loss * share`` of each micro-batch, ``backward()``, ``clip_grad_norm_``, one
``optimizer.step()``, ``scheduler.step()``, ``zero_grad(set_to_none=True)``), or, for a resume,
the uninterrupted run (bit for bit: parameters, optimizer and scheduler state, the losses of the
windows after the cut, the global RNG at the end). Each outcome is one of:

- ``exact``: equal to plain PyTorch (float64, within 1e-10 relative), or a bit-identical resume;
- ``refused clearly``: an error on every rank whose message starts with the call shape
  (``name(...)``), says what came and gives a fix (the words of tests/test_misuse.py), with
  nothing changed where the probe checks it;
- ``silently wrong``: no error, and another result (or one rank finished normally while another
  raised);
- ``lost or corrupted state``: an error, but the state changed (a refused load that overwrote
  the parameters, a window that stepped the optimizer on one rank);
- ``hang``: a rank still running when the probe's time bound ran out (the process group's
  timeout is far above it, so a wait on it counts as a hang);
- ``crash``: a process killed by a signal, or exiting with another code than 0, without a report;
- ``unclear error``: an error without the call shape or the fix (an exception from torch's
  internals, a message that does not say what to do);
- ``n/a``: the code under test lacks the API the probe needs (e.g. a data factory before issue
  26).

The classes follow issue 26: ``step`` (``Step`` against the plain loop), ``resume`` (resume at
every kind of cut), ``checkpoint`` (``loop.save`` / ``loop.load``), ``ranks`` (2 gloo ranks that
disagree or fail), ``exit`` (a normal interpreter exit after a fault), ``transforms``
(``torch.func`` over ``accumulate``), ``privacy`` (``clip_per_sample`` and ``dp_noise`` under
``reduction="mean"``) and ``windows`` (bad arguments of ``windows()``); ``kinds`` follows issue
35, section 2 (what a ``Step`` loss returns: a bare mean, a plain tuple, ``gradaccum.Mean`` or
``gradaccum.Sum``, against the token mean over the window); ``coupled`` follows its section 4
(``loop.Coupled`` and ``loop.WindowStats``: a window that failed and is added again, a frozen
encoder with a trained temperature, a rank with no micro-batch).

The probes use API forms that exist both before issue 26 and after it (``optimizer=`` by
keyword, ``loop.save(path, step=step, data=data)``; the typed returns where the code has them),
so the same script classifies both. Each
probe runs in processes of its own (forked from a server that imported torch and gradaccum once),
bounded in time; 2-rank probes use gloo on 127.0.0.1 with a process-group timeout of 120 s.

    python benchmarks/loop_probes.py                       # every probe, the gradaccum imported
    python benchmarks/loop_probes.py --quick               # a subset, fewer cuts and exit runs
    python benchmarks/loop_probes.py --before ../before    # also the tree at ../before: 2 columns
    PYTHONPATH=../before python benchmarks/loop_probes.py  # the code from before issue 26 alone
    python benchmarks/loop_probes.py --only resume-every-cut --verbose

``--before PATH`` runs the probes a second time in a subprocess with ``PYTHONPATH=PATH`` (a
checkout of the code from before issue 26: ``git worktree add ../before eddff3b``) and prints
both columns; it also lets the ``load-old-format`` probe write a checkpoint with that code.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import inspect
import json
import math
import multiprocessing as mp
import os
import pickle
import queue
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import _launch
import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset, Subset

import gradaccum
from gradaccum import loop

F64 = torch.float64
TOL = 1e-10  # relative: "equal to plain PyTorch" in float64 (summation order differs)
PG_TIMEOUT = 120.0  # the process group's timeout: far above every probe's bound
BOUND = 30.0  # seconds a probe may run (its own bound, unless it says otherwise)

EXACT, REFUSED, WRONG, CORRUPT = (
    "exact",
    "refused clearly",
    "silently wrong",
    "lost or corrupted state",
)
HANG, CRASH, UNCLEAR, NA = "hang", "crash", "unclear error", "n/a"
OUTCOMES = (EXACT, REFUSED, WRONG, CORRUPT, HANG, CRASH, UNCLEAR, NA)
SEVERITY = {NA: 8, CRASH: 7, HANG: 6, CORRUPT: 5, WRONG: 4, UNCLEAR: 3, REFUSED: 1, EXACT: 0}

# What the code under test offers (the probes run against the code before issue 26 too).
_STEP_ARGS = inspect.signature(loop.Step).parameters
HAS_DATA_ARG = "data" in _STEP_ARGS  # Step(..., data=windows): data errors reach the boundary
HAS_FACTORY = "Callable" in str(inspect.signature(loop.windows).parameters["data"].annotation)
HAS_KINDS = hasattr(gradaccum, "Mean")  # typed loss returns: gradaccum.Mean / Sum (issue 35)
CKPT_FORMAT = str(getattr(sys.modules["gradaccum.loop._save"], "FORMAT", "?"))
BEFORE = os.environ.get("LOOP_PROBES_BEFORE")  # a tree of the code before issue 26, if given

# The words of a clear message (tests/test_misuse.py): the call shape, then a fix.
CALL_SHAPE = re.compile(r"\A[A-Za-z_][\w.]*\(")
FIX = re.compile(
    r"(?:;|\.)\s+(?:.*?\b)?(?:pass|use|call|give|return|load|drop|wrap|start|convert|compute|"
    r"shard|skip|move|build|resume|save|look|check|gather|reduce|take|must|e\.g\.|set|seed|"
    r"decide|restart|keep|change|unfreeze|iterate|make|read|upgrade|leave|divide|instead|see|"
    r"fix|differentiate|rebuild|the cause is in)\b",
    re.IGNORECASE | re.DOTALL,
)


class Injected(Exception):
    """The error a probe injects on purpose (a rank's data or loss failing)."""


# -- verdicts -------------------------------------------------------------------------------------


@dataclass
class Verdict:
    """What one rank of a probe found: ``exact``, ``wrong``, ``corrupt``, ``own`` (the error it
    injected itself, caught), ``n/a``; or an ``error`` that the harness classifies."""

    kind: str
    detail: str = ""
    error: tuple[str, str, str] | None = None  # (type, message, innermost file)
    exit_now: bool = False  # the rank's process ends right after reporting (no lingering)


def ok(detail: str = "") -> Verdict:
    return Verdict("exact", detail)


def wrong(detail: str) -> Verdict:
    return Verdict("wrong", detail)


def corrupt(detail: str) -> Verdict:
    return Verdict("corrupt", detail)


def na(detail: str) -> Verdict:
    return Verdict("n/a", detail)


def own(detail: str = "its injected error") -> Verdict:
    return Verdict("own", detail)


def _message(err: BaseException) -> str:
    if isinstance(err, KeyError) and len(err.args) == 1 and isinstance(err.args[0], str):
        return err.args[0]
    return str(err)


def error_verdict(err: BaseException) -> Verdict:
    tb = traceback.extract_tb(err.__traceback__)
    where = tb[-1].filename if tb else "?"
    return Verdict("error", error=(type(err).__name__, _message(err), where))


# The calls a user of the loop writes: a message must start with one of them (not with an
# internal call the user never made, such as ``Accumulator(n=2147483647).boundary(state)``).
USER_CALLS = ("Step(", "Step.", "windows(", "len(", "gradaccum.loop.", "accumulate(")


def is_clear(message: str, words: tuple[str, ...] = ()) -> bool:
    """Starts with the user's call shape, gives a fix after it, names what came (``words``)."""
    return (
        bool(CALL_SHAPE.match(message))
        and message.startswith(USER_CALLS)
        and bool(FIX.search(message.split(": ", 1)[-1]))
        and all(w in message for w in words)
    )


# -- the registry -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Probe:
    name: str
    cls: str  # the issue's class: step, resume, checkpoint, ranks, exit, transforms, ...
    fn: Callable[..., Verdict]
    world: int = 1
    expect: str = "exact"  # or "error": every rank must end in an error
    quick: bool = False
    bound: float = BOUND
    words: tuple[str, ...] = ()  # what a clear message must name
    doc: str = ""


PROBES: list[Probe] = []


def probe(
    cls: str,
    *,
    world: int = 1,
    expect: str = "exact",
    quick: bool = False,
    bound: float = BOUND,
    words: tuple[str, ...] = (),
) -> Callable[[Callable[..., Verdict]], Callable[..., Verdict]]:
    def register(fn: Callable[..., Verdict]) -> Callable[..., Verdict]:
        name = fn.__name__.removeprefix("p_").replace("_", "-")
        assert all(p.name != name for p in PROBES), name
        doc = (fn.__doc__ or "").strip().split("\n\n")[0].replace("\n", " ")
        PROBES.append(Probe(name, cls, fn, world, expect, quick, bound, words, doc))
        return fn

    return register


# -- models, data and the plain loop --------------------------------------------------------------


class Net(nn.Module):
    """A small MLP; options: BatchNorm, dropout, a side branch used only when a batch asks, a
    layer that nothing uses."""

    def __init__(
        self,
        hidden: int = 8,
        dropout: float = 0.0,
        bn: bool = False,
        side: bool = False,
        extra: bool = False,
    ) -> None:
        super().__init__()
        self.l1 = nn.Linear(5, hidden)
        self.bn = nn.BatchNorm1d(hidden) if bn else None
        self.drop = nn.Dropout(dropout) if dropout else None
        self.l2 = nn.Linear(hidden, 1)
        self.side = nn.Linear(5, 1) if side else None
        self.extra = nn.Linear(3, 3) if extra else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.l1(x)
        if self.bn is not None:
            h = self.bn(h)
        h = torch.tanh(h)
        if self.drop is not None:
            h = self.drop(h)
        return self.l2(h)


def net(seed: int = 0, **kw: Any) -> Net:
    torch.manual_seed(seed)
    return Net(**kw).double()


def batches(sizes: list[int], seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(r, 5, generator=g, dtype=F64), torch.randn(r, 1, generator=g, dtype=F64))
        for r in sizes
    ]


def mse(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch[0], batch[1]
    return F.mse_loss(model(x), y)


def rows_of(batch: Any) -> int:
    return int(batch["x"].shape[0]) if isinstance(batch, dict) else int(batch[0].shape[0])


def adamw(model: nn.Module, wd: float = 0.01) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=wd)


def warmup(opt: torch.optim.Optimizer) -> Any:
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))


def make_step(model: nn.Module, loss: Any, opt: Any, *, data: Any = None, **kw: Any) -> Any:
    """``loop.Step`` with the API both versions have (``data=`` where it exists)."""
    if data is not None and HAS_DATA_ARG:
        kw["data"] = data
    return loop.Step(model, loss, optimizer=opt, **kw)


def plain_loop(
    model: nn.Module,
    loss: Callable[[nn.Module, Any], Any],
    opt: torch.optim.Optimizer,
    windows: list[list[Any]],
    *,
    weight: Callable[[Any], float] = rows_of,
    sched: Any = None,
    clip: float | None = None,
    reduction: str = "mean",
    plateau: bool = False,
    before: Callable[[int], None] | None = None,
) -> list[float]:
    """The plain PyTorch accumulation loop over global windows (all ranks' micro-batches, in rank
    order): each micro-batch's loss scaled by its share of the window, ``backward()``, then
    ``clip_grad_norm_``, one ``optimizer.step()``, ``scheduler.step()`` (with the window's loss
    for a plateau scheduler) and ``zero_grad(set_to_none=True)``. Returns the windows' losses.

    The window's total weight (rows, or the counts under ``"count"``) is known up front, as the
    plain loop must know it before the first backward: ``weight(batch)``.
    """
    losses = []
    for w, window in enumerate(windows):
        if before is not None:
            before(w)
        total = float(sum(weight(mb) for mb in window))
        loss_sum = 0.0
        for mb in window:
            out = loss(model, mb)
            value = out[0] if isinstance(out, tuple) else getattr(out, "loss", out)
            if reduction == "mean":
                share = weight(mb) / total
                loss_sum += float(value) * weight(mb)
                (value * share).backward()
            elif reduction == "count":
                loss_sum += float(value)
                (value / total).backward()
            else:
                loss_sum += float(value)
                value.backward()
        if clip is not None:
            nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        window_loss = loss_sum if reduction == "sum" else loss_sum / total
        if sched is not None:
            if plateau:
                sched.step(window_loss)
            else:
                sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(window_loss)
    return losses


def step_loop(
    step: Any, windows: list[list[Any]], before: Callable[[int], None] | None = None
) -> list[float]:
    losses = []
    for w, window in enumerate(windows):
        if before is not None:
            before(w)
        for mb in window:
            step.add(mb)
        losses.append(float(step.apply().loss))
    return losses


def _close(a: torch.Tensor, b: torch.Tensor, tol: float) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if tol == 0:
        return bool(torch.equal(a, b))
    if a.is_floating_point():
        scale = 1.0 + float(b.abs().max()) if b.numel() else 1.0
        return a.numel() == 0 or float((a - b).abs().max()) <= tol * scale
    return bool(torch.equal(a, b))


def _same_tree(a: Any, b: Any, tol: float, path: str) -> str | None:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return f"{path}: a tensor against {type(b).__name__}"
        if not _close(a, b, tol):
            d = float((a.double() - b.double()).abs().max()) if a.shape == b.shape else math.inf
            return f"{path} differs (max |diff| {d:.3g})"
        return None
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return f"{path}: keys {sorted(map(str, set(a) ^ set(b)))} in one only"
        for k in a:
            got = _same_tree(a[k], b[k], tol, f"{path}[{k!r}]")
            if got:
                return got
        return None
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return f"{path}: {len(a)} items against {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            got = _same_tree(x, y, tol, f"{path}[{i}]")
            if got:
                return got
        return None
    if isinstance(a, float) and isinstance(b, float):
        if a == b or (a != a and b != b):
            return None
        if tol == 0:
            return None if a == b or (a != a and b != b) else f"{path}: {a!r} against {b!r}"
        return None if abs(a - b) <= tol * (1 + abs(b)) else f"{path}: {a!r} against {b!r}"
    return None if a == b else f"{path}: {a!r} against {b!r}"


def training_state(
    model: nn.Module, opt: torch.optim.Optimizer, sched: Any = None
) -> dict[str, Any]:
    """Everything a training step leaves behind, by parameter name, copied."""
    names = {id(p): k for k, p in model.named_parameters()}
    state = {names[id(p)]: copy.deepcopy(s) for p, s in opt.state.items()}
    out = {
        "params": {k: p.detach().clone() for k, p in model.named_parameters()},
        "grads": {k: (p.grad is not None) for k, p in model.named_parameters()},
        "buffers": {k: b.detach().clone() for k, b in model.named_buffers()},
        "optimizer state": state,
        "lr": [float(g["lr"]) for g in opt.param_groups],
    }
    if sched is not None:
        out["scheduler"] = {
            k: v for k, v in sched.state_dict().items() if not callable(v) and k != "lr_lambdas"
        }
    return out


def differ(a: dict[str, Any], b: dict[str, Any], tol: float = TOL) -> str | None:
    """Where two ``training_state``s differ (``None``: they do not)."""
    return _same_tree(a, b, tol, "")


def compare_step(
    build: Callable[[], tuple[nn.Module, Any, Any]],
    loss: Any,
    windows: list[list[Any]],
    *,
    step_kw: dict[str, Any] | None = None,
    plain_kw: dict[str, Any] | None = None,
    before: Callable[[nn.Module, int], None] | None = None,
    seed: int = 7,
) -> Verdict:
    """Train ``build()``'s model with ``Step`` and with the plain loop; compare what is left."""
    step_kw = dict(step_kw or {})
    model, opt, sched = build()
    step = make_step(model, loss, opt, scheduler=sched, **step_kw)
    torch.manual_seed(seed)  # dropout draws the same masks in both
    got_losses = step_loop(step, windows, None if before is None else (lambda w: before(model, w)))
    got = training_state(model, opt, sched)
    ref_model, ref_opt, ref_sched = build()
    torch.manual_seed(seed)
    kw = {
        "clip": step_kw.get("clip"),
        "reduction": step_kw.get("reduction", "mean"),
        **(plain_kw or {}),
    }
    want_losses = plain_loop(
        ref_model,
        loss,
        ref_opt,
        windows,
        sched=ref_sched,
        before=None if before is None else (lambda w: before(ref_model, w)),
        **kw,
    )
    want = training_state(ref_model, ref_opt, ref_sched)
    d = differ(got, want) or _same_tree(got_losses, want_losses, TOL, "window losses")
    return wrong(f"Step against the plain loop: {d}") if d else ok()


# -- the launcher ---------------------------------------------------------------------------------


def _child(rank: int, world: int, port: int, name: str, tmp: str, out: Any, release: Any) -> None:
    fd = os.open(os.path.join(tmp, f"stderr-{rank}.txt"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 2)
    os.dup2(fd, 1)
    os.close(fd)
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    os.chdir(tmp)  # a probe that writes where it should not writes here
    # A process started by the forkserver starts its own children through it too: DataLoader
    # workers would outlive a killed probe (their watchdog watches the forkserver). A user's
    # script on Linux forks them.
    mp.set_start_method("fork", force=True)
    torch.set_num_threads(1)
    p = next(p for p in PROBES if p.name == name)
    imported = str(Path(gradaccum.__file__).resolve().parent.parent)
    if imported != os.environ.get("LOOP_PROBES_GRADACCUM", imported):
        raise RuntimeError(f"the probe imported the gradaccum of {imported}, not of the run")
    try:
        if world > 1:
            dist.init_process_group(
                "gloo",
                init_method=f"tcp://127.0.0.1:{port}",
                rank=rank,
                world_size=world,
                timeout=datetime.timedelta(seconds=PG_TIMEOUT),
            )
        verdict = p.fn(rank, world, tmp) if world > 1 else p.fn(tmp)
    except BaseException as err:  # noqa: BLE001 - classified by the parent
        verdict = error_verdict(err)
        traceback.print_exc()
    out.put((rank, pickle.dumps(verdict)))
    if verdict.exit_now:  # the probe's script ends here: its process exits, as a script's would
        out.close()
        out.join_thread()
        os._exit(0)
    # Linger until every rank has reported (or the bound ran out): a rank that exits closes its
    # connections, which would turn a peer's hang into a quick error.
    release.wait(p.bound + 30)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


_CTX: list[Any] = []


def _context() -> Any:
    if not _CTX:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["torch", "torch.distributed", "gradaccum", "numpy", "__main__"])
        _CTX.append(ctx)
    return _CTX[0]


@dataclass
class Result:
    name: str
    outcome: str
    detail: str
    seconds: float


def combine(
    p: Probe, verdicts: dict[int, Verdict], missing: dict[int, tuple[str, str]]
) -> tuple[str, str]:
    """One outcome for the probe from its ranks' verdicts (the worst one), and why."""
    found: list[tuple[str, str]] = []
    who = (lambda r: f"rank {r}: ") if p.world > 1 else (lambda r: "")
    for r, (kind, why) in sorted(missing.items()):
        found.append((kind, who(r) + why))
    for r, v in sorted(verdicts.items()):
        if v.kind == "n/a":
            found.append((NA, who(r) + v.detail))
        elif v.kind == "corrupt":
            found.append((CORRUPT, who(r) + v.detail))
        elif v.kind == "wrong":
            found.append((WRONG, who(r) + v.detail))
        elif v.kind == "error":
            assert v.error is not None
            name, msg, _ = v.error
            clear = is_clear(msg, p.words)
            found.append((REFUSED if clear else UNCLEAR, f"{who(r)}{name}: {msg}"))
        elif v.kind == "own":
            found.append((REFUSED, who(r) + v.detail))
        elif v.kind == "returned":  # a fault probe's rank that went on as if nothing happened
            found.append((WRONG, who(r) + v.detail))
        elif v.kind in (HANG, CRASH):
            found.append((v.kind, who(r) + v.detail))
        else:
            found.append((EXACT, who(r) + (v.detail or "finished normally")))
    kinds = {k for k, _ in found}
    mixed = EXACT in kinds and kinds & {REFUSED, UNCLEAR} and not kinds & {HANG, CRASH}
    if p.world > 1 and p.expect == "error" and mixed:
        fine = "; ".join(d for k, d in found if k == EXACT)
        failed = "; ".join(d for k, d in found if k in (REFUSED, UNCLEAR))
        return WRONG, f"one rank finished normally ({fine}) while another raised ({failed})"
    top = max(SEVERITY[k] for k in kinds)
    return next(k for k in kinds if SEVERITY[k] == top), " | ".join(
        d for k, d in found if SEVERITY[k] == top
    )


def launch(p: Probe) -> Result:
    """Run the probe on ``p.world`` forked processes, bounded by ``p.bound`` seconds."""
    ctx = _context()
    tmp = tempfile.mkdtemp(prefix=f"probe-{p.name}-")
    out, release = ctx.Queue(), ctx.Event()
    port = _launch.free_port()
    procs = [
        ctx.Process(target=_child, args=(r, p.world, port, p.name, tmp, out, release))
        for r in range(p.world)
    ]
    start = time.monotonic()
    for proc in procs:
        proc.start()
    verdicts: dict[int, Verdict] = {}

    def drain(wait: float) -> bool:
        try:
            rank, payload = out.get(timeout=wait)
        except queue.Empty:
            return False
        verdicts[rank] = pickle.loads(payload)
        return True

    while len(verdicts) < p.world and time.monotonic() - start < p.bound:
        if drain(0.05):
            continue
        if any(r not in verdicts and not proc.is_alive() for r, proc in enumerate(procs)):
            while drain(0.3):
                pass
            break
    seconds = time.monotonic() - start
    missing: dict[int, tuple[str, str]] = {}
    for r, proc in enumerate(procs):
        if r in verdicts:
            continue
        if proc.is_alive():
            missing[r] = (
                HANG,
                f"still running after {p.bound:g} s (process-group timeout {PG_TIMEOUT:g} s)",
            )
        else:
            code = proc.exitcode
            name = signal.Signals(-code).name if code is not None and code < 0 else f"code {code}"
            missing[r] = (CRASH, f"exited with {name} without reporting")
    release.set()
    for proc in procs:
        proc.join(timeout=5)
        if proc.is_alive():
            proc.kill()
            proc.join()
    out.close()
    outcome, detail = combine(p, verdicts, missing)
    if outcome in (CRASH, HANG):
        for r in range(p.world):
            with contextlib.suppress(OSError):
                text = Path(tmp, f"stderr-{r}.txt").read_text(errors="replace").strip()
                if text:
                    detail += f" [rank {r} stderr: " + " / ".join(text.splitlines()[-3:]) + "]"
    if os.environ.get("LOOP_PROBES_KEEP"):  # for debugging: the ranks' output stays
        detail += f" [kept: {tmp}]"
    else:
        shutil.rmtree(tmp, ignore_errors=True)
    return Result(p.name, outcome, detail, seconds)


# -- helpers of the probes ------------------------------------------------------------------------


def seed_all(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


def refusal(
    call: Callable[[], Any],
    watch: Callable[[], Any],
    what: str,
    after: Callable[[], Any] | None = None,
) -> Verdict:
    """Make a call that must be refused: its error (classified by the harness), ``corrupt`` if
    the state ``watch()`` sees changed, ``wrong`` if it was accepted. ``after``: what the user
    does next once it was accepted (the loop), whose error is then the one classified."""
    before = watch()
    try:
        call()
    except Exception as err:  # noqa: BLE001 - classified
        d = _same_tree(watch(), before, 0, "")
        if d:
            return corrupt(
                f"{type(err).__name__} ({_message(err)[:200]}), but the state changed: {d}"
            )
        return error_verdict(err)
    if after is not None:
        try:
            after()
        except Exception as err:  # noqa: BLE001 - accepted, then refused later: classified
            return error_verdict(err)
        return wrong(f"accepted {what}, and the run went on")
    return wrong(f"accepted {what}")


# == 1. Step against the plain loop ===============================================================

WINDOWS = [[3, 5, 1, 4], [2, 2], [7], [1, 1, 1]]  # rows of each micro-batch, per window


def windows_of(sizes: list[list[int]] = WINDOWS, seed: int = 0) -> list[list[Any]]:
    return [batches(s, seed=seed + w) for w, s in enumerate(sizes)]


@probe("step", quick=True)
def p_step_adamw_clip_warmup(tmp: str) -> Verdict:
    """AdamW with weight decay, a warm-up LambdaLR, clipping, uneven micro-batches."""

    def build() -> Any:
        model = net()
        opt = adamw(model)
        return model, opt, warmup(opt)

    return compare_step(build, mse, windows_of(), step_kw={"clip": 0.5})


@probe("step", quick=True)
def p_step_unused_parameter(tmp: str) -> Verdict:
    """A layer the loss never uses, under AdamW(weight_decay=0.1): the plain loop leaves it
    alone (``.grad`` None: no decay, no optimizer state)."""

    def build() -> Any:
        model = net(extra=True)
        return model, adamw(model, wd=0.1), None

    return compare_step(build, mse, windows_of())


def side_loss(model: nn.Module, batch: dict[str, Any]) -> torch.Tensor:
    out = F.mse_loss(model(batch["x"]), batch["y"])
    if batch["side"]:
        out = out + model.side(batch["x"]).pow(2).mean()
    return out


def side_windows(use: list[list[bool]], seed: int = 0) -> list[list[Any]]:
    out = []
    for w, flags in enumerate(use):
        mbs = batches([2 + i for i in range(len(flags))], seed=seed + w)
        out.append([{"x": x, "y": y, "side": f} for (x, y), f in zip(mbs, flags)])
    return out


@probe("step")
def p_step_parameter_used_in_some_windows(tmp: str) -> Verdict:
    """A branch used by one micro-batch of window 0 and by none of windows 1 and 2, under AdamW
    and clipping: in the windows that do not reach it the plain loop's ``.grad`` is None."""

    def build() -> Any:
        model = net(side=True)
        return model, adamw(model, wd=0.1), None

    wins = side_windows([[False, True, False], [False, False], [False]])
    return compare_step(build, side_loss, wins, step_kw={"clip": 0.3})


@probe("step", quick=True, expect="error", words=("batch",))
def p_step_dict_batch_of_other_lengths(tmp: str) -> Verdict:
    """A dict batch holding a per-class weight of another length than the rows (``"cw"`` sorts
    first): the rows are ambiguous, so refused (or weighted by the rows of x)."""

    def loss(model: nn.Module, b: dict[str, torch.Tensor]) -> torch.Tensor:
        return F.mse_loss(model(b["x"]), b["y"]) * b["cw"].mean()

    cw = torch.tensor([0.5, 1.0, 1.5], dtype=F64)
    wins = [[{"cw": cw, "x": x, "y": y} for x, y in w] for w in windows_of()]

    def build() -> Any:
        model = net()
        return model, adamw(model), None

    return compare_step(build, loss, wins)


@probe("step")
def p_step_dict_batch_rows_given(tmp: str) -> Verdict:
    """The same dict batches, the loss returning ``(loss, rows)``: the documented way to state
    the rows."""

    def loss(model: nn.Module, b: dict[str, torch.Tensor]) -> Any:
        value = F.mse_loss(model(b["x"]), b["y"]) * b["cw"].mean()
        return gradaccum.Mean(value, len(b["x"])) if HAS_KINDS else (value, len(b["x"]))

    cw = torch.tensor([0.5, 1.0, 1.5], dtype=F64)
    wins = [[{"cw": cw, "x": x, "y": y} for x, y in w] for w in windows_of()]

    def build() -> Any:
        model = net()
        return model, adamw(model), None

    return compare_step(build, loss, wins)


@probe("step", quick=True)
def p_step_batchnorm(tmp: str) -> Verdict:
    """BatchNorm in training mode (running statistics move with every micro-batch), SGD with
    momentum."""

    def build() -> Any:
        model = net(bn=True)
        return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), None

    return compare_step(build, mse, windows_of([[3, 5, 2, 4], [2, 2], [7], [3, 3, 2]]))


@probe("step")
def p_step_dropout(tmp: str) -> Verdict:
    """Dropout (p=0.3): the same masks as the plain loop, the forwards being the same."""

    def build() -> Any:
        model = net(dropout=0.3)
        return model, adamw(model), None

    return compare_step(build, mse, windows_of())


@probe("step", quick=True)
def p_step_plateau_scheduler(tmp: str) -> Verdict:
    """``ReduceLROnPlateau``, whose ``step`` takes the metric: the plain loop passes the
    window's loss."""

    def build() -> Any:
        model = net()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        return (
            model,
            opt,
            torch.optim.lr_scheduler.ReduceLROnPlateau(opt, mode="max", factor=0.5, patience=0),
        )

    return compare_step(build, mse, windows_of(), plain_kw={"plateau": True})


@probe("step", quick=True)
def p_step_freeze_between_windows(tmp: str) -> Verdict:
    """``l1.weight.requires_grad_(False)`` after window 1 (fine-tuning the head only)."""

    def build() -> Any:
        model = net()
        return model, adamw(model), None

    def before(model: nn.Module, w: int) -> None:
        if w == 2:
            model.l1.weight.requires_grad_(False)

    return compare_step(build, mse, windows_of(), before=before)


@probe("step")
def p_step_unfreeze_between_windows(tmp: str) -> Verdict:
    """A layer frozen when the Step is built, unfrozen after window 0 (gradual unfreezing)."""

    def build() -> Any:
        model = net()
        model.l1.requires_grad_(False)
        return model, adamw(model), None

    def before(model: nn.Module, w: int) -> None:
        if w == 1:
            model.l1.requires_grad_(True)

    return compare_step(build, mse, windows_of(), before=before)


@probe("step", expect="error", words=("l1.weight",))
def p_step_freeze_mid_window(tmp: str) -> Verdict:
    """``requires_grad_(False)`` between two micro-batches of a window: refused, naming it."""
    model = net()
    opt = adamw(model)
    step = make_step(model, mse, opt)
    wins = windows_of()
    for mb in wins[0]:
        step.add(mb)
    step.apply()
    step.add(wins[1][0])
    model.l1.weight.requires_grad_(False)
    step.add(wins[1][1])
    step.apply()
    return wrong("a parameter frozen in the middle of a window was accepted")


def token_loss(model: nn.Module, batch: Any) -> Any:
    x, y, mask = batch
    per = (model(x).squeeze(-1) - y.squeeze(-1)).pow(2)
    summed, count = (per * mask).sum(), mask.sum()
    return gradaccum.Sum(summed, count) if HAS_KINDS else (summed, count)


@probe("step")
def p_step_count_reduction(tmp: str) -> Verdict:
    """``reduction="count"``: the token mean over the whole window (masks of random density)."""
    g = torch.Generator().manual_seed(3)
    wins = [
        [(x, y, (torch.rand(len(x), generator=g) < 0.6).double()) for x, y in w]
        for w in windows_of()
    ]

    def build() -> Any:
        model = net()
        return model, adamw(model), None

    return compare_step(
        build,
        token_loss,
        wins,
        step_kw={"reduction": "count"},
        plain_kw={"weight": lambda b: float(b[2].sum())},
    )


@probe("step")
def p_step_sum_reduction(tmp: str) -> Verdict:
    """``reduction="sum"`` with clipping and SGD."""

    def loss(model: nn.Module, b: Any) -> torch.Tensor:
        return F.mse_loss(model(b[0]), b[1], reduction="sum")

    def build() -> Any:
        model = net()
        return model, torch.optim.SGD(model.parameters(), lr=0.01), None

    return compare_step(build, loss, windows_of(), step_kw={"reduction": "sum", "clip": 2.0})


def _global(per_rank: list[list[Any]], n: int) -> list[list[Any]]:
    """The global windows of ranks' micro-batch lists, cut in windows of ``n`` (rank order)."""
    count = max(-(-len(mbs) // n) for mbs in per_rank)
    return [[mb for mbs in per_rank for mb in mbs[w * n : (w + 1) * n]] for w in range(count)]


def two_rank_step(
    rank: int, per_rank: list[list[Any]], n: int, loss: Any, build: Any, **kw: Any
) -> Verdict:
    """Train on 2 ranks through ``windows`` and ``Step`` under ``all_reduce``; compare with the
    plain loop over the global windows in one process."""
    model, opt, sched = build()
    sync = gradaccum.all_reduce()
    data = loop.windows(per_rank[rank], n, sync=sync)
    step = make_step(model, loss, opt, data=data, sync=sync, scheduler=sched, **kw)
    got_losses = []
    for window in data:
        for mb in window:
            step.add(mb)
        got_losses.append(float(step.apply().loss))
    got = training_state(model, opt, sched)
    ref_model, ref_opt, ref_sched = build()
    want_losses = plain_loop(
        ref_model,
        loss,
        ref_opt,
        _global(per_rank, n),
        sched=ref_sched,
        clip=kw.get("clip"),
        reduction=kw.get("reduction", "mean"),
    )
    d = differ(got, training_state(ref_model, ref_opt, ref_sched)) or _same_tree(
        got_losses, want_losses, TOL, "window losses"
    )
    return wrong(f"2 ranks against the plain loop over the global window: {d}") if d else ok()


@probe("step", world=2, quick=True)
def p_step_2ranks_unused_on_one_rank(rank: int, world: int, tmp: str) -> Verdict:
    """2 ranks: a branch only rank 0's micro-batches use (in window 0 only), a layer no rank
    uses, AdamW with weight decay; against the plain loop over the global window."""
    flags = [[False, True, False, False, False], [False] * 4]
    per_rank = []
    for r, fl in enumerate(flags):
        mbs = batches([2 + (i % 3) for i in range(len(fl))], seed=10 + r)
        per_rank.append([{"x": x, "y": y, "side": f} for (x, y), f in zip(mbs, fl)])

    def build() -> Any:
        model = net(side=True, extra=True)
        return model, adamw(model, wd=0.1), None

    return two_rank_step(rank, per_rank, 2, side_loss, build, clip=1.0)


@probe("step", world=2)
def p_step_2ranks_empty_window(rank: int, world: int, tmp: str) -> Verdict:
    """2 ranks whose loaders hold 5 and 3 micro-batches (n=2): rank 1's last window is empty."""
    per_rank = [batches([3, 1, 4, 2, 5], seed=20), batches([2, 2, 3], seed=21)]

    def build() -> Any:
        model = net()
        opt = adamw(model)
        return model, opt, warmup(opt)

    return two_rank_step(rank, per_rank, 2, mse, build, clip=1.0)


# == 2. Resume: bit-identical to the uninterrupted run ============================================

ROWS = 22  # 11 micro-batches of 2 rows an epoch: windows of 3, 3, 3 and 2


class Rows(Dataset):
    """``ROWS`` regression rows; ``aug`` draws noise in ``__getitem__`` (torch, numpy, random)."""

    def __init__(self, rows: int = ROWS, aug: str | None = None, seed: int = 5) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(rows, 5, generator=g, dtype=F64)
        self.y = torch.randn(rows, 1, generator=g, dtype=F64)
        self.aug = aug

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.x[i]
        if self.aug == "torch":
            x = x + 0.1 * torch.randn(5, dtype=F64)
        elif self.aug == "numpy":
            x = x + 0.1 * torch.from_numpy(np.random.randn(5))
        elif self.aug == "random":
            x = x + 0.1 * random.random()
        return x, self.y[i]


class Stream(IterableDataset):
    """The rows as an ``IterableDataset`` (no ``len()``), in a fixed order."""

    def __init__(self, rows: int = ROWS) -> None:
        self.rows = Rows(rows)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for i in range(len(self.rows)):
            yield self.rows[i]


@dataclass(frozen=True)
class Job:
    """A training job: its data, windows and loop, and where it is cut (saved and stopped)."""

    data: Callable[[int, int], Any]  # (rank, world) -> the iterable (or factory) of the rank
    n: int = 3
    epochs: int = 2
    dropout: float = 0.1
    prefetch: bool = False
    count_window: bool = False  # the loss divides by the window's rows, counted from batches


def loader(
    rows: int = ROWS,
    batch: int = 2,
    shuffle: bool = True,
    workers: int = 0,
    persistent: bool = False,
    aug: str | None = None,
    stateful: bool = False,
) -> Callable[[int, int], Any]:
    def make(rank: int, world: int) -> Any:
        ds = Rows(rows, aug)
        kw: dict[str, Any] = {"batch_size": batch, "shuffle": shuffle, "num_workers": workers}
        if workers:
            kw["persistent_workers"] = persistent
        if stateful:
            from torchdata.stateful_dataloader import StatefulDataLoader

            return StatefulDataLoader(ds, **kw)
        return DataLoader(ds, **kw)

    return make


def run_job(
    job: Job,
    rank: int,
    world: int,
    path: str,
    cut: Any = None,
    resume: bool = False,
    load_job: Job | None = None,
) -> Any:
    """Run the job; at ``cut`` save to ``path`` and return None (as a crash would after it).

    ``cut``: ``("mid", w, k)`` after the k-th micro-batch of window w; ``("end", w)`` after
    window w's loop, before ``apply()`` (the documented idiom); ``("after", w)`` after its
    ``apply()``. Returns the training state, the losses of the windows it applied, the RNG.
    """
    seed_all(0)
    model = net(dropout=job.dropout)
    opt = adamw(model)
    sched = warmup(opt)
    sync = gradaccum.all_reduce() if world > 1 else None
    source = job.data(rank, world)
    data = loop.windows(source, job.n, sync=sync, epochs=job.epochs, prefetch=job.prefetch)
    count = {"rows": 1.0}

    def scaled(model: nn.Module, batch: Any) -> torch.Tensor:
        return F.mse_loss(model(batch[0]), batch[1], reduction="sum") / count["rows"]

    kw: dict[str, Any] = {"scheduler": sched, "clip": 1.0}
    if sync is not None:
        kw["sync"] = sync
    if job.count_window:
        kw["reduction"] = "sum"
    step = make_step(model, scaled if job.count_window else mse, opt, data=data, **kw)
    if resume:
        loop.load(path, step=step, data=data)
    losses: list[Any] = []
    for window in data:
        if job.count_window:  # the documented use of prefetch: count the window first
            count["rows"] = float(sum(len(b[0]) for b in window.batches))
            losses.append(("len", len(window), len(window.batches)))
        for batch in window:
            step.add(batch)
            if cut == ("mid", window.index, step.micro_step):
                loop.save(path, step=step, data=data)
                return None
        if cut == ("end", window.index):
            loop.save(path, step=step, data=data)
            return None
        losses.append(float(step.apply().loss))
        if cut == ("after", window.index):
            loop.save(path, step=step, data=data)
            return None
        if job.epochs is None and window.index == 9:  # an endless run, stopped by the user
            break
    return {
        "state": training_state(model, opt, sched),
        "losses": losses,
        "rng": torch.get_rng_state(),
    }


def cuts_of(sizes: list[int]) -> list[Any]:
    """Every cut of windows of these sizes (this rank's micro-batches per window)."""
    out: list[Any] = []
    for w, s in enumerate(sizes):
        out += [("mid", w, k) for k in range(1, s)] + [("end", w), ("after", w)]
    return out


def _tail(whole: dict[str, Any], cut: Any) -> list[Any]:
    """The uninterrupted run's losses of the windows a run resumed at ``cut`` applies."""
    w = cut[1] + (1 if cut[0] == "after" else 0)
    out, k = [], 0
    for item in whole["losses"]:
        if isinstance(item, tuple):  # a window's lengths, recorded before its loss
            if k >= w:
                out.append(item)
            continue
        if k >= w:
            out.append(item)
        k += 1
    return out


def resume_check(
    job: Job, cuts: list[Any], rank: int = 0, world: int = 1, tmp: str = "."
) -> Verdict:
    """The job cut at each of ``cuts`` and resumed, against the uninterrupted run, bit for bit."""
    whole = run_job(job, rank, world, "unused")
    for i, cut in enumerate(cuts):
        path = os.path.join(tmp, f"ckpt-{i}")
        seed_all(1000 + i)  # the crashed run drew other numbers
        run_job(job, rank, world, path, cut=cut)
        seed_all(2000 + i)  # a fresh process: other random states until load restores them
        got = run_job(job, rank, world, path, resume=True)
        d = differ(got["state"], whole["state"], tol=0)
        d = d or _same_tree(got["losses"], _tail(whole, cut), 0, "losses after the cut")
        if d is None and not torch.equal(got["rng"], whole["rng"]):
            d = "the global torch RNG at the end differs"
        if d:
            return wrong(f"resumed at {cut}: {d}")
    return ok(f"{len(cuts)} cut(s)")


def sizes(job: Job, length: int) -> list[int]:
    per = [min(job.n, length - s) for s in range(0, length, job.n)]
    return per * job.epochs


@probe("resume", quick=True, bound=120)
def p_resume_every_cut(tmp: str) -> Verdict:
    """A shuffling DataLoader, dropout, 2 epochs: every cut (each micro-batch, each window's end
    before and after ``apply()``) resumes bit-identically."""
    job = Job(loader())
    cuts = cuts_of(sizes(job, 11))
    return resume_check(job, cuts[::3] if QUICK else cuts, tmp=tmp)


SOME = [("mid", 1, 2), ("end", 3), ("after", 3), ("mid", 5, 1)]  # epoch 0 and 1


@probe("resume", bound=90)
def p_resume_workers(tmp: str) -> Verdict:
    """``num_workers=2``, shuffling."""
    return resume_check(Job(loader(workers=2)), SOME, tmp=tmp)


@probe("resume", quick=True, bound=90)
def p_resume_persistent_workers(tmp: str) -> Verdict:
    """``num_workers=2, persistent_workers=True``, shuffling, cut in epoch 1 (the workers of
    the uninterrupted run were started in epoch 0)."""
    return resume_check(
        Job(loader(workers=2, persistent=True)), [("mid", 5, 1), ("end", 6)], tmp=tmp
    )


@probe("resume", quick=True)
def p_resume_iterable_dataset(tmp: str) -> Verdict:
    """A DataLoader over an ``IterableDataset`` (no ``len()``)."""
    job = Job(lambda rank, world: DataLoader(Stream(), batch_size=2))
    return resume_check(job, SOME, tmp=tmp)


@probe("resume", quick=True, expect="error")
def p_resume_augmentation_torch(tmp: str) -> Verdict:
    """``torch.randn`` in ``__getitem__``, read in this process (``num_workers=0``), dropout in
    the model: a replay cannot give the same micro-batches (refused at save, or exact)."""
    return resume_check(Job(loader(aug="torch")), [("mid", 1, 2), ("mid", 5, 1)], tmp=tmp)


@probe("resume", expect="error")
def p_resume_augmentation_numpy(tmp: str) -> Verdict:
    """``np.random.randn`` in ``__getitem__``, ``num_workers=0``, no dropout."""
    return resume_check(Job(loader(aug="numpy"), dropout=0.0), [("mid", 1, 2)], tmp=tmp)


@probe("resume", expect="error")
def p_resume_augmentation_random(tmp: str) -> Verdict:
    """``random.random()`` in ``__getitem__``, ``num_workers=0``, no dropout."""
    return resume_check(Job(loader(aug="random"), dropout=0.0), [("mid", 1, 2)], tmp=tmp)


@probe("resume", bound=90)
def p_resume_augmentation_in_workers(tmp: str) -> Verdict:
    """Random augmentation read by ``num_workers=2`` (not persistent): the workers are seeded
    from the epoch's RNG, which a resume replays."""
    return resume_check(Job(loader(aug="torch", workers=2)), [("mid", 1, 2), ("end", 5)], tmp=tmp)


@probe("resume", bound=90, expect="error")
def p_resume_augmentation_persistent_epoch1(tmp: str) -> Verdict:
    """Random augmentation, persistent workers, cut in epoch 1: the resumed run's new workers
    cannot go on from where the saved run's were (refused at save, or exact)."""
    return resume_check(
        Job(loader(aug="torch", workers=2, persistent=True)), [("mid", 5, 1)], tmp=tmp
    )


@probe("resume", quick=True)
def p_resume_prefetch_window_count(tmp: str) -> Verdict:
    """``prefetch=True`` and the documented use: the window's rows counted from
    ``window.batches`` before its first backward (the loss is the sum over that count), and
    ``len(window)``; resumed mid-window."""
    job = Job(loader(), prefetch=True, count_window=True)
    return resume_check(job, [("mid", 1, 1), ("mid", 1, 2), ("mid", 6, 1)], tmp=tmp)


@probe("resume", quick=True)
def p_resume_factory(tmp: str) -> Verdict:
    """A factory ``epoch -> DataLoader`` (a loader built anew each epoch, seeded by the epoch)."""
    if not HAS_FACTORY:
        return na("windows() takes no factory")

    def make(rank: int, world: int) -> Any:
        ds = Rows()
        return lambda epoch: DataLoader(
            ds, batch_size=2, shuffle=True, generator=torch.Generator().manual_seed(epoch)
        )

    return resume_check(Job(make), SOME, tmp=tmp)


@probe("resume")
def p_resume_stateful_dataloader(tmp: str) -> Verdict:
    """torchdata's ``StatefulDataLoader`` (shuffling), which keeps its own position."""
    return resume_check(Job(loader(stateful=True)), SOME, tmp=tmp)


@probe("resume")
def p_resume_stateful_augmentation(tmp: str) -> Verdict:
    """``StatefulDataLoader(num_workers=0)`` over random augmentation (docs/loop.md: its own
    state and the process's random states, bit-identical)."""
    return resume_check(
        Job(loader(stateful=True, aug="torch")), [("mid", 1, 2), ("end", 5)], tmp=tmp
    )


@probe("resume")
def p_resume_list(tmp: str) -> Verdict:
    """A plain list of micro-batches, 2 epochs, no dropout."""
    mbs = batches([2] * 11, seed=3)
    return resume_check(Job(lambda rank, world: mbs, dropout=0.0), SOME, tmp=tmp)


@probe("resume", quick=True)
def p_resume_twice(tmp: str) -> Verdict:
    """Resume, save again later in the resumed run, resume again."""
    job = Job(loader())
    whole = run_job(job, 0, 1, "unused")
    first, second = os.path.join(tmp, "a"), os.path.join(tmp, "b")
    run_job(job, 0, 1, first, cut=("mid", 1, 1))

    seed_all(5)

    # The resumed run, cut again: run_job resumes from `first`, then saves at the second cut.
    def resumed_then_cut() -> None:
        seed_all(0)
        model = net(dropout=job.dropout)
        opt = adamw(model)
        sched = warmup(opt)
        data = loop.windows(job.data(0, 1), job.n, epochs=job.epochs)
        step = make_step(model, mse, opt, data=data, scheduler=sched, clip=1.0)
        loop.load(first, step=step, data=data)
        for window in data:
            for batch in window:
                step.add(batch)
                if (window.index, step.micro_step) == (5, 2):
                    loop.save(second, step=step, data=data)
                    return
            step.apply()

    resumed_then_cut()
    seed_all(9)
    got = run_job(job, 0, 1, second, resume=True)
    d = differ(got["state"], whole["state"], tol=0)
    return wrong(f"resumed twice: {d}") if d else ok()


@probe("resume", world=2, quick=True, bound=60)
def p_resume_2ranks_distributed_sampler(rank: int, world: int, tmp: str) -> Verdict:
    """2 ranks, ``DistributedSampler(shuffle=True, seed=3)`` (its ``set_epoch`` called by the
    windows), cuts in epoch 0 and 1."""

    def make(rank: int, world: int) -> Any:
        ds = Rows(21)
        sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, seed=3)
        return DataLoader(ds, batch_size=2, sampler=sampler)

    return resume_check(Job(make, n=2), [("mid", 1, 1), ("end", 4), ("after", 5)], rank, world, tmp)


@probe("resume")
def p_resume_schedule(tmp: str) -> Verdict:
    """``n`` a schedule (windows of 1, 2, then 4 micro-batches)."""
    job = Job(loader(), n=lambda i: min(4, 2**i))  # type: ignore[arg-type]
    return resume_check(job, [("mid", 1, 1), ("end", 2), ("mid", 4, 3)], tmp=tmp)


@probe("resume")
def p_resume_stateful_prefetch(tmp: str) -> Verdict:
    """``StatefulDataLoader`` with ``prefetch=True``: the window read ahead, resumed inside it."""
    return resume_check(
        Job(loader(stateful=True), prefetch=True), [("mid", 1, 1), ("mid", 5, 2)], tmp=tmp
    )


@probe("resume", world=2, bound=90)
def p_resume_2ranks_workers(rank: int, world: int, tmp: str) -> Verdict:
    """2 ranks of 11 and 10 rows (loaders of 6 and 5 micro-batches), ``num_workers=2``,
    shuffling, cut mid-window in epoch 0 and at a window's end in epoch 1."""

    def make(rank: int, world: int) -> Any:
        ds = Subset(Rows(21), range(rank, 21, world))
        return DataLoader(ds, batch_size=2, shuffle=True, num_workers=2)

    return resume_check(Job(make, n=2), [("mid", 1, 1), ("end", 4)], rank, world, tmp)


class OneShot(IterableDataset):
    """A stream read once (a socket, a queue): ``__iter__`` goes on from where it was."""

    def __init__(self) -> None:
        self.rows = Rows()
        self.it = iter([self.rows[i] for i in range(len(self.rows))])

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return self.it


def go_on(job: Job, cut: Any, tmp: str) -> Verdict:
    """A run that saves at ``cut`` and goes on, against the same run without the save."""
    whole = run_job(job, 0, 1, "unused")
    path = os.path.join(tmp, "ckpt")

    seed_all(0)
    model = net(dropout=job.dropout)
    opt = adamw(model)
    sched = warmup(opt)
    data = loop.windows(job.data(0, 1), job.n, epochs=job.epochs)
    step = make_step(model, mse, opt, data=data, scheduler=sched, clip=1.0)
    losses: list[float] = []
    refused: list[BaseException] = []

    def save() -> None:  # a save that may be refused: the run goes on without it
        try:
            loop.save(path, step=step, data=data)
        except Exception as err:  # noqa: BLE001
            refused.append(err)

    for window in data:
        for batch in window:
            step.add(batch)
            if cut == ("mid", window.index, step.micro_step):
                save()
        if cut == ("end", window.index):
            save()
        losses.append(float(step.apply().loss))
    got = {"state": training_state(model, opt, sched), "losses": losses}
    d = differ(got["state"], whole["state"], tol=0) or _same_tree(
        losses, whole["losses"], 0, "losses"
    )
    if refused and d:
        err = refused[0]
        return corrupt(
            f"the save was refused ({type(err).__name__}: {_message(err)[:300]}), but the run "
            f"that went on changed: {d}"
        )
    if refused:
        return error_verdict(refused[0])
    return wrong(f"saving at {cut} changed the run that went on: {d}") if d else ok()


@probe("resume", quick=True)
def p_save_and_go_on(tmp: str) -> Verdict:
    """A save is an observation: a shuffling loader, dropout, saved mid-window and at a window's
    end, the run going on; against the run that never saved, bit for bit."""
    return go_on(Job(loader()), ("mid", 1, 2), tmp)


@probe("resume")
def p_save_and_go_on_over_a_stream(tmp: str) -> Verdict:
    """The same over a DataLoader of an ``IterableDataset`` that is a one-pass stream (one
    epoch): saving must not read from it (or must refuse)."""
    return go_on(
        Job(lambda rank, world: DataLoader(OneShot(), batch_size=2), epochs=1), ("end", 1), tmp
    )


@probe("resume")
def p_resume_endless(tmp: str) -> Verdict:
    """``epochs=None`` (endless), the loop broken after window 9 by the user."""
    job = Job(loader(), epochs=None)  # type: ignore[arg-type]
    return resume_check(job, [("mid", 2, 1), ("end", 5)], tmp=tmp)


# == 3. Checkpoints ===============================================================================


def built(
    job: Job, *, opt_kind: str = "adamw", hidden: int = 8, n: int | None = None, sync: Any = None
) -> tuple[Any, Any, Any, Any, Any]:
    """A fresh job's model, optimizer, scheduler, windows and step (before ``load``)."""
    seed_all(0)
    model = net(hidden=hidden, dropout=job.dropout)
    opt = adamw(model) if opt_kind == "adamw" else torch.optim.SGD(model.parameters(), lr=0.05)
    sched = warmup(opt)
    data = loop.windows(job.data(0, 1), job.n if n is None else n, sync=sync, epochs=job.epochs)
    kw = {"sync": sync} if sync is not None else {}
    step = make_step(model, mse, opt, data=data, scheduler=sched, clip=1.0, **kw)
    return model, opt, sched, data, step


def load_refused(tmp: str, job: Job, changed: Job | None = None, **kw: Any) -> Verdict:
    """Save ``job`` mid-window, then load into a job built otherwise: it must be refused, with
    nothing changed (parameters, optimizer, scheduler, data position, RNG)."""
    path = os.path.join(tmp, "ckpt")
    run_job(job, 0, 1, path, cut=("mid", 1, 1))
    model, opt, sched, data, step = built(changed or job, **kw)

    def watch() -> Any:
        return [training_state(model, opt, sched), data.state_dict(), torch.get_rng_state()]

    def train() -> None:  # the loop that follows the load
        for window in data:
            for batch in window:
                step.add(batch)
            step.apply()

    return refusal(lambda: loop.load(path, step=step, data=data), watch, "the checkpoint", train)


@probe("checkpoint", quick=True, expect="error", words=("SGD",))
def p_load_into_another_optimizer(tmp: str) -> Verdict:
    """A checkpoint of AdamW loaded into a job built with SGD: refused, nothing changed."""
    return load_refused(tmp, Job(loader()), opt_kind="sgd")


@probe("checkpoint", quick=True, expect="error", words=("l1.weight",))
def p_load_into_another_model(tmp: str) -> Verdict:
    """A checkpoint loaded into a model of another width: refused, nothing changed (torch's
    ``load_state_dict`` copies the entries that fit before it raises)."""
    return load_refused(tmp, Job(loader()), hidden=9)


@probe("checkpoint", quick=True, expect="error", words=("length",))
def p_load_with_changed_dataset(tmp: str) -> Verdict:
    """The dataset grew from 22 to 24 rows between the save and the resume."""
    return load_refused(tmp, Job(loader()), Job(loader(rows=24)))


@probe("checkpoint", expect="error", words=("batch",))
def p_load_with_changed_batch_size(tmp: str) -> Verdict:
    """The batch size changed from 2 to 3 between the save and the resume."""
    return load_refused(tmp, Job(loader()), Job(loader(batch=3)))


@probe("checkpoint", quick=True, expect="error", words=("n=3",))
def p_load_with_changed_n(tmp: str) -> Verdict:
    """``n`` changed from 3 to 2 at resume: refused in the user's terms (``n``)."""
    return load_refused(tmp, Job(loader()), n=2)


def _world_of_one() -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


@probe("checkpoint", quick=True, expect="error")
def p_load_files_of_two_runs(tmp: str) -> Verdict:
    """Two runs (other seeds, each its own process group) saved at the same window and
    micro-step under a sync; the directory ends up with ``shared.pt`` of one and ``rank0.pt``
    of the other (a save cut short): refused, nothing changed."""
    paths = [os.path.join(tmp, f"run{i}") for i in range(2)]
    for i, path in enumerate(paths):
        _world_of_one()
        seed_all(i)
        model = net(dropout=0.0)
        torch.manual_seed(i)
        for p in model.parameters():
            p.data.normal_()
        opt = adamw(model)
        sync = gradaccum.all_reduce()
        data = loop.windows(batches([2] * 8, seed=i), 3, sync=sync)
        step = make_step(model, mse, opt, data=data, sync=sync)
        for window in data:
            for batch in window:
                step.add(batch)
                if (window.index, step.micro_step) == (1, 1):
                    loop.save(path, step=step, data=data)
            if window.index == 1:
                break
            step.apply()
        dist.destroy_process_group()
    shutil.copy(os.path.join(paths[1], "shared.pt"), os.path.join(paths[0], "shared.pt"))
    _world_of_one()
    model = net(dropout=0.0)
    opt = adamw(model)
    sync = gradaccum.all_reduce()
    data = loop.windows(batches([2] * 8, seed=0), 3, sync=sync)
    step = make_step(model, mse, opt, data=data, sync=sync)

    def watch() -> Any:
        return [training_state(model, opt), data.state_dict()]

    return refusal(lambda: loop.load(paths[0], step=step, data=data), watch, "files of two runs")


def small_job(path: str, cut: Any) -> tuple[Any, Any, Any, Any]:
    """A one-process job stopped at ``cut`` (without saving): model, optimizer, data, step."""
    seed_all(0)
    model = net()
    opt = adamw(model)
    data = loop.windows(batches([2] * 7), 3)
    step = make_step(model, mse, opt, data=data)
    for window in data:
        for batch in window:
            step.add(batch)
            if (window.index, step.micro_step) == cut:
                return model, opt, data, step
        step.apply()
    raise AssertionError("the cut was not reached")


@probe("checkpoint", quick=True, expect="error")
def p_save_path_empty(tmp: str) -> Verdict:
    """``loop.save("", ...)``: refused (it names no directory), nothing written."""
    model, opt, data, step = small_job(tmp, (1, 1))
    before = sorted(os.listdir("."))
    try:
        loop.save("", step=step, data=data)
    except Exception as err:  # noqa: BLE001
        return error_verdict(err)
    return wrong(
        f"accepted: it wrote {sorted(set(os.listdir('.')) - set(before))} into the current "
        f"directory"
    )


@probe("checkpoint", expect="error")
def p_save_path_is_a_file(tmp: str) -> Verdict:
    """``loop.save(path)`` where ``path`` is an existing file."""
    model, opt, data, step = small_job(tmp, (1, 1))
    path = os.path.join(tmp, "a-file")
    Path(path).write_text("not a directory")
    loop.save(path, step=step, data=data)
    return wrong("accepted a file as the checkpoint directory")


@probe("checkpoint", expect="error")
def p_save_path_none(tmp: str) -> Verdict:
    """``loop.save(None, ...)``."""
    model, opt, data, step = small_job(tmp, (1, 1))
    loop.save(None, step=step, data=data)  # type: ignore[arg-type]
    return wrong("accepted path=None")


@probe("checkpoint", expect="error")
def p_save_step_and_data_disagree(tmp: str) -> Verdict:
    """A micro-batch taken from the window but not added to the step, then ``save``."""
    seed_all(0)
    model = net()
    opt = adamw(model)
    data = loop.windows(batches([2] * 7), 3)
    step = make_step(model, mse, opt, data=data)
    for window in data:
        for i, batch in enumerate(window):
            if i == 0:
                step.add(batch)
            if i == 1:
                loop.save(os.path.join(tmp, "ckpt"), step=step, data=data)
                return wrong("saved a step and data at different points")
    return wrong("not reached")


@probe("checkpoint", quick=True, expect="error")
def p_load_damaged_file(tmp: str) -> Verdict:
    """``rank0.pt`` cut to half its size (a copy that did not finish): refused, nothing changed."""
    job = Job(loader())
    path = os.path.join(tmp, "ckpt")
    run_job(job, 0, 1, path, cut=("mid", 1, 1))
    file = Path(path, "rank0.pt")
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])
    model, opt, sched, data, step = built(job)

    def watch() -> Any:
        return [training_state(model, opt, sched), data.state_dict(), torch.get_rng_state()]

    return refusal(lambda: loop.load(path, step=step, data=data), watch, "a damaged file")


OLD_SAVE = """
import sys, torch
from gradaccum import loop
torch.manual_seed(0)
model = torch.nn.Linear(5, 1).double()
opt = torch.optim.AdamW(model.parameters(), lr=0.05)
g = torch.Generator().manual_seed(0)
f64 = torch.float64
mbs = [
    (torch.randn(2, 5, generator=g, dtype=f64), torch.randn(2, 1, generator=g, dtype=f64))
    for _ in range(7)
]
data = loop.windows(mbs, 3)
step = loop.Step(model, lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1]), optimizer=opt)
for window in data:
    for batch in window:
        step.add(batch)
        if (window.index, step.micro_step) == (1, 1):
            loop.save(sys.argv[1], step=step, data=data)
            sys.exit(0)
    step.apply()
"""


@probe("checkpoint", expect="error", words=("checkpoint/1",), bound=60)
def p_load_old_format(tmp: str) -> Verdict:
    """A checkpoint written by the gradaccum of before issue 26 (``--before``), loaded by this
    one: refused, naming its version, nothing changed."""
    if CKPT_FORMAT.endswith("/1"):
        return na("this is the version that writes the old format")
    if not BEFORE:
        return na("no --before tree to write an old checkpoint with")
    path = os.path.join(tmp, "old")
    env = {**os.environ, "PYTHONPATH": BEFORE}
    subprocess.run(
        [sys.executable, "-c", OLD_SAVE, path], env=env, check=True, timeout=50, capture_output=True
    )
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 1).double()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(0)
    mbs = [
        (torch.randn(2, 5, generator=g, dtype=F64), torch.randn(2, 1, generator=g, dtype=F64))
        for _ in range(7)
    ]
    data = loop.windows(mbs, 3)
    step = make_step(model, mse, opt, data=data)

    def watch() -> Any:
        return [training_state(model, opt), data.state_dict(), torch.get_rng_state()]

    return refusal(lambda: loop.load(path, step=step, data=data), watch, "an old checkpoint")


def uneven(rank: int, world: int) -> Any:
    """Rank 0: 7 micro-batches; rank 1: 5 (n=3: the last window holds 1 and 0)."""
    return batches([2] * (7 if rank == 0 else 5), seed=30 + rank)


@probe("checkpoint", world=2, quick=True, bound=45)
def p_save_in_an_uneven_last_window(rank: int, world: int, tmp: str) -> Verdict:
    """2 ranks whose last window holds 1 and 0 micro-batches; saved there with the documented
    idiom (``if window.index == save_at``, after the window's loop), resumed."""
    return resume_check(Job(uneven, epochs=1, dropout=0.0), [("end", 2)], rank, world, tmp)


@probe("checkpoint", world=2, bound=45)
def p_save_after_an_empty_window(rank: int, world: int, tmp: str) -> Verdict:
    """2 ranks, 2 epochs; saved after the ``apply()`` of the window that was empty on rank 1
    (the last of epoch 0), and at the next window's end; resumed."""
    return resume_check(
        Job(uneven, epochs=2, dropout=0.0), [("after", 2), ("end", 3)], rank, world, tmp
    )


@probe("checkpoint", world=2, quick=True)
def p_save_after_rank0_exited(rank: int, world: int, tmp: str) -> Verdict:
    """A final save after the loop, on every rank: rank 0 saves and its script ends (its process
    exits), rank 1 saves a second later. ``save`` communicates nothing, so rank 1's save must
    succeed."""
    path = os.path.join(tmp, "final")
    seed_all(0)
    model = net()
    opt = adamw(model)
    sync = gradaccum.all_reduce()
    data = loop.windows(Loader(mbs_of(rank)), 2, sync=sync)
    step = make_step(model, mse, opt, data=data, sync=sync)
    for window in data:
        for batch in window:
            step.add(batch)
        step.apply()
    dist.barrier()
    if rank == 1:
        time.sleep(1.0)  # a slower disk
    loop.save(path, step=step, data=data)
    if rank == 0:  # rank 0's script ends: its process, and the store it hosts, go
        return Verdict("exact", "saved and exited", exit_now=True)
    files = sorted(os.listdir(path))
    return ok(f"saved: {files}")


# == 4. Ranks that disagree or fail: every rank must raise, promptly ==============================


class Feed:
    """A rank's micro-batches, without a ``len()``; reading may raise or stall at a micro-batch,
    or making an epoch's iterator raise."""

    def __init__(
        self,
        mbs: list[Any],
        fail_at: int | None = None,
        stall_at: int | None = None,
        stall: float = 0.0,
        fail_epoch: int | None = None,
    ) -> None:
        self.mbs, self.fail_at, self.stall_at, self.stall = mbs, fail_at, stall_at, stall
        self.fail_epoch, self.epoch = fail_epoch, -1

    def __iter__(self) -> Iterator[Any]:
        self.epoch += 1
        if self.epoch == self.fail_epoch:
            raise Injected(f"injected: the loader of epoch {self.epoch} failed to start")
        return self._items()

    def _items(self) -> Iterator[Any]:
        for i, b in enumerate(self.mbs):
            if i == self.fail_at:
                raise Injected(f"injected: reading micro-batch {i} failed")
            if i == self.stall_at:
                time.sleep(self.stall)
            yield b


class Loader(Feed):
    """The same, with a ``len()``."""

    def __len__(self) -> int:
        return len(self.mbs)


def fault_run(
    rank: int,
    source: Any,
    *,
    n: Any = 2,
    epochs: int = 1,
    loss: Any = mse,
    timeout: float | None = None,
    hook: Callable[[str, Any, Any, nn.Module, Any], None] | None = None,
) -> Verdict:
    """A 2-rank job under ``all_reduce`` (no timeout of its own unless given: the process
    group's). It must end in an error on every rank, with nothing applied in the failing window."""
    seed_all(0)
    model = net()
    opt = adamw(model)
    sync = gradaccum.all_reduce(timeout=timeout)
    data = loop.windows(source, n, sync=sync, epochs=epochs)
    step = make_step(model, loss, opt, data=data, sync=sync)
    start = training_state(model, opt)
    done = 0

    def changed() -> str | None:
        return differ(training_state(model, opt), start, 0)

    try:
        for window in data:
            start = training_state(model, opt)
            if hook is not None:
                hook("start", window, step, model, data)
            for batch in window:
                step.add(batch)
                if hook is not None:
                    hook("add", window, step, model, data)
            if hook is not None:
                hook("end", window, step, model, data)
            step.apply()
            done += 1
            start = training_state(model, opt)
    except Injected as err:
        d = changed()
        return (
            corrupt(f"its injected error, but the window's update was applied: {d}")
            if d
            else own(f"{err}")
        )
    except Exception as err:  # noqa: BLE001 - classified
        d = changed()
        if d:
            return corrupt(
                f"{type(err).__name__} ({_message(err)[:200]}), but the failing window was "
                f"applied: {d}"
            )
        return error_verdict(err)
    return Verdict("returned", f"finished normally after {done} window(s)")


def mbs_of(rank: int, count: int = 6) -> list[Any]:
    return batches([2 + (i % 2) for i in range(count)], seed=50 + rank)


@probe("ranks", world=2, quick=True, expect="error")
def p_ranks_disagree_on_n(rank: int, world: int, tmp: str) -> Verdict:
    """``windows(data, n)`` with n=2 on rank 0 and n=3 on rank 1."""
    return fault_run(rank, Loader(mbs_of(rank)), n=2 if rank == 0 else 3)


@probe("ranks", world=2, expect="error")
def p_ranks_disagree_on_epochs(rank: int, world: int, tmp: str) -> Verdict:
    """``epochs=1`` on rank 0, ``epochs=2`` on rank 1."""
    return fault_run(rank, Loader(mbs_of(rank, 4)), epochs=1 + rank)


@probe("ranks", world=2, expect="error")
def p_ranks_disagree_on_a_schedule(rank: int, world: int, tmp: str) -> Verdict:
    """A schedule ``n(index)`` that differs from window 2 on (rank 1's grows to 3)."""
    n = (lambda i: 2) if rank == 0 else (lambda i: 2 if i < 2 else 3)
    return fault_run(rank, Loader(mbs_of(rank, 8)), n=n)


@probe("ranks", world=2, quick=True, expect="error")
def p_ranks_sized_against_unsized(rank: int, world: int, tmp: str) -> Verdict:
    """Data with a ``len()`` on rank 0, without one on rank 1 (the same micro-batches)."""
    return fault_run(rank, (Loader if rank == 0 else Feed)(mbs_of(rank)))


@probe("ranks", world=2, quick=True, expect="error")
def p_data_error_inside_a_window(rank: int, world: int, tmp: str) -> Verdict:
    """Rank 1's loader raises at its 4th micro-batch (window 1): rank 0 must not wait for the
    process group's timeout."""
    return fault_run(rank, Loader(mbs_of(rank), fail_at=3 if rank == 1 else None))


@probe("ranks", world=2, expect="error")
def p_data_error_at_an_epoch_start(rank: int, world: int, tmp: str) -> Verdict:
    """Rank 1's loader raises when epoch 1's iterator is made."""
    return fault_run(rank, Loader(mbs_of(rank, 4), fail_epoch=1 if rank == 1 else None), epochs=2)


@probe("ranks", world=2, quick=True, expect="error")
def p_loss_error_on_one_rank(rank: int, world: int, tmp: str) -> Verdict:
    """Rank 1's loss function raises in window 1."""
    calls = [0]

    def loss(model: nn.Module, batch: Any) -> torch.Tensor:
        calls[0] += 1
        if rank == 1 and calls[0] == 4:
            raise Injected("injected: the loss failed")
        return mse(model, batch)

    return fault_run(rank, Loader(mbs_of(rank)), loss=loss)


@probe("ranks", world=2, quick=True, expect="error")
def p_save_on_one_rank(rank: int, world: int, tmp: str) -> Verdict:
    """Only rank 0 calls ``loop.save`` (mid-window 1): every rank must raise, the optimizer not
    stepped."""
    path = os.path.join(tmp, "ckpt")

    def hook(event: str, window: Any, step: Any, model: nn.Module, data: Any) -> None:
        if event == "add" and rank == 0 and (window.index, step.micro_step) == (1, 1):
            loop.save(path, step=step, data=data)

    return fault_run(rank, Loader(mbs_of(rank)), hook=hook)


@probe("ranks", world=2, expect="error")
def p_save_idiom_of_window_and_micro_step(rank: int, world: int, tmp: str) -> Verdict:
    """The old idiom ``if (window.index, step.micro_step) == (2, 1): save`` in a last window of 1
    and 0 micro-batches: only rank 0 reaches it."""
    path = os.path.join(tmp, "ckpt")

    def hook(event: str, window: Any, step: Any, model: nn.Module, data: Any) -> None:
        if event == "add" and (window.index, step.micro_step) == (2, 1):
            loop.save(path, step=step, data=data)

    return fault_run(rank, Loader(mbs_of(rank, 5 - rank)), hook=hook)


@probe("ranks", world=2, expect="error")
def p_ranks_disagree_on_frozen_parameters(rank: int, world: int, tmp: str) -> Verdict:
    """Rank 1 freezes ``l2.bias`` before window 1, rank 0 does not."""

    def hook(event: str, window: Any, step: Any, model: nn.Module, data: Any) -> None:
        if event == "start" and rank == 1 and window.index == 1:
            model.l2.bias.requires_grad_(False)

    return fault_run(rank, Loader(mbs_of(rank)), hook=hook)


@probe("ranks", world=2, quick=True, expect="error")
def p_load_refused_on_one_rank(rank: int, world: int, tmp: str) -> Verdict:
    """Both ranks saved; rank 1's file is then cut short. Both load: every rank must raise,
    nothing changed on rank 0 (parameters, optimizer, data position)."""
    path = os.path.join(tmp, "ckpt")
    job = Job(lambda r, w: mbs_of(r), n=2, epochs=1, dropout=0.0)
    run_job(job, rank, world, path, cut=("end", 1))
    dist.barrier()
    if rank == 1:
        file = Path(path, "rank1.pt")
        file.write_bytes(file.read_bytes()[:100])
    dist.barrier()
    seed_all(0)
    model = net()
    opt = adamw(model)
    sched = warmup(opt)
    sync = gradaccum.all_reduce()
    data = loop.windows(mbs_of(rank), 2, sync=sync)
    step = make_step(model, mse, opt, data=data, sync=sync, scheduler=sched, clip=1.0)

    def watch() -> Any:
        return [training_state(model, opt, sched), data.state_dict(), torch.get_rng_state()]

    return refusal(lambda: loop.load(path, step=step, data=data), watch, "the checkpoint")


@probe("ranks", world=2, quick=True, expect="error")
def p_peer_times_out_in_a_window(rank: int, world: int, tmp: str) -> Verdict:
    """``all_reduce(timeout=2)``; rank 1's loader stalls 4.5 s in window 1: both ranks raise
    (rank 0 at its boundary, rank 1 when it wakes), nothing applied in window 1."""
    return fault_run(
        rank, Loader(mbs_of(rank), stall_at=3 if rank == 1 else None, stall=4.5), timeout=2.0
    )


@probe("ranks", world=2, expect="error")
def p_data_error_step_without_data(rank: int, world: int, tmp: str) -> Verdict:
    """Rank 1's loader raises inside window 1, the Step built with ``sync=`` but without
    ``data=`` (as before issue 26, and as the sync alone allows)."""
    seed_all(0)
    model = net()
    opt = adamw(model)
    sync = gradaccum.all_reduce()
    data = loop.windows(Loader(mbs_of(rank), fail_at=3 if rank == 1 else None), 2, sync=sync)
    step = loop.Step(model, mse, optimizer=opt, sync=sync)
    try:
        for window in data:
            for batch in window:
                step.add(batch)
            step.apply()
    except Injected as err:
        return own(str(err))
    return Verdict("returned", "finished normally")


@probe("ranks", world=2, expect="error")
def p_data_error_with_prefetch(rank: int, world: int, tmp: str) -> Verdict:
    """Rank 1's loader raises while window 1 is read ahead (``prefetch=True``)."""
    seed_all(0)
    model = net()
    opt = adamw(model)
    sync = gradaccum.all_reduce()
    data = loop.windows(
        Loader(mbs_of(rank), fail_at=3 if rank == 1 else None), 2, sync=sync, prefetch=True
    )
    step = make_step(model, mse, opt, data=data, sync=sync)
    start = training_state(model, opt)
    try:
        for window in data:
            start = training_state(model, opt)
            for batch in window:
                step.add(batch)
            step.apply()
    except Injected as err:
        return own(str(err))
    except Exception as err:  # noqa: BLE001
        d = differ(training_state(model, opt), start, 0)
        return (
            corrupt(f"{_message(err)[:200]}; the window was applied: {d}")
            if d
            else error_verdict(err)
        )
    return Verdict("returned", "finished normally")


@probe("ranks", world=2, expect="error")
def p_data_error_without_len(rank: int, world: int, tmp: str) -> Verdict:
    """Rank 1's data has no ``len()`` (agreed window by window) and raises inside window 1."""
    return fault_run(rank, Feed(mbs_of(rank), fail_at=3 if rank == 1 else None))


@probe("ranks", world=2, expect="error")
def p_ranks_disagree_on_reduction(rank: int, world: int, tmp: str) -> Verdict:
    """``reduction="mean"`` on rank 0, ``"sum"`` on rank 1."""
    seed_all(0)
    model = net()
    opt = adamw(model)
    sync = gradaccum.all_reduce()
    data = loop.windows(Loader(mbs_of(rank)), 2, sync=sync)
    step = make_step(
        model, mse, opt, data=data, sync=sync, reduction="mean" if rank == 0 else "sum"
    )
    try:
        for window in data:
            for batch in window:
                step.add(batch)
            step.apply()
    except Exception as err:  # noqa: BLE001
        return error_verdict(err)
    return Verdict("returned", "finished normally")


@probe("ranks", world=2, expect="error")
def p_ranks_disagree_on_clip(rank: int, world: int, tmp: str) -> Verdict:
    """``clip=0.1`` on rank 0, no clipping on rank 1: the replicas' parameters would drift
    apart (refused, or the same update on both)."""
    seed_all(0)
    model = net()
    opt = adamw(model)
    sync = gradaccum.all_reduce()
    data = loop.windows(Loader(mbs_of(rank)), 2, sync=sync)
    step = make_step(model, mse, opt, data=data, sync=sync, clip=0.1 if rank == 0 else None)
    try:
        for window in data:
            for batch in window:
                step.add(batch)
            step.apply()
    except Exception as err:  # noqa: BLE001
        return error_verdict(err)
    mine = torch.cat([p.detach().flatten() for p in model.parameters()])
    other = mine.clone()
    dist.broadcast(other, src=0)
    if not torch.equal(mine, other):
        return wrong(f"the ranks' parameters differ by {float((mine - other).abs().max()):.3g}")
    return ok("the same parameters on both ranks")


# == 5. A normal exit after a fault ===============================================================

EXIT_SCRIPT = """
import datetime, os, sys, time
import torch
import torch.distributed as dist
from torch import nn
import gradaccum
from gradaccum import loop


class Loader:  # rank 1's stalls in window 1, longer than the sync's timeout
    def __init__(self, rank):
        g = torch.Generator().manual_seed(rank)
        self.rank = rank
        self.data = [(torch.randn(3, 5, generator=g, dtype=torch.float64),
                      torch.randn(3, 1, generator=g, dtype=torch.float64)) for _ in range(8)]

    def __iter__(self):
        for i, batch in enumerate(self.data):
            if self.rank == 1 and i == 3:
                time.sleep(3.0)
            yield batch

    def __len__(self):
        return len(self.data)


def mse(model, batch):
    return nn.functional.mse_loss(model(batch[0]), batch[1])


dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
rank = dist.get_rank()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 1)).double()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
sync = gradaccum.all_reduce(timeout=1.0)
data = loop.windows(Loader(rank), 2, sync=sync)
step = loop.Step(model, mse, optimizer=optimizer, sync=sync)
try:
    for window in data:
        for batch in window:
            step.add(batch)
        step.apply()
    print("RESULT returned", flush=True)
except gradaccum.GradAccumError as err:
    print("RESULT GradAccumError " + str(err).replace(chr(10), " "), flush=True)
dist.destroy_process_group()
"""


def _exit_run(script: str, *args: str) -> list[tuple[int | None, str, str]]:
    port = _launch.free_port()
    procs = []
    for r in range(2):
        env = {
            **os.environ,
            "RANK": str(r),
            "WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "GLOO_SOCKET_IFNAME": "lo",
            "OMP_NUM_THREADS": "1",
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, script, *args],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    end = time.monotonic() + 60
    out = []
    for p in procs:
        try:
            stdout, stderr = p.communicate(timeout=max(1.0, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            stdout, stderr = p.communicate()
            out.append((None, stdout, stderr))
            continue
        out.append((p.returncode, stdout, stderr))
    return out


@probe("exit", quick=True, bound=200)
def p_normal_exit_after_a_timeout(tmp: str) -> Verdict:
    """A user script on 2 ranks (fresh interpreters, torchrun's environment): rank 1 stalls past
    ``all_reduce(timeout=1)``; each rank catches ``GradAccumError``, destroys the group and
    returns. Both must exit 0 through a normal interpreter exit, in every run (5; 1 with
    ``--quick``)."""
    script = os.path.join(tmp, "exit_after_fault.py")
    Path(script).write_text(EXIT_SCRIPT)
    runs = 1 if QUICK else 5
    messages = []
    for run in range(runs):
        for r, (code, stdout, stderr) in enumerate(_exit_run(script)):
            tail = " / ".join(stderr.strip().splitlines()[-2:])
            if code is None:
                return Verdict("hang", f"run {run + 1}: rank {r} still running after 60 s: {tail}")
            if code != 0:
                name = signal.Signals(-code).name if code < 0 else f"code {code}"
                return Verdict(
                    "crash", f"run {run + 1} of {runs}: rank {r} exited with {name}: {tail}"
                )
            result = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
            if not result or result[0].startswith("RESULT returned"):
                return wrong(f"run {run + 1}: rank {r} did not raise: {stdout.strip()[-200:]}")
            messages.append(result[0].removeprefix("RESULT GradAccumError "))
    unclear = [m for m in messages if not is_clear(m)]
    if unclear:
        return Verdict("error", error=("GradAccumError", unclear[0], "?"))
    return Verdict("own", f"{runs} run(s): every rank raised GradAccumError and exited 0")


EXIT_SHAPES = Path(__file__).resolve().parents[1] / "tests" / "exit_shapes.py"


@probe("exit", quick=True, bound=400)
def p_normal_exit_module_level(tmp: str) -> Verdict:
    """Issue 35, section 1: a 2-rank script that keeps ``loop.windows(..., sync=...)``, a
    ``Step`` or a ``loop.Coupled`` step in module globals, finishes, calls
    ``destroy_process_group()`` and returns (``tests/exit_shapes.py``, each shape 3 times; once
    with ``--quick``). Every rank must exit 0, and the group must be freed at
    ``destroy_process_group()``: one that outlives it is freed at interpreter exit, with its
    gloo worker threads, where one that frees a collective's tensors aborts the process (about 1
    run in 5 under torchrun before the fix)."""
    runs = 1 if QUICK else 3
    kept = []
    for shape in ("windows", "step", "coupled"):
        for run in range(runs):
            for r, (code, stdout, stderr) in enumerate(_exit_run(str(EXIT_SHAPES), shape)):
                tail = " / ".join(stderr.strip().splitlines()[-2:])
                if code is None:
                    return Verdict("hang", f"{shape} run {run + 1}: rank {r} still running: {tail}")
                if code != 0:
                    name = signal.Signals(-code).name if code < 0 else f"code {code}"
                    what = f"{shape} run {run + 1}: rank {r} exited {name}: {tail}"
                    return Verdict("crash", what)
                if "freed=False" in stdout:
                    kept.append(shape)
    if kept:
        return wrong(
            f"every run exited 0, but the group outlived destroy_process_group() in "
            f"{sorted(set(kept))}: freed at interpreter exit, where a gloo worker thread may abort "
            f"the process"
        )
    return ok(f"3 shapes x {runs} run(s): exit 0, the group freed at destroy_process_group()")


# == 6. torch.func transforms over accumulate =====================================================


def _tparams() -> tuple[dict[str, torch.Tensor], Any]:
    g = torch.Generator().manual_seed(0)
    p = {
        "w": torch.randn(3, 4, generator=g, dtype=F64),
        "v": torch.randn(4, generator=g, dtype=F64),
    }
    x, y = torch.randn(12, 3, generator=g, dtype=F64), torch.randn(12, generator=g, dtype=F64)
    return p, (x, y)


def tloss(p: dict[str, torch.Tensor], batch: Any) -> torch.Tensor:
    x, y = batch
    return ((torch.tanh(x @ p["w"]) @ p["v"] - y) ** 2).mean()


def step_fn(p: dict[str, torch.Tensor], batch: Any) -> Any:
    """A step function of the user's own: the micro-batch's gradients."""
    return torch.func.grad(tloss)(p, batch)


def _against(got: Any, want: Any, what: str) -> Verdict:
    d = _same_tree(got, want, TOL, what)
    if d is None:
        return ok()
    zeros = all(float(t.abs().max()) == 0 for t in _leaves(got))
    return wrong(f"{d}" + (" (all zeros)" if zeros else ""))


def _leaves(tree: Any) -> list[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, dict):
        return [t for v in tree.values() for t in _leaves(v)]
    if isinstance(tree, (list, tuple)):
        return [t for v in tree for t in _leaves(v)]
    return []


@probe("transforms", quick=True, expect="error", words=("jacrev",))
def p_jacrev_over_accumulate(tmp: str) -> Verdict:
    """``torch.func.jacrev`` of ``accumulate(step_fn, 3)``: the Hessian (or a refusal naming
    the transform), never zeros."""
    p, batch = _tparams()
    acc = gradaccum.accumulate(step_fn, 3)
    got = torch.func.jacrev(lambda q: acc(q, batch))(p)
    return _against(got, torch.func.hessian(tloss)(p, batch), "jacrev")


@probe("transforms", expect="error", words=("jacfwd",))
def p_jacfwd_over_accumulate(tmp: str) -> Verdict:
    """``torch.func.jacfwd`` of ``accumulate(step_fn, 3)``."""
    p, batch = _tparams()
    acc = gradaccum.accumulate(step_fn, 3)
    got = torch.func.jacfwd(lambda q: acc(q, batch))(p)
    return _against(got, torch.func.hessian(tloss)(p, batch), "jacfwd")


@probe("transforms", expect="error", words=("grad",))
def p_grad_of_a_function_of_accumulate(tmp: str) -> Verdict:
    """``torch.func.grad`` of the accumulated gradient's squared norm (a gradient penalty)."""
    p, batch = _tparams()
    acc = gradaccum.accumulate(step_fn, 3)

    def penalty(q: Any, fn: Any) -> torch.Tensor:
        return sum((g**2).sum() for g in fn(q, batch).values())  # type: ignore[return-value]

    got = torch.func.grad(lambda q: penalty(q, acc))(p)
    return _against(got, torch.func.grad(lambda q: penalty(q, step_fn))(p), "grad")


@probe("transforms", quick=True, expect="error", words=("vmap",))
def p_vmap_over_accumulate(tmp: str) -> Verdict:
    """``torch.func.vmap`` of ``accumulate(step_fn, 3)`` over a batch of 2 windows."""
    p, (x, y) = _tparams()
    acc = gradaccum.accumulate(step_fn, 3)
    xs, ys = torch.stack([x, x.flip(0)]), torch.stack([y, y.flip(0)])
    got = torch.func.vmap(acc, in_dims=(None, 0))(p, (xs, ys))
    want = {k: torch.stack([step_fn(p, (xs[i], ys[i]))[k] for i in range(2)]) for k in p}
    return _against(got, want, "vmap")


# == 7. privacy: clip_per_sample and dp_noise under reduction="mean" ==============================

C = 1.0


def sample_loss(p: dict[str, torch.Tensor], sample: Any) -> torch.Tensor:
    x, y = sample
    return (torch.tanh(x @ p["w"]) @ p["v"] - y) ** 2


def clipped_sum(p: dict[str, torch.Tensor], batch: Any) -> dict[str, torch.Tensor]:
    """Each sample's gradient clipped to norm C in a Python loop, summed."""
    x, y = batch
    total = {k: torch.zeros_like(v) for k, v in p.items()}
    for i in range(len(y)):
        g = torch.func.grad(sample_loss)(p, (x[i], y[i]))
        norm = math.sqrt(sum(float(t.pow(2).sum()) for t in g.values()))
        factor = min(1.0, C / (norm + 1e-6))
        for k in total:
            total[k] += factor * g[k]
    return total


def _dp_batch() -> tuple[dict[str, torch.Tensor], Any]:
    p, (x, _) = _tparams()
    g = torch.Generator().manual_seed(1)
    y = torch.randn(12, generator=g, dtype=F64) * torch.logspace(-2, 2, 12, dtype=F64)
    return p, (x, y)


PER_SAMPLE = torch.func.vmap(torch.func.grad(sample_loss), in_dims=(None, 0))


@probe("privacy", quick=True, expect="error")
def p_clip_per_sample_under_mean(tmp: str) -> Verdict:
    """``accumulate(per-sample grads, 3, micro_transform=clip_per_sample(1))`` under the default
    ``reduction="mean"``: the mean of the clipped per-sample gradients (or a refusal)."""
    p, batch = _dp_batch()
    got = gradaccum.accumulate(PER_SAMPLE, 3, micro_transform=gradaccum.privacy.clip_per_sample(C))(
        p, batch
    )
    return _against(got, {k: v / 12 for k, v in clipped_sum(p, batch).items()}, "clipped mean")


@probe("privacy")
def p_clip_per_sample_under_sum(tmp: str) -> Verdict:
    """The same under ``reduction="sum"``: the clipped sum."""
    p, batch = _dp_batch()
    clip = gradaccum.privacy.clip_per_sample(C)
    got = gradaccum.accumulate(PER_SAMPLE, 3, reduction="sum", micro_transform=clip)(p, batch)
    return _against(got, clipped_sum(p, batch), "clipped sum")


@probe("privacy", expect="error", words=("sum",))
def p_dp_noise_under_mean(tmp: str) -> Verdict:
    """``sync=dp_noise(0, 1, 12)`` (no noise) with ``clip_per_sample`` under the default
    ``reduction="mean"``: DP-SGD's ``(clipped sum) / 12``, or a refusal."""
    p, batch = _dp_batch()
    got = gradaccum.accumulate(
        PER_SAMPLE,
        3,
        micro_transform=gradaccum.privacy.clip_per_sample(C),
        sync=gradaccum.privacy.dp_noise(0.0, C, 12),
    )(p, batch)
    return _against(got, {k: v / 12 for k, v in clipped_sum(p, batch).items()}, "DP-SGD gradient")


# == 8. Loss kinds: what the loss returns says what it is (issue 35, section 2) =================
#
# A token-level loss over padded sequences (labels -100 on padding), windows of uneven token
# counts; the right answer is the plain float64 loop on the token mean over the whole window
# (each micro-batch's summed token loss divided by the window's tokens, over all ranks). A row
# is exact, refused clearly, or silently wrong with what it is off by (the largest parameter
# difference after the windows' SGD steps, and StepStats.loss against the token mean).

VOCAB = 11


def lm(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Embedding(VOCAB, 8), nn.Tanh(), nn.Linear(8, VOCAB)).double()


def token_windows(sizes: list[list[int]], seed: int = 0) -> list[list[Any]]:
    """Windows of micro-batches ``(inputs, labels)``: sequences of 1 to 8 tokens, padded."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for window in sizes:
        mbs = []
        for rows in window:
            lengths = torch.randint(1, 9, (rows,), generator=g)
            inputs = torch.randint(1, VOCAB, (rows, int(lengths.max())), generator=g)
            labels = torch.randint(0, VOCAB, inputs.shape, generator=g)
            labels[torch.arange(inputs.shape[1]) >= lengths[:, None]] = -100
            mbs.append((inputs, labels))
        out.append(mbs)
    return out


TOKEN_WINDOWS = [[3, 1, 2], [2, 2], [4]]


def token_sum(model: nn.Module, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The summed token loss over the non-padding tokens, and their count (a tensor)."""
    inputs, labels = batch
    logits = model(inputs).flatten(0, 1)
    loss = F.cross_entropy(logits, labels.flatten(), ignore_index=-100, reduction="sum")
    return loss, (labels != -100).sum()


def token_mean(model: nn.Module, batch: Any) -> torch.Tensor:
    """The familiar token-mean loss of one micro-batch (``ignore_index=-100``)."""
    inputs, labels = batch
    return F.cross_entropy(model(inputs).flatten(0, 1), labels.flatten(), ignore_index=-100)


def token_reference(windows: list[list[Any]]) -> tuple[dict[str, Any], list[float]]:
    """The plain loop on the token mean over each whole window: SGD, float64."""
    model = lm()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for window in windows:
        total = sum(int((labels != -100).sum()) for _, labels in window)
        loss_sum = 0.0
        for mb in window:
            summed, _ = token_sum(model, mb)
            (summed / total).backward()
            loss_sum += float(summed)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss_sum / total)
    return training_state(model, opt), losses


def kinds_verdict(got: dict[str, Any], losses: list[float], windows: list[list[Any]]) -> Verdict:
    want, want_losses = token_reference(windows)
    d = differ(got, want)
    if d is None and _same_tree(losses, want_losses, TOL, "") is None:
        return ok()
    return wrong(
        f"another objective than the token mean over the window: {d or 'parameters equal'}; "
        f"StepStats.loss of window 0 {losses[0]:.6g} against the token mean {want_losses[0]:.6g}"
    )


def kinds_run(loss: Any, windows: list[list[Any]] | None = None, **kw: Any) -> Verdict:
    """Train ``lm()`` with ``Step(loss)`` (SGD) and compare with ``token_reference``."""
    windows = token_windows(TOKEN_WINDOWS) if windows is None else windows
    model = lm()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = step_loop(make_step(model, loss, opt, **kw), windows)
    return kinds_verdict(training_state(model, opt), losses, windows)


@probe("kinds", quick=True, expect="error", words=("Mean", "Sum"))
def p_kinds_forgotten_count_int(tmp: str) -> Verdict:
    """``(summed_loss, int(tokens))`` under the default reduction (``reduction="count"``
    forgotten): the token mean, or a refusal naming both typed forms."""

    def loss(model: nn.Module, batch: Any) -> Any:
        summed, tokens = token_sum(model, batch)
        return summed, int(tokens)

    return kinds_run(loss)


@probe("kinds", quick=True, expect="error", words=("Mean", "Sum"))
def p_kinds_forgotten_count_tensor(tmp: str) -> Verdict:
    """The same with the count as a tensor, ``(labels != -100).sum()``: the message must name
    the user's call (``Step.add``), not ``Accumulator.add``."""
    return kinds_run(token_sum)


@probe("kinds", quick=True)
def p_kinds_bare_token_mean(tmp: str) -> Verdict:
    """``F.cross_entropy(..., ignore_index=-100)`` returned bare under the default: weighted by
    rows, not tokens. It cannot be told from a per-row mean, so it stays a documented trap (the
    README's first screen)."""
    return kinds_run(token_mean)


@probe("kinds", quick=True)
def p_kinds_mean_of_tokens(tmp: str) -> Verdict:
    """``gradaccum.Mean(token_mean, tokens)`` (a tensor count) under the default."""
    if not HAS_KINDS:
        return na("no gradaccum.Mean")
    return kinds_run(lambda m, b: gradaccum.Mean(token_mean(m, b), token_sum(m, b)[1]))


@probe("kinds", quick=True)
def p_kinds_sum_of_tokens(tmp: str) -> Verdict:
    """``gradaccum.Sum(token_sum, tokens)`` under the default."""
    if not HAS_KINDS:
        return na("no gradaccum.Sum")
    return kinds_run(lambda m, b: gradaccum.Sum(*token_sum(m, b)))


@probe("kinds")
def p_kinds_mixed_and_int_counts(tmp: str) -> Verdict:
    """``Mean`` with an int count and ``Sum`` with a tensor count, alternating over the
    micro-batches of a window."""
    if not HAS_KINDS:
        return na("no gradaccum.Mean")
    at = [0]

    def loss(model: nn.Module, batch: Any) -> Any:
        at[0] += 1
        summed, tokens = token_sum(model, batch)
        if at[0] % 2:
            return gradaccum.Mean(token_mean(model, batch), int(tokens))
        return gradaccum.Sum(summed, tokens)

    return kinds_run(loss)


@probe("kinds")
def p_kinds_count_with_sum(tmp: str) -> Verdict:
    """``reduction="count"`` kept, the loss returning ``Sum``: as without the keyword."""
    if not HAS_KINDS:
        return na("no gradaccum.Sum")
    return kinds_run(lambda m, b: gradaccum.Sum(*token_sum(m, b)), reduction="count")


@probe("kinds", expect="error", words=("Mean", "count"))
def p_kinds_mean_under_count(tmp: str) -> Verdict:
    """``Mean`` under ``reduction="count"`` (which means: every micro-batch returns a sum)."""
    if not HAS_KINDS:
        return na("no gradaccum.Mean")
    return kinds_run(
        lambda m, b: gradaccum.Mean(token_mean(m, b), token_sum(m, b)[1]), reduction="count"
    )


def kinds_2ranks(rank: int, loss: Any) -> Verdict:
    """2 ranks under ``all_reduce``, windows of 2 micro-batches, against the token mean over
    the global windows in one process."""
    per_rank = [
        [mb for w in token_windows([[2, 3, 1]], seed=60) for mb in w],
        [mb for w in token_windows([[1, 4]], seed=61) for mb in w],
    ]
    model = lm()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    sync = gradaccum.all_reduce()
    data = loop.windows(per_rank[rank], 2, sync=sync)
    step = make_step(model, loss, opt, data=data, sync=sync)
    losses = []
    for window in data:
        for mb in window:
            step.add(mb)
        losses.append(float(step.apply().loss))
    return kinds_verdict(training_state(model, opt), losses, _global(per_rank, 2))


@probe("kinds", world=2, quick=True)
def p_kinds_2ranks_mean_and_sum(rank: int, world: int, tmp: str) -> Verdict:
    """2 ranks: rank 0 returns ``Mean(token_mean, tokens)``, rank 1 ``Sum(token_sum,
    tokens)``: the token mean over the global window."""
    if not HAS_KINDS:
        return na("no gradaccum.Mean")
    if rank == 0:
        return kinds_2ranks(rank, lambda m, b: gradaccum.Mean(token_mean(m, b), token_sum(m, b)[1]))
    return kinds_2ranks(rank, lambda m, b: gradaccum.Sum(*token_sum(m, b)))


@probe("kinds", world=2, quick=True, expect="error")
def p_kinds_2ranks_tuple_on_one_rank(rank: int, world: int, tmp: str) -> Verdict:
    """2 ranks: rank 0 returns the bare per-row mean, rank 1 the plain tuple ``(token_sum,
    tokens)`` under the default: every rank raises, promptly."""
    return kinds_2ranks(rank, token_sum if rank == 1 else token_mean)


# == 9. The loop's coupled forms (issue 35, section 4) ===========================================
#
# loop.Coupled (a CLIP-style loss with a learned temperature) and loop.WindowStats (a loss
# normalised by the window's positive count), against the plain float64 loop over each whole
# global window: every micro-batch's forward, the loss once, backward(), SGD.

COUPLED_SIZES = [[[2, 3, 2], [3, 2]], [[2, 2, 3], [2]], [[3, 2], []]]  # [window][rank]: rows


class Tower(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 3)
        self.log_scale = nn.Parameter(torch.tensor(0.5))
        self.double()


def c_embed(model: nn.Module, mb: Any) -> Any:
    return F.normalize(model.lin(mb), dim=-1)


def c_loss(model: nn.Module, z: torch.Tensor, rows: Any) -> torch.Tensor:
    logits = model.log_scale.exp() * z[rows.local] @ z.T
    target = torch.arange(rows.start, rows.stop) ^ 1  # rows 2i and 2i+1 pair up
    target = torch.where(target < rows.total, target, target - 1)
    logits = logits - 1e9 * torch.eye(rows.total, dtype=z.dtype)[rows.local]
    return F.cross_entropy(logits, target, reduction="sum") / rows.total


def s_stats(model: nn.Module, mb: Any) -> torch.Tensor:
    return (mb[:, 0] > 0).sum()


def s_loss(model: nn.Module, mb: Any, count: Any) -> torch.Tensor:
    return model.lin(mb).pow(2).mean() / count


def coupled_data(world: int) -> list[list[list[torch.Tensor]]]:
    g = torch.Generator().manual_seed(3)
    return [
        [[torch.randn(r, 4, generator=g, dtype=torch.float64) for r in w[k]] for k in range(world)]
        for w in COUPLED_SIZES
    ]


def coupled_reference(kind: str, data: Any, frozen: bool = False) -> tuple[Any, list[float]]:
    model = Tower()
    if frozen:
        model.lin.requires_grad_(False)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    losses = []
    for window in data:
        mbs = [mb for rank in window for mb in rank]
        if kind == "coupled":
            z = torch.cat([c_embed(model, mb) for mb in mbs])
            per_rank = [sum(len(mb) for mb in rank) for rank in window]
            total = 0
            for r in range(len(window)):
                a = sum(per_rank[:r])
                rows = gradaccum.Rows(a, a + per_rank[r], sum(per_rank), tuple(per_rank), r)
                total = total + (c_loss(model, z, rows) if per_rank[r] else 0)
        else:
            count = sum(s_stats(model, mb) for mb in mbs)
            rows = sum(len(mb) for mb in mbs)
            total = sum(s_loss(model, mb, count) * len(mb) / rows for mb in mbs)
        total.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(total.detach()))
    return training_state(model, opt), losses


def coupled_run(
    kind: str, rank: int = 0, world: int = 1, fail: int = 0, frozen: bool = False
) -> Verdict:
    """Train ``Tower`` with ``Step(Coupled|WindowStats)``; ``fail``: the call of ``embed`` (or
    of the loss) that raises once, caught, then the window added again."""
    if getattr(loop, "Coupled", None) is None:
        return na("no gradaccum.loop.Coupled")
    data = coupled_data(world)
    if world == 1:
        data = [[[mb for r in w for mb in r]] for w in data]
    calls = [0]

    def flaky(fn: Callable[..., Any]) -> Callable[..., Any]:
        def inner(*args: Any) -> Any:
            calls[0] += 1
            if calls[0] == fail:
                raise Injected("injected")
            return fn(*args)

        return inner

    model = Tower()
    if frozen:
        model.lin.requires_grad_(False)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    if kind == "coupled":
        loss: Any = loop.Coupled(flaky(c_embed), c_loss)
    else:
        loss = loop.WindowStats(s_stats, flaky(s_loss))
    sync = gradaccum.all_reduce() if world > 1 else None
    step = loop.Step(model, loss, optimizer=opt, sync=sync)
    losses = []
    for window in data:
        try:
            step.add_window(window[rank])
        except Injected:
            step.add_window(window[rank])  # the same window again
        losses.append(float(step.apply().loss))
    want, want_losses = coupled_reference(kind, coupled_data(world), frozen)
    d = differ(training_state(model, opt), want)
    if d is None and _same_tree(losses, want_losses, TOL, "") is None:
        return ok()
    return wrong(f"{d or 'parameters equal'}; losses {losses} against {want_losses}")


@probe("coupled", quick=True)
def p_coupled_failed_window_retried(tmp: str) -> Verdict:
    """``loop.Coupled``: ``embed`` raises in pass 2 of window 0 (micro-batch 2 of 3), caught;
    ``add_window`` of the same window again, then ``apply()``."""
    return coupled_run("coupled", fail=3 + 2)


@probe("coupled", quick=True)
def p_coupled_stats_failed_window_retried(tmp: str) -> Verdict:
    """``loop.WindowStats``: the loss raises at micro-batch 2 of 3 of window 0, caught;
    ``add_window`` of the same window again, then ``apply()``."""
    return coupled_run("stats", fail=2)


@probe("coupled", quick=True)
def p_coupled_frozen_encoder_temperature(tmp: str) -> Verdict:
    """``loop.Coupled`` with the encoder frozen and the loss's temperature trained."""
    return coupled_run("coupled", frozen=True)


class Source:
    """A random row mask drawn per micro-batch: Python's ``random`` or an explicit generator."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.gen = torch.Generator().manual_seed(11)
        random.seed(11)

    def mask(self, rows: int) -> torch.Tensor:
        if self.kind == "python":
            return torch.tensor([random.random() > 0.3 for _ in range(rows)], dtype=torch.float64)
        return (torch.rand(rows, generator=self.gen) > 0.3).double()


def random_run(kind: str, source: str, declared: bool) -> Verdict:
    """``loop.Coupled`` / ``loop.WindowStats`` whose forwards draw a row mask from ``source``,
    against plain PyTorch with the same draws (one per micro-batch, in order)."""
    data = [[mb for r in w for mb in r] for w in coupled_data(1)]

    def train(ours: bool) -> tuple[Any, list[float]]:
        src = Source(source)
        model = Tower()
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        gens = [src.gen] if declared and source == "generator" else []
        kw = {"generators": gens} if gens else {}  # (before generators=, none was taken)
        if kind == "coupled":

            def embed(m: nn.Module, mb: Any) -> Any:
                return F.normalize(m.lin(mb) * src.mask(len(mb))[:, None], dim=-1)

            loss: Any = loop.Coupled(embed, c_loss, **kw)
        else:
            keep: list[torch.Tensor] = []

            def stats(m: nn.Module, mb: Any) -> Any:
                return ((mb[:, 0] > 0) * src.mask(len(mb))).sum()

            def s_loss_masked(m: nn.Module, mb: Any, count: Any) -> Any:
                return (m.lin(mb).pow(2).sum(-1) * src.mask(len(mb))).mean() / count

            loss = loop.WindowStats(stats, s_loss_masked, **kw)
        losses = []
        if ours:
            step = loop.Step(model, loss, optimizer=opt)
            for window in data:
                step.add_window(window)
                losses.append(float(step.apply().loss))
            return training_state(model, opt), losses
        for window in data:  # plain PyTorch: one forward per micro-batch, one mask each
            masks = [src.mask(len(mb)) for mb in window]
            if kind == "coupled":
                z = torch.cat(
                    [
                        F.normalize(model.lin(mb) * k[:, None], dim=-1)
                        for mb, k in zip(window, masks)
                    ]
                )
                r = sum(len(mb) for mb in window)
                total = c_loss(model, z, gradaccum.Rows(0, r, r, (r,), 0))
            else:
                keep = [((mb[:, 0] > 0) * k).sum() for mb, k in zip(window, masks)]
                count, rows = sum(keep), sum(len(mb) for mb in window)
                total = sum(
                    (model.lin(mb).pow(2).sum(-1) * k).mean() / count * len(mb) / rows
                    for mb, k in zip(window, masks)
                )
            total.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(float(total.detach()))
        return training_state(model, opt), losses

    got, got_losses = train(True)
    want, want_losses = train(False)
    d = differ(got, want)
    if d is None and _same_tree(got_losses, want_losses, TOL, "") is None:
        return ok()
    return wrong(f"{d or 'parameters equal'}; losses {got_losses} against {want_losses}")


@probe("coupled", quick=True)
def p_coupled_python_random_mask(tmp: str) -> Verdict:
    """``loop.Coupled`` whose ``embed`` draws a row mask from Python's ``random``."""
    return random_run("coupled", "python", False)


@probe("coupled", quick=True)
def p_coupled_declared_generator_mask(tmp: str) -> Verdict:
    """``loop.Coupled`` whose ``embed`` draws from a ``torch.Generator`` in ``generators=``."""
    return random_run("coupled", "generator", True)


@probe("coupled", expect="error", quick=True, words=("generators=",))
def p_coupled_undeclared_generator_mask(tmp: str) -> Verdict:
    """``loop.Coupled`` whose ``embed`` draws from a ``torch.Generator`` not handed in."""
    return random_run("coupled", "generator", False)


@probe("coupled", quick=True)
def p_coupled_stats_python_random_mask(tmp: str) -> Verdict:
    """``loop.WindowStats`` whose stats and loss draw a row mask from Python's ``random``."""
    return random_run("stats", "python", False)


@probe("coupled", quick=True)
def p_coupled_stats_declared_generator_mask(tmp: str) -> Verdict:
    """``loop.WindowStats`` drawing from a ``torch.Generator`` in ``generators=``."""
    return random_run("stats", "generator", True)


@probe("coupled", expect="error", quick=True, words=("complex", "view_as_real"))
def p_coupled_complex_beside_float(tmp: str) -> Verdict:
    """``loop.Coupled`` whose ``embed`` returns a complex leaf beside a float one."""
    model = Tower()

    def embed(m: nn.Module, mb: Any) -> Any:
        z = m.lin(mb)
        return {"f": z, "c": torch.complex(z, z)}

    def loss(m: nn.Module, reps: Any, rows: Any) -> torch.Tensor:
        return reps["f"].sum() + reps["c"].abs().sum()

    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    step = loop.Step(model, loop.Coupled(embed, loss), optimizer=opt)
    return refusal(
        lambda: step.add_window(coupled_data(1)[0][0]),
        lambda: training_state(model, opt),
        "a complex representation",
        after=step.apply,
    )


@probe("coupled", world=2, quick=True)
def p_coupled_2ranks_empty_rank(rank: int, world: int, tmp: str) -> Verdict:
    """2 ranks, ``loop.Coupled``: rank 1 has no micro-batch in the last window."""
    return coupled_run("coupled", rank, world)


@probe("coupled", world=2, quick=True)
def p_coupled_stats_2ranks_empty_rank(rank: int, world: int, tmp: str) -> Verdict:
    """2 ranks, ``loop.WindowStats``: rank 1 has no micro-batch in the last window."""
    return coupled_run("stats", rank, world)


# == windows(): bad arguments =====================================================================


@probe("windows", expect="error", words=("n",))
def p_windows_n_zero(tmp: str) -> Verdict:
    """``windows(data, 0)``."""
    list(loop.windows(list(range(4)), 0))
    return wrong("accepted n=0")


@probe("windows", quick=True, expect="error", words=("factory",))
def p_windows_factory_returns_none(tmp: str) -> Verdict:
    """A factory ``epoch -> iterable`` that returns None (a forgotten ``return``)."""
    if not HAS_FACTORY:
        return na("windows() takes no factory")
    for window in loop.windows(lambda epoch: None, 2):  # type: ignore[arg-type,return-value]
        list(window)
    return wrong("accepted a factory that returned None")


@probe("windows", expect="error", words=("epochs",))
def p_windows_generator_twice(tmp: str) -> Verdict:
    """A generator (one pass) with ``epochs=2``."""
    got = [list(w) for w in loop.windows((i for i in range(4)), 2, epochs=2)]
    return wrong(f"accepted: {got}")


@probe("windows", expect="error", words=("window 0",))
def p_windows_left_part_way(tmp: str) -> Verdict:
    """One micro-batch taken from window 0, then the next window asked for."""
    data = loop.windows(list(range(6)), 3)
    got = []
    for window in data:
        got.append(next(iter(window)))
    return wrong(f"skipped micro-batches silently: {got}")


@probe("windows", expect="error", words=("len(",))
def p_windows_len_lies(tmp: str) -> Verdict:
    """Data whose ``len()`` says 4 while it yields 6 micro-batches."""

    class Liar:
        def __iter__(self) -> Iterator[int]:
            return iter(range(6))

        def __len__(self) -> int:
            return 4

    got = [list(w) for w in loop.windows(Liar(), 2)]
    return wrong(f"accepted: {got}")


# -- the table ------------------------------------------------------------------------------------

QUICK = os.environ.get("LOOP_PROBES_QUICK") == "1"
SCRIPT = os.path.abspath(__file__)


def run_all(names: list[str] | None, quick: bool, verbose: bool) -> list[Result]:
    chosen = [
        p for p in PROBES if (names is None or p.name in names) and (not quick or p.quick or names)
    ]
    results = []
    for p in chosen:
        r = launch(p)
        results.append(r)
        if verbose:
            print(
                f"  {p.name:<44} {r.outcome:<24} {r.seconds:6.1f} s  {r.detail[:400]}",
                file=sys.stderr,
                flush=True,
            )
    return results


def _before(path: str, argv: list[str]) -> dict[str, dict[str, Any]]:
    """Run the probes on the tree at ``path`` (a subprocess with ``PYTHONPATH=path``)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "before.json")
        env = {**os.environ, "PYTHONPATH": path}
        subprocess.run([sys.executable, SCRIPT, *argv, "--json", out], env=env, check=True)
        return {r["name"]: r for r in json.loads(Path(out).read_text())}


def table(rows: list[tuple[str, ...]], header: tuple[str, ...]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    line = lambda cells: "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    return "\n".join(
        [line(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, rows)]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a subset, fewer cuts and exit runs")
    parser.add_argument("--only", nargs="+", metavar="PROBE", help="these probes (any of --list)")
    parser.add_argument("--list", action="store_true", help="list the probes and exit")
    parser.add_argument("--before", metavar="PATH", help="also run on the code at PATH (before)")
    parser.add_argument("--verbose", action="store_true", help="each probe's outcome as it ends")
    parser.add_argument("--json", metavar="FILE", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.list:
        for p in PROBES:
            print(f"{p.name:<44} {p.cls:<11} {'quick' if p.quick else '':<6}{p.doc}")
        return
    unknown = set(args.only or ()) - {p.name for p in PROBES}
    if unknown:
        parser.error(f"no probe named {sorted(unknown)}; see --list")
    before_path = os.path.abspath(args.before) if args.before else None
    os.environ["LOOP_PROBES_QUICK"] = "1" if args.quick else "0"
    # The probes' processes import the gradaccum imported here, whatever their working directory
    # (a forkserver started by ``python -c`` puts its working directory first on sys.path).
    root = str(Path(gradaccum.__file__).resolve().parent.parent)
    os.environ["PYTHONPATH"] = os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])
    os.environ["LOOP_PROBES_GRADACCUM"] = root
    os.chdir(tempfile.gettempdir())
    if before_path:
        os.environ["LOOP_PROBES_BEFORE"] = before_path
    argv = [*(["--quick"] if args.quick else []), *(["--only", *args.only] if args.only else [])]
    argv += ["--verbose"] if args.verbose else []
    before = None
    if before_path:
        before = _before(before_path, argv)
    print(f"probing the gradaccum at {root} ...", file=sys.stderr, flush=True)
    start = time.monotonic()
    results = run_all(args.only, args.quick, args.verbose)
    if args.json:
        Path(args.json).write_text(json.dumps([r.__dict__ for r in results]))
        return
    cls = {p.name: p.cls for p in PROBES}
    header: tuple[str, ...]
    if before is not None:
        header = ("probe", "class", "before", "after")
        rows = [
            (r.name, cls[r.name], before.get(r.name, {}).get("outcome", "-"), r.outcome)
            for r in results
        ]
    else:
        header = ("probe", "class", "outcome")
        rows = [(r.name, cls[r.name], r.outcome) for r in results]
    print(f"gradaccum.loop hostile probes ({len(results)}; {time.monotonic() - start:.0f} s)\n")
    print(table(rows, header))
    print()
    counts = []
    for o in OUTCOMES:
        after_n = sum(r.outcome == o for r in results)
        if before is not None:
            before_n = sum(before.get(r.name, {}).get("outcome") == o for r in results)
            counts.append((o, str(before_n), str(after_n)))
        else:
            counts.append((o, str(after_n)))
    print(
        table(
            counts, ("outcome", "before", "after") if before is not None else ("outcome", "probes")
        )
    )
    problems = [r for r in results if r.outcome not in (EXACT, REFUSED, NA)]
    if problems:
        print(f"\nNot exact and not refused clearly{' (after)' if before is not None else ''}:")
        for r in problems:
            print(f"- {r.name}: {r.outcome}: {r.detail[:600]}")


if __name__ == "__main__":
    main()
