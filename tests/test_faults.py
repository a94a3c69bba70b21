"""The fault suite: on 2 gloo processes (127.0.0.1), a killed peer, an exception on one rank, a
stalled rank, mismatched trees, mismatched ``n`` and mismatched policies, injected at a
micro-step, at the boundary and around a checkpoint save or load, under ``all_reduce`` and
``reduce_scatter`` (both policies), with ``accumulate`` and with the streaming ``Accumulator``.
The promise checked for each (docs/reliability.md):

- every rank that was not killed on purpose reports (no SIGABRT, no hang): it ends in
  ``GradAccumError`` (the rank that raised the injected exception ends in that exception), in
  the window of the fault (no rank gets that window's gradient), with the expected key words;
- within ``T + 5`` seconds of the fault, on a wall clock shared by the ranks (``T``, the sync's
  ``timeout=``, is far below the process group's, so a wait that falls back to the group's
  timeout fails the bound);
- a checkpoint saved before the failure resumes to the same gradient and parameters as the run
  that never failed.

One launch per scenario. The ranks are forked from a forkserver that has imported torch and
gradaccum once, so a launch costs a fraction of a second instead of the seconds of a spawn; a
small launcher (not tests/dist.py) keeps each rank's exit code, to tell the injected SIGKILL
from a SIGABRT, and its stderr, where gloo's and faulthandler's messages land.

Set ``GRADACCUM_FAULTS_LOG=path`` to append one JSON line per scenario (outcome and time to
error of each rank): the table of docs/reliability.md is made from it.
"""

from __future__ import annotations

import datetime
import faulthandler
import json
import os
import pickle
import queue
import signal
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from dist import exited, free_port
from dist import launch as launch_script
from models import max_diff, mean_loss, mlp_params, regression_batch
from torch.func import grad

import gradaccum

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.timeout(120)]

WORLD = 2
T = 2.0  # the sync's timeout= (seconds)
PG_TIMEOUT = 15.0  # the process group's: far above T, so that T is what fires
BOUND = T + 5  # the promise: GradAccumError within this many seconds of the fault
STALL = T + 3  # how long a stalled rank sleeps
LAUNCH_DEADLINE = 45.0  # a launch still running then is a hang: its ranks' stacks are dumped
LINGER = 35.0  # how long a rank that is done waits for the others (see _linger)
FAULTY = 1  # the rank a fault is injected on
N = 4  # micro-batches per window
WINDOWS = 3
SPLIT = (9, 7)  # rows of each window's global batch held by each rank: deliberately unequal
ROWS = sum(SPLIT)
BUCKET_MB = 1e-5  # about 10 bytes: one bucket per leaf, so buckets start during the backward
D_IN = 5

# The faults injected on rank FAULTY at a point of window 1 (window 0 ran clean: the layout is
# verified and the group is warm).
INJECTED = ("killed", "exception", "stalled", "wrong_checkpoint")
# Configurations that differ between the ranks, from window 0 ("window0") or only in window 2
# after both ranks ran window 0 with one layout and window 1 with the other ("later").
MISMATCHED = ("tree_leaf", "tree_shape", "n", "policy")

AR = "accumulate-all_reduce"
SAR = "Accumulator-all_reduce"
RSE = "accumulate-rs_every"
RSB = "accumulate-rs_boundary"
SRSE = "Accumulator-rs_every"
SRSB = "Accumulator-rs_boundary"


@dataclass(frozen=True)
class Case:
    fault: str  # one of INJECTED or MISMATCHED
    point: str  # micro | boundary | checkpoint (INJECTED); window0 | later (MISMATCHED)
    form: str  # AR, SAR, RSE, RSB, SRSE, SRSB

    @property
    def id(self) -> str:
        return f"{self.fault}-{self.point}-{self.form}"

    @property
    def window(self) -> int:
        """The window the fault is in."""
        if self.fault in INJECTED:
            return 1
        return 0 if self.point == "window0" else 2


class InjectedFault(Exception):
    """The exception a rank raises on purpose."""


# -- the launcher ---------------------------------------------------------------------------------


@dataclass
class Launch:
    results: dict[int, Any]  # what each rank that reported returned
    exitcodes: dict[int, int | None]
    hung: list[int]  # ranks still running at the deadline, killed by the launcher
    stderr: dict[int, str]
    seconds: float


_CONTEXT: list[Any] = []


def _context() -> Any:
    """A forkserver context whose server has imported torch, gradaccum and this module."""
    if not _CONTEXT:
        ctx = mp.get_context("forkserver")
        # What every rank imports, once. This module may be imported again by each rank: Python
        # 3.11 hands the forkserver sys.path but does not apply it, so it cannot preload it.
        ctx.set_forkserver_preload(["torch", "torch.distributed", "gradaccum", "pytest", __name__])
        _CONTEXT.append(ctx)
    return _CONTEXT[0]


def _mark(folder: str, name: str) -> None:
    """Write the wall-clock time to ``folder/name`` (atomically)."""
    tmp = os.path.join(folder, f".{name}.{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(repr(time.time()))
    os.replace(tmp, os.path.join(folder, name))


def _read(folder: str, name: str) -> float | None:
    try:
        return float(Path(folder, name).read_text())
    except FileNotFoundError:
        return None


def _linger(folder: str, rank: int) -> None:
    """Wait until every other rank is done or has exited (at most LINGER seconds).

    A rank that exits destroys its end of the group, which a peer still inside a collective sees
    as a closed connection at once: lingering makes each rank's outcome its own (a stalled rank
    that wakes up meets a live peer that gave up, not a closed socket).
    """
    end = time.monotonic() + LINGER
    others = [r for r in range(WORLD) if r != rank]
    while time.monotonic() < end:
        if all(_read(folder, f"done-{r}") or _read(folder, f"exited-{r}") for r in others):
            return
        time.sleep(0.05)


def _child(
    rank: int, port: int, fn: Callable[..., Any], args: tuple[Any, ...], out: Any, folder: str
) -> None:
    fd = os.open(
        os.path.join(folder, f"stderr-{rank}.txt"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644
    )
    os.dup2(fd, 2)  # gloo's C++ messages and faulthandler's dumps too
    os.close(fd)
    faulthandler.enable(file=sys.stderr)  # a SIGABRT or SIGSEGV prints the Python stacks
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)  # a hang, on demand
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=WORLD,
        timeout=datetime.timedelta(seconds=PG_TIMEOUT),
    )
    try:
        payload = pickle.dumps(("ok", fn(rank, *args)))
    except BaseException as err:  # noqa: BLE001 - everything goes back to the parent
        payload = pickle.dumps(("err", type(err).__name__, str(err), traceback.format_exc()))
    out.put((rank, payload))
    out.close()
    out.join_thread()
    try:
        dist.destroy_process_group()
    except Exception as err:  # noqa: BLE001 - a broken group may refuse; say so, go on
        print(f"destroy_process_group raised {type(err).__name__}: {err}", file=sys.stderr)
    sys.stderr.flush()
    os._exit(0)  # no interpreter teardown: a signal seen by the parent happened before this


def launch(fn: Callable[..., Any], *args: Any, folder: str) -> Launch:
    """Run ``fn(rank, *args)`` on WORLD forked ranks of a gloo group; bounded in time."""
    ctx = _context()
    out = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_child, args=(r, port, fn, args, out, folder), daemon=True)
        for r in range(WORLD)
    ]
    start = time.monotonic()
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    exited: set[int] = set()

    def drain(wait: float) -> bool:
        try:
            rank, payload = out.get(timeout=wait)
        except queue.Empty:
            return False
        results[rank] = pickle.loads(payload)
        return True

    while time.monotonic() - start < LAUNCH_DEADLINE:
        for r, p in enumerate(procs):
            if r not in exited and not p.is_alive():
                exited.add(r)
                _mark(folder, f"exited-{r}")  # lets a lingering peer go
        if len(exited) == WORLD:
            break
        drain(0.05)
    while len(results) < WORLD and drain(0.2):
        pass
    hung = []
    for r, p in enumerate(procs):
        if p.is_alive():
            hung.append(r)
            os.kill(p.pid, signal.SIGUSR1)  # its stacks, into its stderr file
            time.sleep(0.5)
            p.kill()
        p.join()
    out.close()
    out.join_thread()
    stderr = {r: _text(Path(folder, f"stderr-{r}.txt")) for r in range(WORLD)}
    exitcodes = {r: p.exitcode for r, p in enumerate(procs)}
    return Launch(results, exitcodes, hung, stderr, time.monotonic() - start)


def _text(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except FileNotFoundError:
        return ""


# -- what the ranks run ---------------------------------------------------------------------------


def _tree(kind: str) -> dict[str, torch.Tensor]:
    """The params: ``A`` (the MLP), ``leaf`` (A plus a leaf), ``shape`` (A with w1 stored
    transposed: other shapes, the same number of elements in every bucket)."""
    params: dict[str, torch.Tensor] = mlp_params(kind="dict")  # type: ignore[assignment]
    if kind == "leaf":
        return {**params, "extra": torch.zeros(3, dtype=torch.float64)}
    if kind == "shape":
        return {**params, "w1": params["w1"].T.contiguous()}
    return params


def _loss(p: Any, batch: Any) -> torch.Tensor:
    w1 = p["w1"] if p["w1"].shape[0] == D_IN else p["w1"].T
    loss = mean_loss({"w1": w1, "b1": p["b1"], "w2": p["w2"], "b2": p["b2"]}, batch)
    return loss + p["extra"].square().sum() if "extra" in p else loss


def _batch(w: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's rows of window ``w``'s global batch."""
    x, y = regression_batch(ROWS, seed=100 + w)
    start = sum(SPLIT[:rank])
    return x[start : start + SPLIT[rank]], y[start : start + SPLIT[rank]]


def _micro_batches(w: int, rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    x, y = _batch(w, rank)
    return list(zip(torch.tensor_split(x, N), torch.tensor_split(y, N), strict=True))


class _Rank:
    """One rank's training loop for a case, with the fault's injection points."""

    def __init__(self, rank: int, case: Case, folder: str) -> None:
        self.rank, self.case, self.folder = rank, case, folder
        self.window, self.micro, self.windows_done = -1, 0, 0
        self.grads: dict[int, Any] = {}  # the gradient of each window (for the resume check)

    # -- injection ------------------------------------------------------------------------------

    def begin(self, w: int) -> None:
        self.window, self.micro = w, 0
        _mark(self.folder, f"start-{self.rank}-{w}")

    def armed(self, point: str) -> bool:
        c = self.case
        return (
            c.fault in INJECTED
            and c.point == point
            and self.rank == FAULTY
            and self.window == c.window
        )

    def inject(self, where: str) -> None:
        _mark(self.folder, "inject")
        fault = self.case.fault
        if fault == "killed":
            os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(60)
        if fault == "exception":
            raise InjectedFault(
                f"injected on rank {self.rank} at the {where} of window {self.window}"
            )
        if fault == "stalled":
            time.sleep(STALL)
            _mark(self.folder, "wake")

    def loss(self, p: Any, batch: Any) -> torch.Tensor:
        i = self.micro
        self.micro += 1
        if self.armed("micro") and i == 1:
            self.inject("micro-step")
        if self.armed("boundary") and i == N - 1 and self.case.form in (AR, RSE, RSB):
            # accumulate: in the last backward, at the first layer, when the last layers'
            # buckets are already being reduced (overlap). Accumulator: before finalize.
            w1 = p["w1"] * 1.0
            w1.register_hook(self._trip)
            p = {**p, "w1": w1}
        return _loss(p, batch)

    def _trip(self, g: torch.Tensor) -> torch.Tensor:
        self.inject("boundary (last backward)")
        return g

    # -- accumulate -----------------------------------------------------------------------------

    def run_accumulate(self) -> None:
        plan = self._accumulate_plan()
        for w in range(WINDOWS):
            self.begin(w)
            step, params = plan(w)
            self.grads[w] = step(params, _batch(w, self.rank))
            self.windows_done += 1

    def _accumulate_plan(self) -> Callable[[int], tuple[Any, Any]]:
        c, rank = self.case, self.rank
        mine = c.window  # from this window on, the ranks differ (mismatches)

        def per_window(same: Any, first: Any, other: Any) -> Callable[[int], Any]:
            """What each window uses: from window ``mine`` on, ``same`` on rank 0 and ``other``
            on rank 1; before it ("later"), both ranks use ``first`` in window 0 and ``other``
            in window 1, so that each layout has run once, and been verified, on both ranks."""

            def pick(w: int) -> Any:
                if w < mine:
                    return first if w == 0 else other
                return same if rank == 0 else other

            return pick

        if c.form == AR:
            sync = gradaccum.all_reduce(timeout=T, bucket_mb=BUCKET_MB)
            step = gradaccum.accumulate(gradaccum.grad(self.loss), N, sync=sync)
            if c.fault in ("tree_leaf", "tree_shape"):
                pick = per_window(_tree("A"), _tree("A"), _tree(c.fault.removeprefix("tree_")))
                return lambda w: (step, pick(w))
            params = _tree("A")
            return lambda w: (step, params)
        policy = "every" if c.form == RSE else "boundary"
        if c.fault == "tree_leaf":  # two Sharded, each verified in its first window
            sp_a = gradaccum.shard(_tree("A"), bucket_mb=BUCKET_MB)
            sp_b = gradaccum.shard(_tree("leaf"), bucket_mb=BUCKET_MB)
            steps = {
                id(sp): gradaccum.accumulate(
                    gradaccum.grad(self.loss),
                    N,
                    sync=gradaccum.reduce_scatter(sp, policy=policy, timeout=T),
                )
                for sp in (sp_a, sp_b)
            }
            pick = per_window(sp_a, sp_a, sp_b)
            return lambda w: (steps[id(pick(w))], pick(w))
        sp = gradaccum.shard(_tree("A"), bucket_mb=BUCKET_MB)
        if c.fault == "policy":  # rank 1 builds its sync with the other policy
            boundary = gradaccum.reduce_scatter(sp, policy="boundary", timeout=T)
            every = gradaccum.reduce_scatter(sp, policy="every", timeout=T)
            pick = per_window(boundary, boundary, every)
            steps = {
                id(s): gradaccum.accumulate(gradaccum.grad(self.loss), N, sync=s)
                for s in (boundary, every)
            }
            return lambda w: (steps[id(pick(w))], sp)
        sync = gradaccum.reduce_scatter(sp, policy=policy, timeout=T)
        if c.fault == "n":  # rank 1 uses another n, with the same sync
            full = gradaccum.accumulate(gradaccum.grad(self.loss), N, sync=sync)
            short = gradaccum.accumulate(gradaccum.grad(self.loss), N - 1, sync=sync)
            pick = per_window(full, full, short)
            return lambda w: (pick(w), sp)
        step = gradaccum.accumulate(gradaccum.grad(self.loss), N, sync=sync)
        return lambda w: (step, sp)

    # -- Accumulator ----------------------------------------------------------------------------

    def setup_stream(self, seed: int = 0) -> None:
        c = self.case
        self.micro_grad = gradaccum.grad(self.loss)
        if c.form == SAR:
            self.params = mlp_params(kind="dict", seed=seed)
            self.sp = None
            sync: Any = gradaccum.all_reduce(timeout=T, bucket_mb=BUCKET_MB)
            self.opt = torch.optim.SGD(list(self.params.values()), lr=0.1, momentum=0.9)
        else:
            self.sp = gradaccum.shard(mlp_params(kind="dict", seed=seed), bucket_mb=BUCKET_MB)
            policy = "every" if c.form == SRSE else "boundary"
            sync = gradaccum.reduce_scatter(self.sp, policy=policy, timeout=T)
            self.opt = torch.optim.SGD(self.sp.shards, lr=0.1, momentum=0.9)
        self.acc = gradaccum.Accumulator(N, sync=sync)
        if c.fault == "wrong_checkpoint":  # what rank 1 loads by mistake: another tree's state
            if self.sp is None:
                other = gradaccum.Accumulator(N)
                state = other.add(
                    other.init(_tree("leaf")), grad(_loss)(_tree("leaf"), _batch(0, 0)), size=1
                )
                self.wrong = other.state_dict(state)
            else:
                self.wrong = gradaccum.shard(_tree("leaf"), bucket_mb=BUCKET_MB).state_dict()

    def _init(self) -> Any:
        return self.acc.init(self.params if self.sp is None else self.sp)

    def _current(self) -> Any:
        """The full params of this window (gathered, when sharded)."""
        return self.params if self.sp is None else self.sp.gather(timeout=T)

    def run_stream(self, resume: dict[str, Any] | None = None) -> None:
        """WINDOWS windows of N micro-batches with add/finalize and an SGD step after each;
        ``resume``: a checkpoint to restore first, and go on from its position."""
        c, acc = self.case, self.acc
        state = self._init()
        first_w, first_i = 0, 0
        if resume is not None:
            state = self.restore(resume)
            first_w, first_i = resume["position"]["window"], resume["position"]["micro"]
        for w in range(first_w, WINDOWS):
            self.begin(w)
            trees = c.fault == "tree_leaf"
            if trees:  # window 0: A, window 1: leaf, window 2: rank 0 A, rank 1 leaf
                kind = "leaf" if w == 1 or (w == 2 and self.rank == 1) else "A"
                params = _tree(kind)
                state = acc.init(params)
            else:
                params = self._current()
            try:
                for i, mb in enumerate(_micro_batches(w, self.rank)):
                    if (w, i) < (first_w, first_i):
                        continue
                    self.micro = i
                    state = acc.add(state, self.micro_grad(params, mb), size=len(mb[0]))
                    if c.point == "checkpoint" and w == c.window and i == 1:
                        state = self.checkpoint(state, w, i + 1)
                if self.armed("boundary"):
                    self.inject("boundary (before finalize)")
                grads, state = acc.finalize(state)
            except gradaccum.GradAccumError:
                raise  # another rank failed, or the group broke: nothing to join
            except Exception:
                acc.abort(state)  # let the other ranks fail now instead of at the timeout
                raise
            self.grads[w] = grads
            self.windows_done += 1
            if not trees:
                self.step(grads)

    def step(self, grads: Any) -> None:
        if self.sp is None:
            for k, p in self.params.items():
                p.grad = grads[k]
        else:
            self.sp.write_grads(grads)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def checkpoint(self, state: Any, w: int, next_micro: int) -> Any:
        """Save this rank's checkpoint mid-window (the injection point "checkpoint")."""
        path = os.path.join(self.folder, f"ckpt-{self.rank}.pt")
        ckpt = {
            "accumulator": self.acc.state_dict(state),
            "optimizer": self.opt.state_dict(),
            "position": {"window": w, "micro": next_micro},  # the data loader's position
        }
        if self.sp is None:
            ckpt["params"] = {k: v.clone() for k, v in self.params.items()}
        else:
            ckpt["sharded"] = self.sp.state_dict()
        if self.armed("checkpoint") and self.case.fault == "exception":
            self.inject("checkpoint save")  # the save fails (disk full, say): nothing written
        torch.save(ckpt, path)
        if self.armed("checkpoint") and self.case.fault in ("killed", "stalled"):
            self.inject("checkpoint save")  # just after the file is written
        if self.case.fault != "wrong_checkpoint":
            return state
        # Every rank restores what it saved, as a resume in place would; rank 1 takes a file
        # written for another tree.
        saved = torch.load(path, weights_only=True)
        try:
            if self.rank == FAULTY:
                _mark(self.folder, "inject")
                if self.sp is None:
                    saved = {**saved, "accumulator": self.wrong}
                else:
                    saved = {**saved, "sharded": self.wrong}
            return self.restore(saved)
        except gradaccum.GradAccumError:
            # This rank cannot go on with the window: join its boundary, flagged, so that the
            # other ranks fail now (their finalize) rather than at the timeout.
            self.acc.abort(state)
            raise

    def restore(self, ckpt: dict[str, Any]) -> Any:
        if self.sp is None:
            with torch.no_grad():
                for k, p in self.params.items():
                    p.copy_(ckpt["params"][k])
        else:
            self.sp.load_state_dict(ckpt["sharded"])
        self.opt.load_state_dict(ckpt["optimizer"])
        return self.acc.load_state_dict(self._init(), ckpt["accumulator"])

    def run_stream_n(self) -> None:
        """Rank 1's Accumulator has another n; both feed the same micro-batches and finalize
        when the window is complete, as a loop over a data loader does."""
        self.micro_grad = gradaccum.grad(_loss)
        acc = gradaccum.Accumulator(
            N if self.rank == 0 else N - 1,
            sync=gradaccum.all_reduce(timeout=T, bucket_mb=BUCKET_MB),
        )
        params = _tree("A")
        state = acc.init(params)
        self.begin(0)
        stream = [mb for w in range(WINDOWS) for mb in _micro_batches(w, self.rank)]
        for mb in stream:
            state = acc.add(state, self.micro_grad(params, mb), size=len(mb[0]))
            if acc.is_complete(state):
                _, state = acc.finalize(state)
                self.windows_done += 1
        if state.micro_step:
            acc.finalize(state)
            self.windows_done += 1


def _fault_worker(rank: int, case: Case, folder: str) -> dict[str, Any]:
    """Run the case on this rank; report how it ended, when, and after how many windows."""
    me = _Rank(rank, case, folder)
    out: dict[str, Any] = {}
    try:
        if case.form in (AR, RSE, RSB):
            me.run_accumulate()
        elif case.fault == "n":
            me.run_stream_n()
        else:
            me.setup_stream()
            me.run_stream()
        out["outcome"] = "returned"
    except BaseException as err:  # noqa: BLE001 - reported, with its time
        out.update(
            outcome=type(err).__name__,
            message=str(err),
            traceback=traceback.format_exc(),
        )
    out["at"] = time.time()
    out["window"] = me.window
    out["windows_done"] = me.windows_done
    _mark(folder, f"done-{rank}")
    _linger(folder, rank)
    return out


def _resume_worker(rank: int, form: str, folder: str) -> dict[str, Any]:
    """The run that never failed, then a run resumed from the checkpoint that the failed run
    saved before its fault (from other initial params, which the checkpoint overwrites)."""
    clean = _Rank(rank, Case("none", "none", form), folder)
    clean.setup_stream(seed=0)
    clean.run_stream()
    ckpt = torch.load(os.path.join(folder, f"ckpt-{rank}.pt"), weights_only=True)
    resumed = _Rank(rank, Case("none", "none", form), folder)
    resumed.setup_stream(seed=5)
    resumed.run_stream(resume=ckpt)
    out: dict[str, Any] = {"position": ckpt["position"]}
    w = ckpt["position"]["window"]
    out["same window gradient"] = _equal(clean.grads[w], resumed.grads[w])
    out["same later gradients"] = all(
        _equal(clean.grads[k], resumed.grads[k]) for k in range(w + 1, WINDOWS)
    )
    final = [clean.params, resumed.params] if form == SAR else [clean.sp.shards, resumed.sp.shards]  # type: ignore[union-attr]
    out["same final params"] = _equal(*final)
    if form == SAR:  # against one process on the window's global batch, at the saved params
        x, y = regression_batch(ROWS, seed=100 + w)
        ref = grad(_loss)(ckpt["params"], (x, y))
        out["window gradient vs one process"] = max_diff(resumed.grads[w], ref)
    return out


def _equal(a: Any, b: Any) -> bool:
    import optree

    la, sa = optree.tree_flatten(a)
    lb, sb = optree.tree_flatten(b)
    return sa == sb and all(torch.equal(x, y) for x, y in zip(la, lb, strict=True))


# -- the scenarios --------------------------------------------------------------------------------

INJECTED_CASES = [
    # A killed peer (SIGKILL): no flag, no goodbye; the survivor's collective fails.
    Case("killed", "micro", AR),
    Case("killed", "micro", RSE),
    Case("killed", "micro", RSB),
    Case("killed", "boundary", AR),
    Case("killed", "boundary", SAR),
    Case("killed", "boundary", RSB),
    Case("killed", "boundary", SRSE),
    Case("killed", "checkpoint", SAR),
    Case("killed", "checkpoint", SRSB),
    # An exception on one rank: it joins the boundary flagged, the others raise at once.
    Case("exception", "micro", AR),
    Case("exception", "micro", SAR),
    Case("exception", "micro", RSE),
    Case("exception", "micro", RSB),
    Case("exception", "boundary", AR),
    Case("exception", "boundary", SAR),
    Case("exception", "boundary", RSE),
    Case("exception", "boundary", SRSB),
    Case("exception", "checkpoint", SAR),
    Case("exception", "checkpoint", SRSE),
    Case("wrong_checkpoint", "checkpoint", SAR),
    Case("wrong_checkpoint", "checkpoint", SRSB),
    # A stalled rank: asleep for T + 3 s, then it goes on.
    Case("stalled", "micro", AR),
    Case("stalled", "micro", RSE),
    Case("stalled", "micro", RSB),
    Case("stalled", "boundary", AR),
    Case("stalled", "boundary", SAR),
    Case("stalled", "boundary", RSB),
    Case("stalled", "checkpoint", SAR),
    Case("stalled", "checkpoint", SRSE),
]

MISMATCHED_CASES = [
    Case("tree_leaf", "window0", AR),
    Case("tree_shape", "window0", AR),
    Case("tree_leaf", "later", AR),
    Case("tree_shape", "later", AR),
    Case("tree_leaf", "later", SAR),
    Case("tree_leaf", "later", RSB),
    Case("n", "window0", RSE),
    Case("n", "later", RSE),
    Case("n", "window0", SAR),
    Case("policy", "window0", RSB),
    Case("policy", "later", RSB),
]

# Key words of the message each rank must raise, by fault and role.
PEER_GONE = ("A peer process died", "restart from a checkpoint")
OTHER_FAILED = ("other rank(s) of the 2 in the group raised an error during this window",)
KEY_WORDS: dict[str, dict[str, tuple[str, ...]]] = {
    "killed": {"survivor": ("failed on rank 0", *PEER_GONE)},
    "exception": {"survivor": OTHER_FAILED, "faulty": ("injected on rank 1",)},
    "wrong_checkpoint": {"survivor": OTHER_FAILED, "faulty": ("load_state_dict",)},
    "stalled": {"survivor": ("failed on rank 0", *PEER_GONE), "faulty": PEER_GONE},
    "tree_leaf": {"both": ("the ranks disagree", "['extra']")},
    "tree_shape": {"both": ("the ranks disagree", "['w1']")},
    "n": {"both": ("the ranks disagree", "n=")},
    "policy": {"both": ("the ranks disagree", "policy")},
}


@pytest.fixture(scope="module")
def faults_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("faults")


_LAUNCHES: dict[Case, tuple[Launch, str]] = {}


def _run_case(case: Case, root: Path) -> tuple[Launch, str]:
    """Launch a case once per session (the resume test reuses the checkpoint scenario's)."""
    if case not in _LAUNCHES:
        folder = root / case.id
        folder.mkdir()
        _LAUNCHES[case] = (
            launch(_fault_worker, case, str(folder), folder=str(folder)),
            str(folder),
        )
    return _LAUNCHES[case]


def _verdicts(case: Case, run: Launch, folder: str) -> tuple[dict[int, dict[str, Any]], list[str]]:
    """Each rank's outcome and time to error, and what breaks the promise."""
    problems: list[str] = []
    ranks: dict[int, dict[str, Any]] = {}
    marks = [_read(folder, f"start-{r}-{case.window}") for r in range(WORLD)]
    for r in range(WORLD):
        code = run.exitcodes[r]
        v: dict[str, Any] = {"exit": code}
        ranks[r] = v
        tail = "\n".join(run.stderr[r].splitlines()[-40:])
        if case.fault == "killed" and r == FAULTY:
            v["outcome"] = "killed (injected)"
            if r in run.results or code != -signal.SIGKILL:
                problems.append(f"rank {r} was to be killed, got exit {code}: {run.results.get(r)}")
            continue
        if r in run.hung:
            v["outcome"] = "hung"
            problems.append(
                f"rank {r} HUNG: still running {LAUNCH_DEADLINE:g} s after the launch (killed); "
                f"its stacks and stderr:\n{tail}"
            )
            continue
        if r not in run.results:
            name = signal.Signals(-code).name if code is not None and code < 0 else code
            v["outcome"] = f"died ({name})"
            problems.append(
                f"rank {r} died without reporting: exit {code} ({name}); stderr:\n{tail}"
            )
            continue
        result = run.results[r]
        if result[0] != "ok":  # the worker itself broke (a bug of this file)
            v["outcome"] = f"harness {result[1]}"
            problems.append(f"rank {r}: worker error {result[1]}: {result[2]}\n{result[3]}")
            continue
        got = result[1]
        if code != 0:
            name = signal.Signals(-code).name if code is not None and code < 0 else code
            problems.append(
                f"rank {r} reported but then exited with {code} ({name}) in "
                f"destroy_process_group; stderr:\n{tail}"
            )
        v.update(outcome=got["outcome"], window=got["window"], windows_done=got["windows_done"])
        v["message"] = got.get("message", "")
        role = _role(case, r)
        expected = (
            "InjectedFault"
            if (case.fault == "exception" and role == "faulty")
            else "GradAccumError"
        )
        if got["outcome"] != expected:
            what = (
                f"returned normally after {got['windows_done']} windows"
                if got["outcome"] == "returned"
                else f"raised {got['outcome']} in window {got['window']}: {got.get('message')}"
            )
            problems.append(f"rank {r} ({role}) should raise {expected} but {what}")
        else:
            words = KEY_WORDS[case.fault].get(role) or KEY_WORDS[case.fault].get("both", ())
            missing = [k for k in words if k not in got["message"]]
            if missing:
                problems.append(f"rank {r}: message lacks {missing}: {got['message']}")
            if got["window"] != case.window:  # no rank gets a gradient for the failed window
                problems.append(
                    f"rank {r} raised in window {got['window']}, not in window {case.window} "
                    f"where the fault is (it returned that window's gradient): {got['message']}"
                )
        # Time to error, from the fault on a clock the ranks share.
        if case.fault in MISMATCHED:
            ref, since = (max(marks) if None not in marks else None), "the window start"
        elif case.fault == "stalled" and r == FAULTY:
            ref, since = _read(folder, "wake"), "its wake-up"
        else:
            ref, since = _read(folder, "inject"), "the injection"
        if ref is None:
            problems.append(f"rank {r}: no time reference ({since} never happened)")
            continue
        v["seconds"] = round(got["at"] - ref, 2)
        v["since"] = since
        if v["seconds"] < -0.05:
            problems.append(
                f"rank {r} raised {v['seconds']} s BEFORE {since} (not the fault's doing: a rank "
                f"late by more than T = {T:g} s?): {got.get('message')}"
            )
        if got["outcome"] != "returned" and v["seconds"] > BOUND:
            problems.append(
                f"rank {r} took {v['seconds']} s from {since} to {got['outcome']} (bound: "
                f"T + 5 = {BOUND:g} s; the group's timeout is {PG_TIMEOUT:g} s): "
                f"{got.get('message')}"
            )
    return ranks, problems


def _role(case: Case, rank: int) -> str:
    if case.fault in MISMATCHED:
        return "both"
    return "faulty" if rank == FAULTY else "survivor"


def _log(case: Case, run: Launch, ranks: dict[int, Any], problems: list[str]) -> None:
    path = os.environ.get("GRADACCUM_FAULTS_LOG")
    if not path:
        return
    line = {
        "case": case.id,
        "passed": not problems,
        "launch_seconds": round(run.seconds, 2),
        "ranks": {
            r: {k: v for k, v in d.items() if k != "message"}
            | {"message": d.get("message", "")[:400]}
            for r, d in ranks.items()
        },
        "problems": [p[:3000] for p in problems],
    }
    with open(path, "a") as f:
        f.write(json.dumps(line) + "\n")


def _check(case: Case, root: Path) -> None:
    run, folder = _run_case(case, root)
    ranks, problems = _verdicts(case, run, folder)
    _log(case, run, ranks, problems)
    summary = "; ".join(
        f"rank {r}: {d['outcome']}" + (f" after {d['seconds']} s" if "seconds" in d else "")
        for r, d in ranks.items()
    )
    assert not problems, f"{case.id}: {summary}\n" + "\n".join(problems)


@pytest.mark.parametrize("case", INJECTED_CASES, ids=lambda c: c.id)
def test_a_fault_on_one_rank_ends_in_an_error_on_every_rank(case: Case, faults_dir: Path) -> None:
    _check(case, faults_dir)


@pytest.mark.parametrize("case", MISMATCHED_CASES, ids=lambda c: c.id)
def test_ranks_that_disagree_raise_on_every_rank(case: Case, faults_dir: Path) -> None:
    _check(case, faults_dir)


@pytest.mark.parametrize("form", [SAR, SRSB])
def test_a_checkpoint_saved_before_a_crash_resumes_as_if_nothing_happened(
    form: str, faults_dir: Path
) -> None:
    """What is never lost: the checkpoint rank 1 wrote just before it was killed (and rank 0's,
    of the same micro-step) resumes, on a new group, to the gradient and parameters of the run
    that never failed, bit for bit."""
    crash, folder = _run_case(Case("killed", "checkpoint", form), faults_dir)
    assert all(Path(folder, f"ckpt-{r}.pt").exists() for r in range(WORLD)), crash
    again = Path(folder, "resume")
    again.mkdir()
    resumed = launch(_resume_worker, form, folder, folder=str(again))
    missing = [r for r in range(WORLD) if r not in resumed.results]
    assert not missing, f"ranks {missing} did not report: {resumed.exitcodes} {resumed.stderr}"
    for r in range(WORLD):
        status, *rest = resumed.results[r]
        assert status == "ok", f"rank {r} raised:\n{rest[2]}"
        out = rest[0]
        assert out["position"] == {"window": 1, "micro": 2}, out
        assert out["same window gradient"] is True, out
        assert out["same later gradients"] is True, out
        assert out["same final params"] is True, out
        if form == SAR:
            assert out["window gradient vs one process"] < 1e-12, out


# -- a normal exit after a fault ------------------------------------------------------------------

EXIT_SCRIPT = Path(__file__).with_name("exit_after_fault.py")
EXIT_T, EXIT_STALL = 1.0, 3.0  # the script's sync timeout, and how long its rank 1 sleeps
EXIT_DEADLINE = 120.0  # one launch (two fresh interpreters importing torch on a loaded machine)
EXIT_RUNS = {"loop": 5, "accumulate": 2}


def _exit_launch(form: str) -> list[tuple[int | None, str, str]]:
    """Run ``exit_after_fault.py form`` as 2 ranks, as torchrun would; each rank's
    ``(exit code, stdout, stderr)``. Bounded: what still runs at the deadline is killed."""
    env = {"T": str(EXIT_T), "STALL": str(EXIT_STALL)}
    return launch_script(str(EXIT_SCRIPT), form, env=env, deadline=EXIT_DEADLINE)


def _exit_problems(form: str, ranks: list[tuple[int | None, str, str]]) -> list[str]:
    problems, lines = exited(ranks)
    for r, line in enumerate(lines):
        if line is None:
            continue
        fields = dict(f.split("=", 1) for f in line.split(" ", 4)[1:])
        if fields["outcome"] != "GradAccumError" or fields["window"] != "1":
            problems.append(f"rank {r} should raise GradAccumError in window 1: {line}")
        elif f"failed on rank {r}" not in fields["message"]:
            problems.append(f"rank {r}: the error names no failed collective: {line}")
    return problems


@pytest.mark.timeout(EXIT_DEADLINE * 5 + 60)
@pytest.mark.parametrize("form", ["loop", "accumulate"])
def test_a_script_that_catches_the_error_exits_normally(form: str) -> None:
    """After a timed-out collective, a user script that catches ``GradAccumError``, destroys the
    group and returns exits with code 0 through a normal interpreter exit, on both ranks: the
    stalled rank too, which wakes to find its peer gone and raises. Every run, not most: before
    the failed collective's group was drained, the ``loop`` form aborted (SIGABRT, "terminate
    called without an active exception") in 8 of 10 runs."""
    for run in range(EXIT_RUNS[form]):
        problems = _exit_problems(form, _exit_launch(form))
        assert not problems, f"run {run + 1} of {EXIT_RUNS[form]}:\n" + "\n".join(problems)


class _Abandoned:
    """A collective whose wait timed out but which still runs in the backend for ``left`` s (as
    gloo's does until its own timeout), then fails; it records when it ended."""

    def __init__(self, left: float, log: list[str], name: str) -> None:
        self.end, self.log, self.name = time.monotonic() + left, log, name

    def is_completed(self) -> bool:
        return time.monotonic() >= self.end

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        if timeout is not None and time.monotonic() + timeout.total_seconds() < self.end:
            time.sleep(timeout.total_seconds())
            raise RuntimeError("Operation timed out!")
        time.sleep(max(0.0, self.end - time.monotonic()))
        self.log.append(f"{self.name} ended")
        raise RuntimeError("Timed out waiting 100ms for recv operation to complete")


@pytest.mark.parametrize("torch_has_abort", [True, False], ids=["torch", "torch<2.7"])
def test_no_collective_outlives_the_error(
    world_of_one: None, monkeypatch: pytest.MonkeyPatch, torch_has_abort: bool
) -> None:
    """In one process, with collectives that stand in for gloo's: when a wait times out, every
    collective started on the group (the one waited for and the others in flight) has ended
    before ``GradAccumError`` is raised, none is left in flight, and gradaccum still holds them
    (their last reference must not be a gloo worker thread's). The drain uses no
    ``abort()`` or ``shutdown()`` of the group (they do nothing on gloo), so it is the same on the
    torch versions that lack them (2.4 to 2.6): simulated by deleting them."""
    from gradaccum._dist import inflight

    if not torch_has_abort:
        for cls in (dist.ProcessGroup, torch._C._distributed_c10d.Backend):
            for name in ("abort", "shutdown"):
                monkeypatch.delattr(cls, name)
    log: list[str] = []
    comm = gradaccum.sync.Comm("my_sync", None, timeout=0.05)
    cpu = torch.zeros(1)
    bucket1 = comm.started(_Abandoned(0.3, log, "bucket 1"), cpu)
    bucket2 = comm.started(_Abandoned(0.4, log, "bucket 2"), cpu)
    assert inflight.in_flight(comm.group) == [bucket1, bucket2]
    with pytest.raises(gradaccum.GradAccumError) as info:
        comm.wait(bucket1, "bucket 1")
    log.append("raised")
    assert log == ["bucket 1 ended", "bucket 2 ended", "raised"]
    assert inflight.in_flight(comm.group) == []
    # Still referenced until the group goes: the last reference is never a gloo worker's.
    assert inflight._ABANDONED[comm.group] == [bucket1, bucket2]
    assert str(info.value) == (
        "my_sync: bucket 1 failed on rank 0: Operation timed out!. A peer process died, failed "
        "before the boundary, or did not reach it in time (timeout: 0.05 s); every rank must "
        "call the accumulated function the same number of times. The process group cannot be "
        "reused: destroy it and restart from a checkpoint."
    )


# == the loop: faults inside gradaccum.loop (issue 26) ===========================================
# Added after the sections above, which it does not change. On 2 gloo ranks (the launcher above,
# with its lingering, its time marks and its exit codes), a job written as docs/loop.md writes it
# (``windows`` and ``Step`` under ``all_reduce(timeout=T)``, ``loop.save`` / ``loop.load``) meets
# one fault on rank FAULTY in window 1:
#
# - ``data``: its loader raises while reading a micro-batch inside the window;
# - ``loss``: its loss function raises on a micro-batch of the window;
# - ``save``: it alone calls ``loop.save`` in the window (a save the other rank does not reach);
# - ``load``: its file of a checkpoint that both ranks saved is cut short, and both load it;
# - ``stalled``: its loader sleeps STALL seconds (past T) inside the window.
#
# Every rank must end in an error (the faulty one in its own where it raised one), within
# T + 5 s of the fault on a clock the ranks share (the process group's timeout is PG_TIMEOUT, so a
# wait that falls back on it fails the bound), in window 1, with nothing of the window applied:
# the parameters and the optimizer state are those of the window's start (for ``load``: those of
# before the load, with the data position).

from gradaccum import loop  # noqa: E402 - this section's own import

LOOP_FAULTS = ("data", "loss", "tuple", "save", "load", "stalled")
LOOP_KEY_WORDS: dict[str, dict[str, tuple[str, ...]]] = {
    "data": {"survivor": ("Step.apply()", *OTHER_FAILED), "faulty": ("injected on rank 1",)},
    "loss": {"survivor": ("Step.apply()", *OTHER_FAILED), "faulty": ("injected on rank 1",)},
    # Issue 35: rank 1's loss returns a plain (loss, count) tuple, refused on that rank alone.
    "tuple": {
        "survivor": ("Step.apply()", *OTHER_FAILED),
        "faulty": ("Step.add(batch)", "2-tuple (tensor, tensor)", "gradaccum.Mean(loss, n)"),
    },
    "save": {
        "both": ("Step.apply()", "called gradaccum.loop.save a different number of times"),
    },
    "load": {
        "survivor": ("gradaccum.loop.load(", "rank 1 refused the checkpoint"),
        "faulty": ("gradaccum.loop.load(", "cannot be read by torch.load"),
    },
    "stalled": {"survivor": ("Step.apply()", "failed on rank 0", *PEER_GONE), "faulty": PEER_GONE},
}


class _LoopLoader:
    """This rank's micro-batches of the WINDOWS windows (a ``len()``); on rank FAULTY, reading
    the 2nd micro-batch of window 1 raises (``data``) or sleeps STALL seconds (``stalled``)."""

    def __init__(self, rank: int, fault: str, folder: str) -> None:
        self.rank, self.fault, self.folder = rank, fault, folder
        self.items = [mb for w in range(WINDOWS) for mb in _micro_batches(w, rank)]

    def __len__(self) -> int:
        return len(self.items)

    def __iter__(self):  # type: ignore[no-untyped-def]
        for i, batch in enumerate(self.items):
            if self.rank == FAULTY and i == N + 1 and self.fault in ("data", "stalled"):
                _mark(self.folder, "inject")
                if self.fault == "data":
                    raise InjectedFault(f"injected on rank {self.rank}: reading micro-batch {i}")
                time.sleep(STALL)
                _mark(self.folder, "wake")
            yield batch


def _loop_mse(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return torch.nn.functional.mse_loss(model(x).squeeze(-1), y)


class _LoopJob:
    """One rank's model, AdamW, windows and Step; what it holds at a window's start."""

    def __init__(self, rank: int, fault: str, folder: str) -> None:
        self.rank, self.fault, self.folder = rank, fault, folder
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(
            torch.nn.Linear(D_IN, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)
        ).double()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=0.05, weight_decay=0.1)
        sync = gradaccum.all_reduce(timeout=T)
        self.data = loop.windows(_LoopLoader(rank, fault, folder), N, sync=sync)
        self.step = loop.Step(self.model, self.loss, self.opt, data=self.data)
        self.calls = 0
        self.window = -1

    def loss(self, model: torch.nn.Module, batch: Any) -> torch.Tensor:
        self.calls += 1
        if self.fault == "loss" and self.rank == FAULTY and self.calls == N + 2:
            _mark(self.folder, "inject")
            raise InjectedFault(f"injected on rank {self.rank}: the loss of micro-batch {N + 1}")
        if self.fault == "tuple" and self.rank == FAULTY and self.calls == N + 2:
            _mark(self.folder, "inject")
            return _loop_mse(model, batch), batch[1].new_tensor(len(batch[1]))  # says neither
        return _loop_mse(model, batch)

    def held(self) -> Any:
        """The parameters and the optimizer state, copied."""
        params = {k: p.detach().clone() for k, p in self.model.named_parameters()}
        state = {(id(p), k): v.clone() for p, s in self.opt.state.items() for k, v in s.items()}
        return params, state

    def run(self, path: str | None = None, save_at: int | None = None) -> None:
        """The loop of docs/loop.md; ``self.start``: what the model held when the window began.

        With ``save_at``: save there (the rank-independent idiom) and stop.
        """
        for window in self.data:
            self.window, self.start = window.index, self.held()
            _mark(self.folder, f"start-{self.rank}-{window.index}")
            for batch in window:
                self.step.add(batch)
                if self.fault == "save" and self.rank == FAULTY and window.index == 1:
                    if self.step.micro_step == 1:  # a save that only this rank reaches
                        _mark(self.folder, "inject")
                        loop.save(os.path.join(self.folder, "saved-alone"), self.step)
            if window.index == save_at:
                assert path is not None
                loop.save(path, self.step)
                return
            self.step.apply()


def _same_held(a: Any, b: Any) -> bool:
    (pa, sa), (pb, sb) = a, b
    return (
        pa.keys() == pb.keys()
        and all(torch.equal(pa[k], pb[k]) for k in pa)
        and sa.keys() == sb.keys()
        and all(torch.equal(sa[k], sb[k]) for k in sa)
    )


def _same_position(a: Any, b: Any) -> bool:
    """Two data positions (``Windows.state_dict()``) are the same, tensors bit for bit."""
    import optree

    la, sa = optree.tree_flatten(a, none_is_leaf=True)
    lb, sb = optree.tree_flatten(b, none_is_leaf=True)
    return sa == sb and all(
        torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y
        for x, y in zip(la, lb, strict=True)
    )


def _loop_fault_worker(rank: int, fault: str, folder: str) -> dict[str, Any]:
    """Run the fault's job on this rank; how it ended, when, in which window, what it changed."""
    out: dict[str, Any] = {}
    job = _LoopJob(rank, fault, folder)
    try:
        if fault == "load":
            path = os.path.join(folder, "ckpt")
            job.run(path, save_at=1)  # both ranks save window 1's running sums
            dist.barrier()
            if rank == FAULTY:
                file = Path(path, f"rank{rank}.pt")
                file.write_bytes(file.read_bytes()[:200])  # a copy that did not finish
            dist.barrier()
            job = _LoopJob(rank, fault, folder)  # the resumed run, before its load
            job.window, job.start = 1, job.held()
            position = job.data.state_dict()
            if rank == FAULTY:
                _mark(folder, "inject")
            loop.load(path, job.step)
        else:
            job.run()
        out["outcome"] = "returned"
    except BaseException as err:  # noqa: BLE001 - reported, with its time
        out.update(outcome=type(err).__name__, message=str(err), traceback=traceback.format_exc())
    out["at"] = time.time()
    out["window"] = job.window
    out["unchanged"] = _same_held(job.held(), job.start)
    if fault == "load":
        out["unchanged"] = out["unchanged"] and _same_position(job.data.state_dict(), position)
    _mark(folder, f"done-{rank}")
    _linger(folder, rank)
    return out


def _loop_problems(fault: str, run: Launch, folder: str) -> list[str]:
    problems: list[str] = []
    for r in range(WORLD):
        role = "faulty" if r == FAULTY else "survivor"
        tail = "\n".join(run.stderr[r].splitlines()[-30:])
        if r in run.hung:
            problems.append(f"rank {r} ({role}) HUNG past {LAUNCH_DEADLINE:g} s:\n{tail}")
            continue
        if r not in run.results:
            problems.append(f"rank {r} ({role}) died: exit {run.exitcodes[r]}\n{tail}")
            continue
        status, *rest = run.results[r]
        if status != "ok":
            problems.append(f"rank {r}: worker error {rest[0]}: {rest[1]}\n{rest[2]}")
            continue
        got = rest[0]
        injected = fault in ("data", "loss") and role == "faulty"
        expected = "InjectedFault" if injected else "GradAccumError"
        if fault == "tuple" and role == "faulty":
            expected = "TypeError"
        if got["outcome"] != expected:
            problems.append(
                f"rank {r} ({role}) should raise {expected}, got {got['outcome']}: "
                f"{got.get('message')}"
            )
            continue
        words = LOOP_KEY_WORDS[fault].get(role) or LOOP_KEY_WORDS[fault]["both"]
        missing = [w for w in words if w not in got["message"]]
        if missing:
            problems.append(f"rank {r}: the message lacks {missing}: {got['message']}")
        if got["window"] != 1:
            problems.append(f"rank {r} raised in window {got['window']}, not 1: {got['message']}")
        if not got["unchanged"]:
            problems.append(
                f"rank {r} ({role}) raised, but the failed window (or load) changed its "
                f"parameters, optimizer state or data position: {got['message']}"
            )
        since = "wake" if fault == "stalled" and role == "faulty" else "inject"
        ref = _read(folder, since)
        if ref is None:
            problems.append(f"rank {r}: no {since} mark (the fault never happened)")
            continue
        seconds = got["at"] - ref
        if seconds > BOUND:
            problems.append(
                f"rank {r} ({role}) took {seconds:.2f} s from the {since} to its error (bound "
                f"T + 5 = {BOUND:g} s; the group's timeout is {PG_TIMEOUT:g} s)"
            )
    return problems


@pytest.mark.parametrize("fault", LOOP_FAULTS)
def test_a_fault_in_the_loop_ends_in_an_error_on_every_rank(fault: str, faults_dir: Path) -> None:
    """A loop job (``windows`` + ``Step``) whose rank 1 fails in window 1 (its data, its loss, a
    loss that returns a plain tuple (refused on that rank alone), a save it alone makes, a load
    of its damaged file, a stall past the timeout): every rank
    raises within T + 5 s, and no rank applied any of the window (or of the load)."""
    folder = faults_dir / f"loop-{fault}"
    folder.mkdir()
    run = launch(_loop_fault_worker, fault, str(folder), folder=str(folder))
    problems = _loop_problems(fault, run, str(folder))
    summary = "; ".join(
        f"rank {r}: {run.results[r][1]['outcome'] if run.results.get(r, ('',))[0] == 'ok' else '?'}"
        for r in range(WORLD)
    )
    assert not problems, f"loop-{fault}: {summary}\n" + "\n".join(problems)
