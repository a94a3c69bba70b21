"""The device check of issue 28: the ``gpu`` suite and the measurements, in one call.

    python benchmarks/gpu_check.py              # CUDA + NCCL (world size 1); < 4 min on an H100
    python benchmarks/gpu_check.py --cpu        # CPU + gloo, a tiny model: a smoke test
    python benchmarks/gpu_check.py --out r.json # also write r.json and r.log ($OUT/gpu_check.json
                                                # by default when $OUT is set)

Without CUDA it runs as ``--cpu``. Sections, each guarded (a failing one prints ``FAIL`` and the
script goes on):

1. ``suite``: ``pytest -m gpu tests/test_gpu.py tests/test_gpu_boundary.py`` in a subprocess, its
   summary.
2. ``syncs``: host syncs per window, counted by ``torch.cuda.set_sync_debug_mode("warn")``
   (CUDA), and host reads located by wrapping ``Tensor.item``/``tolist``/``__bool__``/
   ``__float__``/``__int__``/``cpu``/``numpy`` and ``torch.tensor``/``as_tensor(device=...)``
   (on both devices; on CPU this proxy is all there is). Each is marked ``bwd`` when it ran inside
   a backward (an autograd engine frame on the stack, or the engine's device thread). For the
   all-reduce fast path, reduce-scatter (both policies), each with and without ``timeout=``,
   ``Accumulator.add``/``finalize`` and ``loop.Step``; and the host time of a mid-window
   ``Accumulator.add`` queued behind a 200 ms kernel (a blocking wait shows as ~200 ms).
3. ``lm``: a GPT-2-small-sized causal LM (12 layers, d=768, 12 heads, vocab 50257; micro-batch
   8 x 512 tokens), fp32 params under ``torch.autocast(bfloat16)``, AdamW (fused), n = 1, 4, 16:
   the hand-written ``(loss / n).backward()`` loop, DDP (NCCL, world size 1) with ``no_sync``
   but on the last micro-batch, and ``accumulate(grad_and_value(loss), n, has_aux=True,
   sync=all_reduce())`` + ``write_grads``; as controls, the hand loop with one host read of the
   window's loss before the optimizer step (``hand+read``: what one host sync per window costs
   any loop), and gradaccum with ``sync=None`` (no collective, no host read) and with
   ``all_reduce(overlap=False)`` (no hook in the last backward); and ``loop.Step`` over
   ``all_reduce()`` (``add`` per micro-batch, ``apply``); and the deferred boundary
   (``all_reduce(defer=True)``, issue 36) under ``accumulate`` and ``loop.Step``, the fused
   AdamW guarded (``gradaccum-defer``, ``loop.Step-defer``); all interleaved round-robin,
   median ms/step; the peak memory of each step; the compute floor (n x one micro-batch's
   forward and backward).
4. ``timeout``: children with ``timeout=1`` and a simulated stuck peer (every pooled stream,
   NCCL's included, kept busy): when does ``GradAccumError`` come, does the process survive
   NCCL's watchdog and exit, its exit code; a busy compute stream (late, not stuck); the
   group's timeout shorter than the sync's; torch's own ``abort()`` against none.

Public API only (``gradaccum.*``, ``gradaccum.sync.*``, ``gradaccum.loop.*``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
import traceback
import warnings
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

import gradaccum

ROOT = Path(__file__).resolve().parents[1]


class Config:
    """The device, the backend and the sizes, set once in ``main`` (or a child)."""

    cuda = False
    device = torch.device("cpu")
    backend = "gloo"
    cycles_per_ms = 1.9e6  # torch.cuda._sleep's clock, calibrated at start
    profile = False  # --profile: cProfile the LM contenders' host time


C = Config()
LOG: list[str] = []


def say(*lines: str) -> None:
    for line in lines:
        print(line, flush=True)
        LOG.append(line)


def sync_device() -> None:
    if C.cuda:
        torch.cuda.synchronize()


def sleep_ms(ms: float) -> None:
    """Keep the current stream busy for about ``ms`` (a no-op on CPU)."""
    if C.cuda:
        torch.cuda._sleep(int(ms * C.cycles_per_ms))


def init_group() -> None:
    if C.cuda:
        torch.cuda.set_device(C.device)
        dist.init_process_group(
            "nccl",
            store=dist.HashStore(),
            rank=0,
            world_size=1,
            device_id=C.device,
            timeout=datetime.timedelta(seconds=60),
        )
    else:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


def section(results: dict[str, Any], name: str, fn: Callable[[], Any]) -> None:
    say("", f"== {name} " + "=" * (60 - len(name)))
    t = time.perf_counter()
    try:
        results[name] = fn()
        say(f"-- {name}: {time.perf_counter() - t:.1f} s")
    except Exception as e:  # noqa: BLE001  (a failing section must not stop the others)
        first = (str(e).splitlines() or [""])[0][:400]
        say(f"FAIL {name}: {type(e).__name__}: {first}")
        say(*traceback.format_exc(limit=-4).rstrip().splitlines())
        results[name] = {"error": f"{type(e).__name__}: {first}"}
    finally:
        if C.cuda:
            torch.cuda.set_sync_debug_mode(0)


def table(header: list[str], rows: list[list[Any]]) -> None:
    cells = [[str(c) for c in row] for row in [header, *rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    last = len(header) - 1  # the last column unpadded (a long "where" list)
    for k, r in enumerate(cells):
        line = "  ".join(
            c if i == last else c.ljust(w) if i == 0 else c.rjust(w)
            for i, (c, w) in enumerate(zip(r, widths))
        )
        say(line.rstrip())
        if k == 0:
            say("  ".join("-" * w for w in widths[:last]) + "  -----")


# -- 0. versions -------------------------------------------------------------------------------


def versions() -> dict[str, Any]:
    out: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gradaccum": gradaccum.__version__,
        "gradaccum_file": gradaccum.__file__,
        "device": str(C.device),
        "backend": C.backend,
    }
    if C.cuda:
        nccl = torch.cuda.nccl.version()
        out["nccl"] = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
        out["device_name"] = torch.cuda.get_device_name(C.device)
        out["memory_gib"] = round(torch.cuda.get_device_properties(C.device).total_memory / 2**30)
        torch.cuda.synchronize()
        t = time.perf_counter()
        torch.cuda._sleep(int(1e8))
        torch.cuda.synchronize()
        C.cycles_per_ms = 1e8 / (1e3 * (time.perf_counter() - t))
        out["sleep_cycles_per_ms"] = round(C.cycles_per_ms)
    else:
        out["device_name"] = platform.processor() or platform.machine()
    for k, v in out.items():
        say(f"{k}: {v}")
    return out


# -- 1. the gpu suite --------------------------------------------------------------------------


# The gpu suite's files (the boundary transforms, dp_noise and the wire dtype in the second).
GPU_TESTS = ["tests/test_gpu.py", "tests/test_gpu_boundary.py"]


def suite() -> dict[str, Any]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    if not C.cuda:
        env["GRADACCUM_GPU_TEST_ON_CPU"] = "1"
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", *GPU_TESTS, "-q"]
    cmd += ["-p", "no:cacheprovider", "-rfEsxX", "--timeout=60"]
    t = time.perf_counter()
    try:
        r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
        rc: Any = r.returncode
        text = r.stdout + r.stderr
    except subprocess.TimeoutExpired as e:  # a hang: what it printed so far
        rc = "killed after 180 s"
        text = "".join(
            x.decode() if isinstance(x, bytes) else x or "" for x in (e.stdout, e.stderr)
        )
    lines = text.rstrip().splitlines()
    # The summary: the short test summary and the last line (or the tail of a crash).
    start = next((i for i, ln in enumerate(lines) if "short test summary" in ln), None)
    summary = lines[start:] if start is not None else lines[-25:]
    say(f"$ {' '.join(cmd)}  (rc {rc}, {time.perf_counter() - t:.1f} s)")
    say(*[ln[:300] for ln in summary])
    if rc not in (0, 5):
        failures = [ln for ln in lines if ln.startswith(("E ", "FAILED", "ERROR"))]
        say("-- first error lines:", *[ln[:300] for ln in failures[:30]])
    return {"rc": rc, "summary": summary, "output_tail": lines[-200:]}


# -- 2. host syncs -----------------------------------------------------------------------------

READS = ("item", "tolist", "__bool__", "__float__", "__int__", "cpu", "numpy")


def _where(stack: list[traceback.FrameSummary]) -> str:
    """The innermost gradaccum frame (else the innermost frame outside torch)."""
    mine = [f for f in stack if f"{os.sep}gradaccum{os.sep}" in f.filename]
    if not mine:
        mine = [f for f in stack if f"{os.sep}torch{os.sep}" not in f.filename] or stack
    f, inner = mine[-1], stack[-1]
    where = f"{Path(f.filename).name}:{f.lineno}:{f.name}"
    if inner is not f:  # the read is torch's (an optimizer's, say), called from there
        where += f" > {Path(inner.filename).name}:{inner.lineno}:{inner.name}"
    return where


def _in_backward(stack: list[traceback.FrameSummary]) -> bool:
    """Whether this runs inside a backward: the engine's device thread, or its frames."""
    if threading.current_thread() is not threading.main_thread():
        return True
    return any(
        f.name in ("_engine_run_backward", "run_backward") and "autograd" in f.filename
        for f in stack
    )


class HostSyncs:
    """Counts host syncs in a block: CUDA's sync debug warnings, and located host reads.

    ``set_sync_debug_mode`` is process-global; the wrapped ``Tensor`` methods too. Warnings raised
    in the autograd engine's device thread are replayed by the engine when the backward ends (on
    the caller's stack, so they count as ``bwd``, without their own location): the host reads
    give the location.
    """

    def __init__(self) -> None:
        self.syncs: list[tuple[str, bool]] = []  # (where, inside a backward)
        self.reads: list[tuple[str, str, bool]] = []  # (what, where, inside a backward)
        self._saved: dict[str, Any] = {}

    def __enter__(self) -> HostSyncs:
        sync_device()
        self._warnings = warnings.catch_warnings()
        self._warnings.__enter__()
        warnings.simplefilter("always")
        shown = warnings.showwarning

        def hook(message: Any, category: Any, filename: str, lineno: int, *rest: Any) -> None:
            if "synchroniz" not in str(message):
                shown(message, category, filename, lineno, *rest)
                return
            stack = traceback.extract_stack()[:-1]
            self.syncs.append((_where(stack), _in_backward(stack)))

        warnings.showwarning = hook
        self._wrap()
        if C.cuda:
            torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc: object) -> None:
        if C.cuda:
            torch.cuda.set_sync_debug_mode(0)
        self._unwrap()
        sync_device()
        self._warnings.__exit__(*exc)

    def _note(self, what: str) -> None:
        stack = traceback.extract_stack()[:-2]
        self.reads.append((what, _where(stack), _in_backward(stack)))

    def _wrap(self) -> None:
        for name in READS:
            original = getattr(torch.Tensor, name)
            self._saved[name] = original

            def read(t: Any, *a: Any, _name: str = name, _f: Any = original, **k: Any) -> Any:
                if t.device.type != "cpu" or not C.cuda:  # on CPU: a proxy of a device read
                    self._note(_name)
                return _f(t, *a, **k)

            setattr(torch.Tensor, name, read)
        for name in ("tensor", "as_tensor"):
            original = getattr(torch, name)
            self._saved["torch." + name] = original

            def make(*a: Any, _name: str = name, _f: Any = original, **k: Any) -> Any:
                if (
                    k.get("device") is not None
                    and torch.device(k["device"]).type != "cpu"
                    or (not C.cuda and k.get("device") is not None)
                ):
                    self._note(f"torch.{_name}(device=)")
                return _f(*a, **k)

            setattr(torch, name, make)

    def _unwrap(self) -> None:
        for name, original in self._saved.items():
            if name.startswith("torch."):
                setattr(torch, name[len("torch.") :], original)
            else:
                setattr(torch.Tensor, name, original)
        self._saved.clear()

    def row(self) -> list[Any]:
        seen = Counter([w for w, _ in self.syncs] + [f"{w} ({k})" for k, w, _ in self.reads])
        where = [f"{w} x{c}" if c > 1 else w for w, c in sorted(seen.items())]
        return [
            len(self.syncs) if C.cuda else "-",
            sum(b for _, b in self.syncs) if C.cuda else "-",
            len(self.reads),
            sum(b for _, _, b in self.reads),
            "; ".join(where) or "-",
        ]


def mlp(width: int, depth: int) -> tuple[dict[str, torch.Tensor], Any, Any]:
    torch.manual_seed(0)
    params: dict[str, torch.Tensor] = {}
    for i in range(depth):
        params[f"layers.{i}.weight"] = torch.randn(width, width, device=C.device) / width**0.5
        params[f"layers.{i}.bias"] = torch.zeros(width, device=C.device)
    params["head.weight"] = torch.randn(1, width, device=C.device) / width**0.5
    params["head.bias"] = torch.zeros(1, device=C.device)

    def loss_fn(p: dict[str, torch.Tensor], batch: Any) -> torch.Tensor:
        x, y = batch
        h = x
        for i in range(depth):
            h = torch.tanh(F.linear(h, p[f"layers.{i}.weight"], p[f"layers.{i}.bias"]))
        return ((F.linear(h, p["head.weight"], p["head.bias"]).squeeze(-1) - y) ** 2).mean()

    x = torch.randn(64, width, device=C.device)
    y = torch.randn(64, device=C.device)
    return params, loss_fn, (x, y)


def syncs(small: bool) -> dict[str, Any]:
    width, depth, n, windows = (64, 2, 4, 3) if small else (1024, 6, 4, 3)
    params, loss_fn, batch = mlp(width, depth)
    cases: dict[str, Callable[[], Callable[[], Any]]] = {}

    def fast(timeout: float | None, defer: bool = False) -> Callable[[], Any]:
        sync = gradaccum.all_reduce(bucket_mb=2, timeout=timeout, defer=defer)
        step = gradaccum.accumulate(gradaccum.grad_and_value(loss_fn), n, sync=sync)
        return lambda: step(params, batch)

    def scatter(policy: str, timeout: float | None) -> Callable[[], Any]:
        sharded = gradaccum.shard(params, bucket_mb=2)
        sync = gradaccum.reduce_scatter(sharded, policy=policy, timeout=timeout)
        step = gradaccum.accumulate(gradaccum.grad(loss_fn), n, sync=sync)
        return lambda: step(sharded, batch)

    def accumulator(metrics: bool, defer: bool = False) -> Callable[[], Any]:
        acc = gradaccum.Accumulator(n=n, sync=gradaccum.all_reduce(bucket_mb=2, defer=defer))
        box = [acc.init(params)]
        micro = list(zip(batch[0].chunk(n), batch[1].chunk(n)))
        values = [torch.func.grad_and_value(loss_fn)(params, mb) for mb in micro]

        def window() -> Any:
            for (g, loss), (x, _) in zip(values, micro):
                extra = {"metrics": {"loss": loss}} if metrics else {}
                box[0] = acc.add(box[0], g, size=len(x), **extra)
            grads, box[0] = acc.finalize(box[0])
            return grads

        return window

    def step_loop(defer: bool = False) -> Callable[[], Any]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 1))
        model = model.to(C.device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=defer or None)

        def mse(m: nn.Module, b: Any) -> torch.Tensor:
            return F.mse_loss(m(b[0]).squeeze(-1), b[1])

        sync = gradaccum.all_reduce(defer=defer)
        step = gradaccum.loop.Step(model, mse, opt, clip=1.0, sync=sync)
        micro = list(zip(batch[0].chunk(n), batch[1].chunk(n)))

        def window() -> Any:
            for mb in micro:
                step.add(mb)
            return step.apply()

        return window

    for timeout in (None, 30.0):
        cases[f"accumulate all_reduce timeout={timeout}"] = lambda t=timeout: fast(t)
        for policy in ("boundary", "every"):
            cases[f"accumulate reduce_scatter {policy} timeout={timeout}"] = (
                lambda p=policy, t=timeout: scatter(p, t)
            )
    cases["Accumulator add x4 + finalize"] = lambda: accumulator(False)
    cases["Accumulator add x4 (metrics) + finalize"] = lambda: accumulator(True)
    cases["loop.Step add x4 + apply (clip)"] = step_loop
    # The deferred boundary (issue 36): 0 syncs in a steady window (the last row of each).
    for timeout in (None, 30.0):
        cases[f"accumulate all_reduce defer timeout={timeout}"] = lambda t=timeout: fast(t, True)
    cases["Accumulator add x4 (metrics) + finalize, defer"] = lambda: accumulator(True, True)
    cases["loop.Step add x4 + apply (clip), defer, fused AdamW"] = lambda: step_loop(True)
    rows, out = [], {}
    for name, make in cases.items():
        try:
            run = make()
            for w in range(windows):
                with HostSyncs() as log:
                    run()
                if w in (0, windows - 1):
                    rows.append([name if w == 0 else "", w, *log.row()])
                out[f"{name} window {w}"] = {
                    "syncs": log.syncs,
                    "reads": log.reads,
                }
        except Exception as e:  # noqa: BLE001
            say(f"FAIL syncs {name}: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}")
            out[name] = {"error": repr(e)[:500]}
    say(
        f"MLP {width} x {depth}, n = {n}; per window (first and steady): syncs = CUDA sync "
        f"debug warnings, reads = wrapped host reads; bwd = inside a backward"
    )
    table(["case", "window", "syncs", "bwd", "reads", "bwd", "where"], rows)
    out["host_blocking"] = host_blocking(params, loss_fn, batch, n)
    return out


def host_blocking(params: Any, loss_fn: Any, batch: Any, n: int) -> dict[str, float]:
    """Host ms of a mid-window ``Accumulator.add`` behind a 200 ms kernel (~0: it does not wait)."""
    out: dict[str, float] = {}
    g = torch.func.grad(loss_fn)(params, batch)
    for timeout in (None, 30.0):
        for kind in ("all_reduce", "reduce_scatter every", "reduce_scatter boundary"):
            target: Any = params
            if kind == "all_reduce":
                sync: Any = gradaccum.all_reduce(bucket_mb=2, timeout=timeout)
            else:
                target = gradaccum.shard(params, bucket_mb=2)
                sync = gradaccum.reduce_scatter(target, policy=kind.split()[1], timeout=timeout)
            acc = gradaccum.Accumulator(n=n, sync=sync)
            state = acc.init(target)
            state = acc.add(state, g, size=len(batch[0]))
            sync_device()
            sleep_ms(200)
            t = time.perf_counter()
            state = acc.add(state, g, size=len(batch[0]))
            took = 1e3 * (time.perf_counter() - t)
            sync_device()
            while not acc.is_complete(state):
                state = acc.add(state, g, size=len(batch[0]))
            acc.finalize(state)
            out[f"{kind} timeout={timeout}"] = round(took, 2)
    # A whole steady window of the deferred boundary, queued behind the kernel: set_sync_debug_mode
    # does not see torch.distributed waits; host time does (~200: something waited).
    step = gradaccum.accumulate(
        gradaccum.grad(loss_fn), n, sync=gradaccum.all_reduce(bucket_mb=2, defer=True)
    )
    for _ in range(3):  # the first windows agree on the layout: then it is steady
        step(params, batch)
    sync_device()
    sleep_ms(200)
    t = time.perf_counter()
    step(params, batch)
    out["accumulate all_reduce(defer=True): a whole steady window"] = round(
        1e3 * (time.perf_counter() - t), 2
    )
    sync_device()
    behind = "a 200 ms kernel (~200: it waited)" if C.cuda else "nothing (CPU: no kernel)"
    say(f"host ms of a mid-window Accumulator.add (or a deferred window) behind {behind}:")
    table(["sync", "host ms"], [[k, v] for k, v in out.items()])
    return out


# -- 3. the language model ---------------------------------------------------------------------


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        a = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    """GPT-2 small's shape (untied head): 12 layers, d = 768, 12 heads, vocab 50257."""

    def __init__(self, layers: int, d: int, heads: int, vocab: int, seq: int) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def lm(small: bool, steps: int) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    if small:
        shape, mb, ns, warm = dict(layers=2, d=64, heads=4, vocab=256, seq=32), 2, (1, 4), 1
    else:
        shape, mb, ns, warm = (
            dict(layers=12, d=768, heads=12, vocab=50257, seq=512),
            8,
            (1, 4, 16),
            2,
        )
    seq, vocab = shape["seq"], shape["vocab"]
    amp = torch.autocast(C.device.type, torch.bfloat16)
    fused = {"fused": True}  # on CPU too (torch >= 2.4): the deferred contenders need it

    def make() -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = GPT(**shape).to(C.device)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-4, **fused)

    def ce(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.float().view(-1, vocab), targets.reshape(-1))

    gen = torch.Generator(device=C.device).manual_seed(0)
    top = max(ns)
    tokens = torch.randint(0, vocab, (top * mb, seq + 1), device=C.device, generator=gen)
    data = {n: (tokens[: n * mb, :-1], tokens[: n * mb, 1:]) for n in ns}
    chunks = {n: list(zip(data[n][0].split(mb), data[n][1].split(mb))) for n in ns}

    hand_model, hand_opt = make()
    ddp_base, ddp_opt = make()
    ddp = DDP(ddp_base, device_ids=[C.device.index] if C.cuda else None)
    sync_model, sync_opt = make()  # the hand loop with one host read per step (a logged loss)

    def contender(sync: Any) -> Callable[[int], None]:
        """``accumulate(grad_and_value(loss), n, sync=sync)`` + ``write_grads``, its own model."""
        model, opt = make()
        params = gradaccum.params_of(model)
        if sync is not None and sync.defer:
            sync.guard(opt)  # a bad window skipped by the fused step: no host read

        def loss(p: Any, batch: Any) -> torch.Tensor:
            x, y = batch
            with amp:
                logits, _ = gradaccum.call_module(model, p, {}, x)
            return ce(logits, y)

        steps = {
            n: gradaccum.accumulate(gradaccum.grad_and_value(loss), n, has_aux=True, sync=sync)
            for n in ns
        }

        def step(n: int) -> None:
            grads, _ = steps[n](params, data[n])
            gradaccum.write_grads(model, grads)
            opt.step()
            opt.zero_grad(set_to_none=True)

        return step

    def loop_step(defer: bool = False) -> Callable[[int], None]:
        """``gradaccum.loop.Step`` over ``all_reduce(defer=defer)``: ``add`` x n, ``apply``."""
        model, opt = make()

        def loss(m: nn.Module, batch: Any) -> torch.Tensor:
            x, y = batch
            with amp:
                logits = m(x)
            return ce(logits, y)

        step = gradaccum.loop.Step(model, loss, opt, sync=gradaccum.all_reduce(defer=defer))

        def run(n: int) -> None:
            for batch in chunks[n]:
                step.add(batch)
            step.apply()

        return run

    n_params = sum(p.numel() for p in hand_model.parameters())

    def hand(n: int) -> None:
        for x, y in chunks[n]:
            with amp:
                logits = hand_model(x)
            (ce(logits, y) / n).backward()
        hand_opt.step()
        hand_opt.zero_grad(set_to_none=True)

    def hand_read(n: int) -> None:  # as hand, and the window's loss read on the host
        total = torch.zeros((), device=C.device)
        for x, y in chunks[n]:
            with amp:
                logits = sync_model(x)
            loss = ce(logits, y) / n
            loss.backward()
            total += loss.detach()
        total.item()  # the one host read: the queue drains here, before the optimizer step
        sync_opt.step()
        sync_opt.zero_grad(set_to_none=True)

    def ddp_step(n: int) -> None:
        for i, (x, y) in enumerate(chunks[n]):
            if i < n - 1:
                with ddp.no_sync(), amp:
                    loss = ce(ddp(x), y) / n
                loss.backward()  # the backward outside autocast, inside no_sync
            else:
                with amp:
                    loss = ce(ddp(x), y) / n
                loss.backward()
        ddp_opt.step()
        ddp_opt.zero_grad(set_to_none=True)

    def micro() -> None:  # the compute floor: one micro-batch's forward and backward alone
        x, y = chunks[1][0]
        with amp:
            logits = hand_model(x)
        ce(logits, y).backward()

    contenders = {
        "hand": hand,
        "hand+read": hand_read,
        "ddp": ddp_step,
        "gradaccum": contender(gradaccum.all_reduce()),
        "gradaccum-local": contender(None),
        "gradaccum-no-overlap": contender(gradaccum.all_reduce(overlap=False)),
        "gradaccum-defer": contender(gradaccum.all_reduce(defer=True)),
        "loop.Step": loop_step(),
        "loop.Step-defer": loop_step(defer=True),
    }
    times: dict[str, dict[int, list[float]]] = {c: {n: [] for n in ns} for c in contenders}
    peak: dict[str, dict[int, list[float]]] = {c: {n: [] for n in ns} for c in contenders}
    before: dict[str, dict[int, list[float]]] = {c: {n: [] for n in ns} for c in contenders}
    floor: list[float] = []
    say(
        f"model: {n_params / 1e6:.1f} M params, {shape}, micro-batch {mb} x {seq} tokens; "
        f"{warm} warm-up + {steps} timed rounds over n = {ns}, contenders round-robin"
    )
    t_all = time.perf_counter()
    for r in range(warm + steps):
        for n in ns:
            for c, fn in contenders.items():
                sync_device()
                if C.cuda:
                    torch.cuda.reset_peak_memory_stats()
                    mem0 = torch.cuda.memory_allocated()
                t = time.perf_counter()
                fn(n)
                sync_device()
                if r >= warm:
                    times[c][n].append(1e3 * (time.perf_counter() - t))
                    if C.cuda:
                        peak[c][n].append(torch.cuda.max_memory_allocated() / 2**30)
                        before[c][n].append(mem0 / 2**30)
        sync_device()
        t = time.perf_counter()
        micro()
        sync_device()
        if r >= warm:
            floor.append(1e3 * (time.perf_counter() - t))
        hand_model.zero_grad(set_to_none=True)
    total_s = time.perf_counter() - t_all
    micro()  # gradients in place for the optimizer step alone (part of every contender)
    sync_device()
    t = time.perf_counter()
    for _ in range(3):
        hand_opt.step()
    sync_device()
    opt_ms = 1e3 * (time.perf_counter() - t) / 3
    med = {c: {n: statistics.median(v) for n, v in d.items()} for c, d in times.items()}
    one = statistics.median(floor)
    rows = []
    for n in ns:
        for c in contenders:
            ms = med[c][n]
            rows.append(
                [
                    n,
                    c,
                    f"{ms:.1f}",
                    f"{ms / med['hand'][n]:.3f}",
                    f"{min(times[c][n]):.1f}",
                    f"{max(times[c][n]):.1f}",
                    f"{n * one:.1f}",
                    f"{ms - n * one:+.1f}",
                    f"{max(peak[c][n]):.2f}" if peak[c][n] else "-",
                    f"{max(peak[c][n]) - min(before[c][n]):.2f}" if peak[c][n] else "-",
                ]
            )
    say(
        f"ms/step (median of {steps}), floor = n x one micro-batch's forward+backward alone "
        f"({one:.1f} ms), AdamW step alone {opt_ms:.1f} ms; peak GiB: max_memory_allocated "
        f"during the step, and above what was allocated before it"
    )
    table(
        ["n", "contender", "ms", "/hand", "min", "max", "floor", "gap", "peak", "peak-before"], rows
    )
    say(f"({total_s:.1f} s for {(warm + steps) * len(contenders) * sum(ns)} micro-batches)")
    if C.profile:
        for name in ("gradaccum", "gradaccum-local", "hand+read"):
            profile_host(name, contenders[name], 4)
    return {
        "shape": shape,
        "micro_batch": mb,
        "params": n_params,
        "steps": steps,
        "warm": warm,
        "ms": times,
        "median_ms": med,
        "micro_ms": floor,
        "optimizer_ms": opt_ms,
        "peak_gib": peak,
        "allocated_before_gib": before,
        "seconds": total_s,
    }


# -- 4. timeouts and NCCL's watchdog -------------------------------------------------------------

# One GPU cannot host a second NCCL rank, so a stuck peer is simulated: every pooled CUDA stream
# is kept busy by a long kernel. NCCL's own stream is one of them (ProcessGroupNCCL takes it from
# torch's pool), so a collective started then has its inputs ready at once but cannot run: what a
# collective waiting for a dead peer looks like to this rank. A real stuck NCCL kernel ends when
# its communicator is aborted; a sleeping one does not, so the simulated queue drains only when
# the sleep ends (STUCK_MS), whatever the abort does.
STUCK_MS = 5000
POOL = 32  # torch's streams per pool and priority (c10/cuda/CUDAStream.cpp, kStreamsPerPool)


def block_pool(ms: float) -> None:
    """Keep every pooled CUDA stream (both priorities) busy for ``ms``: NCCL's stream included."""
    for priority in (0, -1):
        for _ in range(POOL):
            with torch.cuda.stream(torch.cuda.Stream(priority=priority)):  # type: ignore[no-untyped-call]
                sleep_ms(ms)


def child(mode: str) -> None:
    """One timeout probe, run alone in a child process (its exit code is part of the result).

    It prints ``CHILD <seconds since start> <what happened>`` lines, flushed, so that what it
    reached is known even when it is killed.
    """
    t0 = time.perf_counter()
    cycles = os.environ.get("GPU_CHECK_CYCLES_PER_MS")
    if cycles:
        C.cycles_per_ms = float(cycles)

    def note(what: str) -> None:
        print(f"CHILD {time.perf_counter() - t0:6.2f} s  {what}", flush=True)

    group_s = 3 if mode == "watchdog" else 60
    torch.cuda.set_device(C.device)
    dist.init_process_group(
        "nccl",
        store=dist.HashStore(),
        rank=0,
        world_size=1,
        device_id=C.device,
        timeout=datetime.timedelta(seconds=group_s),
    )
    note(f"NCCL group up (its timeout {group_s} s); mode {mode}")
    try:
        if mode == "cost":  # a healthy run: the host polling at its reads against blocking
            params, loss_fn, _ = mlp(2048, 8)
            batch = (torch.randn(4096, 2048, device=C.device), torch.randn(4096, device=C.device))
            times: dict[str, list[float]] = {"timeout=None": [], "timeout=30": []}
            steps = {
                k: gradaccum.accumulate(
                    gradaccum.grad(loss_fn),
                    4,
                    sync=gradaccum.all_reduce(timeout=None if k == "timeout=None" else 30.0),
                )
                for k in times
            }
            for r in range(23):
                for k, fn in steps.items():
                    torch.cuda.synchronize()
                    t1 = time.perf_counter()
                    fn(params, batch)
                    torch.cuda.synchronize()
                    if r >= 3:
                        times[k].append(1e3 * (time.perf_counter() - t1))
            med = {k: round(statistics.median(v), 3) for k, v in times.items()}
            note(f"healthy step ms (median of 20, MLP 2048x8, n=4): {med}")
        elif mode in ("raw_abort", "raw_destroy"):  # torch alone: a stuck collective, then...
            t = torch.ones(1 << 10, device=C.device)
            dist.all_reduce(t)  # the communicator (and its stream) exist from here
            torch.cuda.synchronize()
            block_pool(STUCK_MS)
            work = dist.all_reduce(t, async_op=True)
            work.wait()  # the stream waits; the host does not
            time.sleep(1.0)
            note(f"collective stuck 1 s: is_completed={work.is_completed()}")
            if mode == "raw_abort":
                t1 = time.perf_counter()
                dist.group.WORLD._get_backend(torch.device("cuda")).abort()
                note(f"backend.abort() returned after {time.perf_counter() - t1:.2f} s")
        else:
            timeout = 20.0 if mode == "watchdog" else 1.0
            params, loss_fn, batch = mlp(256, 2)
            n, calls, marks = 4, [0], []

            def loss(p: Any, b: Any) -> torch.Tensor:
                calls[0] += 1
                marks.append(time.perf_counter())
                if calls[0] == n + (1 if mode == "stuck_every" else n) and mode != "fingerprint":
                    if mode == "busy":  # the compute stream, not NCCL's: late, not stuck
                        sleep_ms(4000)
                    else:
                        block_pool(STUCK_MS)
                return loss_fn(p, b)

            if mode == "stuck_every":
                sharded = gradaccum.shard(params, bucket_mb=0.1)
                sync: Any = gradaccum.reduce_scatter(sharded, policy="every", timeout=timeout)
                params = sharded
            else:
                sync = gradaccum.all_reduce(bucket_mb=0.1, timeout=timeout)
            step = gradaccum.accumulate(gradaccum.grad(loss), n, sync=sync)
            step(params, batch)
            torch.cuda.synchronize()
            note(f"window 1 done (sync timeout={timeout:g} s)")
            if mode == "fingerprint":  # stuck before the window: its fingerprint exchange
                block_pool(STUCK_MS)
            t1 = time.perf_counter()
            try:
                step(params, batch)
                note(f"window 2 done, no error, after {time.perf_counter() - t1:.2f} s")
            except gradaccum.GradAccumError as e:
                note(f"GradAccumError after {time.perf_counter() - t1:.2f} s: {e}")
            forwards = [round(m - t1, 3) for m in marks[n:]]
            note(f"window 2's forwards began at (host s): {forwards}")
    except Exception as e:  # noqa: BLE001
        note(f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}")
    note(f"host alive; torch.cuda.is_available()={torch.cuda.is_available()}")
    t1 = time.perf_counter()
    try:
        dist.destroy_process_group()
        note(f"destroy_process_group returned after {time.perf_counter() - t1:.2f} s")
    except Exception as e:  # noqa: BLE001
        note(f"destroy_process_group raised {type(e).__name__}: {str(e)[:200]}")
    note("exiting")


def timeouts() -> dict[str, Any]:
    """Each timeout probe in a child process: what it printed, its exit code, how long it ran."""
    out: dict[str, Any] = {}
    if not C.cuda:
        say("skipped: the probes need CUDA and NCCL (tests/test_timeouts_device.py proxies them)")
        return out
    runs = [
        ("stuck", {}),
        ("stuck", {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"}),
        ("stuck_every", {}),
        ("fingerprint", {}),
        ("busy", {}),
        ("watchdog", {}),
        ("raw_abort", {}),
        ("raw_destroy", {}),
        ("cost", {}),
    ]
    say(
        f"a stuck peer is simulated by {STUCK_MS / 1e3:g} s kernels on every pooled stream; "
        f"sync timeout 1 s (watchdog: 20 s against the group's 3 s)"
    )
    for mode, extra in runs:
        name = f"{mode} {' '.join(f'{k}={v}' for k, v in extra.items()) or '(default env)'}"
        env = {**os.environ, **extra, "GPU_CHECK_CYCLES_PER_MS": str(C.cycles_per_ms)}
        cmd = [sys.executable, __file__, "--child", mode]
        t = time.perf_counter()
        try:
            r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=20)
            rc: Any = r.returncode
            text = r.stdout + r.stderr
        except subprocess.TimeoutExpired as e:  # its output comes as bytes, whatever text= says
            rc = "killed at 20 s"
            text = "".join(
                x.decode(errors="replace") if isinstance(x, bytes) else (x or "")
                for x in (e.stdout, e.stderr)
            )
        took = time.perf_counter() - t
        lines = [ln for ln in text.splitlines() if ln.strip()]
        said = [ln for ln in lines if ln.startswith("CHILD")]
        say(f"{name}: rc={rc} (negative: killed by that signal) after {took:.1f} s")
        say(*[f"   | {ln[6:700]}" for ln in said])
        others = [ln for ln in lines if not ln.startswith("CHILD")][-4:]
        say(*[f"   ! {ln[:240]}" for ln in others])
        out[name] = {"rc": rc, "seconds": round(took, 1), "child": said, "tail": lines[-30:]}
    return out


def profile_host(name: str, fn: Callable[[int], None], n: int, steps: int = 6) -> None:
    """Where the host's time goes in ``steps`` steps of ``fn(n)``: cProfile, by own time.

    A host read shows as the time of the call that waits (``tolist``, ``item``,
    ``Event.synchronize``); the rest is the Python and the launches around the kernels.
    """
    import cProfile
    import io
    import pstats

    sync_device()
    prof = cProfile.Profile()
    t = time.perf_counter()
    prof.enable()
    for _ in range(steps):
        fn(n)
    prof.disable()
    sync_device()
    ms = 1e3 * (time.perf_counter() - t) / steps
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out).sort_stats("tottime")
    stats.print_stats(22)
    say(f"-- host profile of {name} at n = {n}: {ms:.1f} ms/step under cProfile, top own time:")
    body = out.getvalue().splitlines()
    start = next((i for i, line in enumerate(body) if "ncalls" in line), 0)
    for line in body[start:]:
        if line.strip():
            say("   " + line.replace(str(Path(gradaccum.__file__).parent.parent), "")[:150])


# -- main --------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--cpu", action="store_true", help="CPU + gloo, a tiny model (auto without CUDA)"
    )
    ap.add_argument("--out", default=None, help="JSON path (default $OUT/gpu_check.json if $OUT)")
    ap.add_argument("--steps", type=int, default=None, help="timed LM rounds (default 8; 2 on CPU)")
    ap.add_argument(
        "--skip", nargs="*", default=[], help="sections to skip: suite syncs lm timeout"
    )
    ap.add_argument("--profile", action="store_true", help="cProfile the LM's host, n = 4")
    ap.add_argument(
        "--runs", type=int, default=1, help="LM runs, each its own table (issue 36 asks for 3)"
    )
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    C.profile = args.profile
    C.cuda = torch.cuda.is_available() and not args.cpu
    C.device = torch.device("cuda", 0) if C.cuda else torch.device("cpu")
    C.backend = "nccl" if C.cuda else "gloo"
    if args.child:
        child(args.child)
        return
    out = args.out
    if out is None and os.environ.get("OUT"):
        out = str(Path(os.environ["OUT"]) / "gpu_check.json")
    small = not C.cuda
    steps = args.steps or (2 if small else 8)
    t0 = time.perf_counter()
    results: dict[str, Any] = {}
    section(results, "versions", versions)
    if "suite" not in args.skip:
        section(results, "suite", suite)
    init_group()
    try:
        if "syncs" not in args.skip:
            section(results, "syncs", lambda: syncs(small))
        if "lm" not in args.skip:
            for run in range(args.runs):
                name = "lm" if args.runs == 1 else f"lm run {run + 1} of {args.runs}"
                section(results, name, lambda: lm(small, steps))
    finally:
        sync_device()
        dist.destroy_process_group()
    if "timeout" not in args.skip:
        section(results, "timeout", timeouts)
    failed = [k for k, v in results.items() if isinstance(v, dict) and "error" in v]
    results["seconds"] = time.perf_counter() - t0
    say("", f"DONE in {results['seconds']:.0f} s; failed sections: {failed or 'none'}")
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(results, indent=1, default=str))
        Path(out).with_suffix(".log").write_text("\n".join(LOG) + "\n")
        print(f"wrote {out} and {Path(out).with_suffix('.log')}")


if __name__ == "__main__":
    main()
