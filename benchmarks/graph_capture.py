"""Issue 36, goal 3: can a whole accumulation window be captured in one CUDA graph?

    python benchmarks/graph_capture.py            # CUDA (NCCL, world size 1): capture + replay
    python benchmarks/graph_capture.py --cpu      # CPU (gloo): the eager windows only, a smoke test
    python benchmarks/graph_capture.py --only hand accumulate-none

Each variant runs in a child process of its own (a failed capture can leave CUDA state behind),
on the same seeded model (a small pre-LN causal LM), the same data and a fused AdamW with
``capturable=True`` and ``lr`` as a tensor. A variant is one whole window: n micro-batches'
gradients, summed, (a collective), written to ``.grad``, ``optimizer.step()``. For each:

1. a reference instance runs ``warmup + replays`` windows eagerly;
2. a second instance runs ``warmup`` windows eagerly on a side stream, captures one window with
   ``torch.cuda.graph``, then replays it ``replays`` times, copying each window's batch into the
   static input buffers first;
3. the parameters of the two are compared (max abs difference), and the eager and replayed
   window times are given (median ms).

A capture that fails prints the error and the innermost ``gradaccum`` frame it came from: what
prevents capture, where. On CPU only step 1 runs (twice, for the comparison).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from _bench_models import TinyLM  # noqa: E402

import gradaccum  # noqa: E402

VARIANTS = [
    "hand",  # (loss / n).backward() per micro-batch, optimizer.step()
    "hand+all_reduce",  # the same with one dist.all_reduce per gradient, at the boundary
    "hand+found_inf",  # + a non-finite flag, max-reduced, handed to the fused step: no host read
    "accumulate-none",  # accumulate(grad(loss), n, sync=None) + write_grads
    "accumulate-all_reduce",  # accumulate(..., sync=all_reduce())
    "accumulate-all_reduce-defer",  # accumulate(..., sync=all_reduce(defer=True)), guard(opt)
    "accumulate-reduce_scatter",  # accumulate over shard(params), reduce_scatter()
    "accumulator-none",  # Accumulator(n, sync=None): add x n, finalize
    "accumulator-all_reduce",  # Accumulator(n, sync=all_reduce())
    "accumulator-all_reduce-defer",  # Accumulator(n, sync=all_reduce(defer=True)), guard(opt)
    "step-none",  # loop.Step(model, loss, opt, sync=None): add x n, apply
    "step-all_reduce",  # loop.Step(..., sync=all_reduce())
]


class Cfg:
    cuda = False
    device = torch.device("cpu")
    n = 4
    micro = 8
    seq = 128
    vocab = 2048
    d = 256
    layers = 4
    warmup = 3
    replays = 5


C = Cfg()


def build() -> tuple[TinyLM, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = TinyLM(C.vocab, C.d, 4, C.layers, C.seq).to(C.device)
    if C.cuda:
        lr = torch.tensor(1e-3, device=C.device)
        opt = torch.optim.AdamW(model.parameters(), lr=lr, fused=True, capturable=True)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    return model, opt


def batches(count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(count):
        tok = torch.randint(0, C.vocab, (C.n * C.micro, C.seq + 1), generator=gen)
        out.append((tok[:, :-1].contiguous().to(C.device), tok[:, 1:].contiguous().to(C.device)))
    return out


def lm_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def make_window(
    name: str, model: TinyLM, opt: torch.optim.Optimizer, static: tuple[torch.Tensor, torch.Tensor]
) -> Callable[[], None]:
    """One whole window of variant ``name``, reading its batch from ``static``."""
    n = C.n
    x, y = static
    buffers = gradaccum.buffers_of(model)

    def floss(params: dict[str, torch.Tensor], batch: Any) -> torch.Tensor:
        return lm_loss(gradaccum.call_module(model, params, buffers, batch[0])[0], batch[1])

    if name.startswith("hand"):
        reduce = name != "hand"
        flagged = name == "hand+found_inf"
        poison = torch.ones((), device=C.device)  # NaN: the window's gradients are not finite
        flag = torch.zeros((), device=C.device)

        def hand() -> None:
            opt.zero_grad(set_to_none=True)
            for xm, ym in zip(x.chunk(n), y.chunk(n)):
                (lm_loss(model(xm), ym) * poison / n).backward()
            if reduce:
                for p in model.parameters():
                    dist.all_reduce(p.grad)
            if flagged:  # the deferred check: a device flag, reduced with a max, never read
                grads = [p.grad for p in model.parameters()]
                bad = torch.stack([g.isfinite().all() for g in grads]).logical_not().any()
                flag.copy_(bad.float())
                dist.all_reduce(flag, op=dist.ReduceOp.MAX)
                opt.found_inf = flag  # type: ignore[attr-defined]  # fused step skips at 1.0
                opt.grad_scale = None  # type: ignore[attr-defined]
            opt.step()

        hand.poison = poison  # type: ignore[attr-defined]
        return hand

    if name.startswith("accumulate-") and name != "accumulate-reduce_scatter":
        sync = made_sync(name, opt)
        params = gradaccum.params_of(model)
        step = gradaccum.accumulate(gradaccum.grad(floss), n, sync=sync)

        def acc() -> None:
            grads = step(params, (x, y))
            gradaccum.write_grads(model, grads)
            opt.step()

        acc.sync = sync  # type: ignore[attr-defined]
        return acc

    if name == "accumulate-reduce_scatter":
        params = gradaccum.params_of(model)
        sharded = gradaccum.shard(params)
        shard_opt = torch.optim.AdamW(
            sharded.shards,
            lr=torch.tensor(1e-3, device=C.device) if C.cuda else 1e-3,
            fused=True,
            **({"capturable": True} if C.cuda else {}),
        )
        sync = gradaccum.reduce_scatter(sharded)
        step = gradaccum.accumulate(gradaccum.grad(floss), n, sync=sync)

        def scatter() -> None:
            grads = step(sharded, (x, y))
            sharded.write_grads(grads)
            shard_opt.step()

        scatter.state = lambda: list(sharded.shards)  # type: ignore[attr-defined]
        return scatter

    if name.startswith("accumulator-"):
        sync = made_sync(name, opt)
        params = gradaccum.params_of(model)
        accumulator = gradaccum.Accumulator(n=n, sync=sync)
        g = torch.func.grad(floss)

        def accum() -> None:
            state = accumulator.init(params)
            for xm, ym in zip(x.chunk(n), y.chunk(n)):
                state = accumulator.add(state, g(params, (xm, ym)), size=len(xm))
            grads, _ = accumulator.finalize(state)
            gradaccum.write_grads(model, grads)
            opt.step()

        accum.sync = sync  # type: ignore[attr-defined]
        return accum

    if name.startswith("step-"):
        sync = gradaccum.all_reduce() if name.endswith("all_reduce") else None

        def mloss(m: torch.nn.Module, b: Any) -> torch.Tensor:
            return lm_loss(m(b[0]), b[1])

        s = gradaccum.loop.Step(model, mloss, opt, sync=sync)

        def step_window() -> None:
            for xm, ym in zip(x.chunk(n), y.chunk(n)):
                s.add((xm, ym))
            s.apply()

        return step_window

    raise ValueError(f"unknown variant {name!r}; choose from {VARIANTS}")


def made_sync(name: str, opt: torch.optim.Optimizer) -> Any:
    """The sync: none, ``all_reduce()``, or ``all_reduce(defer=True)`` guarding ``opt``."""
    if name.endswith("-defer"):
        sync = gradaccum.all_reduce(defer=True)
        sync.guard(opt)  # the fused step skips a bad window on the device
        return sync
    return gradaccum.all_reduce() if name.endswith("all_reduce") else None


def verify(window: Any) -> None:
    """A deferred sync's last window read on the host (before a capture, after a replay)."""
    made = getattr(window, "sync", None)
    if made is not None and made.defer:
        made.verify()


def state(window: Any, model: TinyLM) -> list[torch.Tensor]:
    """The trained tensors of a variant: its shards, else the model's parameters."""
    return window.state() if hasattr(window, "state") else list(model.parameters())


def where(tb: Any) -> str:
    frames = traceback.extract_tb(tb)
    mine = [f for f in frames if f"{os.sep}gradaccum{os.sep}" in f.filename]
    f = (mine or frames)[-1]
    inner = frames[-1]
    out = f"{Path(f.filename).name}:{f.lineno}:{f.name}: {(f.line or '').strip()[:100]}"
    if inner is not f:
        out += f"  >  {Path(inner.filename).name}:{inner.lineno}:{inner.name}"
    return out


def sync() -> None:
    if C.cuda:
        torch.cuda.synchronize()


def timed(fn: Callable[[], None]) -> float:
    sync()
    t = time.perf_counter()
    fn()
    sync()
    return 1e3 * (time.perf_counter() - t)


def run_child(name: str) -> dict[str, Any]:
    if C.cuda:
        torch.cuda.set_device(C.device)
        dist.init_process_group(
            "nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=C.device
        )
    else:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    out: dict[str, Any] = {"variant": name}
    try:
        data = batches(C.warmup + C.replays)
        # 1. the eager reference
        ref_model, ref_opt = build()
        static = (data[0][0].clone(), data[0][1].clone())
        window = make_window(name, ref_model, ref_opt, static)
        eager_ms = []
        for xb, yb in data:
            static[0].copy_(xb)
            static[1].copy_(yb)
            eager_ms.append(timed(window))
        out["eager_ms"] = round(statistics.median(eager_ms[1:]), 3)
        ref = [t.detach().clone() for t in state(window, ref_model)]
        # 2. warm-up, capture, replay
        model, opt = build()
        static = (data[0][0].clone(), data[0][1].clone())
        window = make_window(name, model, opt, static)
        if not C.cuda:
            for xb, yb in data:
                static[0].copy_(xb)
                static[1].copy_(yb)
                window()
            verify(window)
            out["capture"] = "skipped (CPU)"
        else:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for xb, yb in data[: C.warmup]:
                    static[0].copy_(xb)
                    static[1].copy_(yb)
                    window()
            torch.cuda.current_stream().wait_stream(side)
            verify(window)  # a deferred sync: its last warm-up window's checks, read now
            graph = torch.cuda.CUDAGraph()
            static[0].copy_(data[C.warmup][0])
            static[1].copy_(data[C.warmup][1])
            try:
                with torch.cuda.graph(graph):
                    window()
            except Exception as e:  # noqa: BLE001
                out["capture"] = "FAILED"
                chain = []  # capture_end's error hides the first: follow __context__
                cur: BaseException | None = e
                while cur is not None and len(chain) < 4:
                    first = (str(cur).splitlines() or [""])[0][:300]
                    chain.append(f"{type(cur).__name__}: {first} @ {where(cur.__traceback__)}")
                    cur = cur.__context__ or cur.__cause__
                out["error_chain"] = chain[::-1]  # the first error first
                return out
            out["capture"] = "ok"
            replay_ms = []
            for xb, yb in data[C.warmup :]:
                static[0].copy_(xb)
                static[1].copy_(yb)
                replay_ms.append(timed(graph.replay))
                verify(window)  # each replay's checks (a deferred sync), after it
            out["replay_ms"] = round(statistics.median(replay_ms), 3)
            if name == "hand+found_inf":  # a poisoned window, replayed: skipped on the device
                before = [t.detach().clone() for t in state(window, model)]
                steps = [float(s["step"]) for s in opt.state.values()]
                window.poison.fill_(float("nan"))  # type: ignore[attr-defined]
                graph.replay()
                sync()
                after = [t.detach().clone() for t in state(window, model)]
                out["poisoned_window_params_unchanged"] = all(
                    torch.equal(a, b) for a, b in zip(before, after)
                )
                out["poisoned_window_step_unchanged"] = steps == [
                    float(s["step"]) for s in opt.state.values()
                ]
                window.poison.fill_(1.0)  # type: ignore[attr-defined]
                graph.replay()
                sync()
                out["next_window_moved"] = not all(
                    torch.equal(a, b) for a, b in zip(after, state(window, model))
                )
                return out
        got = [t.detach() for t in state(window, model)]
        out["checksum"] = sum(float(t.double().abs().sum()) for t in got)  # equal across variants
        out["max_abs_diff"] = max(float((a - b).abs().max()) for a, b in zip(ref, got))
        first = list(build()[0].parameters())
        if len(first) == len(ref):  # how far training moved them (a comparison that can fail)
            out["moved"] = max(float((a - b).abs().max()) for a, b in zip(ref, first))
    except Exception as e:  # noqa: BLE001
        out["error"] = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}"
        out["where"] = where(e.__traceback__)
    finally:
        sync()
        dist.destroy_process_group()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu", action="store_true")
    ap.add_argument("--only", nargs="*", default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help="JSON path (default $OUT/graph_capture.json)")
    args = ap.parse_args()
    C.cuda = torch.cuda.is_available() and not args.cpu
    C.device = torch.device("cuda", 0) if C.cuda else torch.device("cpu")
    if not C.cuda:
        C.micro, C.seq, C.vocab, C.d, C.layers, C.warmup, C.replays = 2, 16, 64, 32, 2, 1, 2
    if args.child:
        print("RESULT " + json.dumps(run_child(args.child)), flush=True)
        return
    print(f"torch {torch.__version__}, device {C.device}, n={C.n}, micro-batch {C.micro}x{C.seq}")
    results = []
    for name in args.only or VARIANTS:
        cmd = [sys.executable, __file__, "--child", name] + (["--cpu"] if args.cpu else [])
        t = time.perf_counter()
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
        line = next((ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")), None)
        res = json.loads(line[7:]) if line else {"variant": name, "error": f"rc {r.returncode}"}
        if not line:
            res["tail"] = (r.stdout + r.stderr)[-1500:]
        res["seconds"] = round(time.perf_counter() - t, 1)
        results.append(res)
        print(json.dumps(res), flush=True)
    out = args.out or (
        str(Path(os.environ["OUT"]) / "graph_capture.json") if os.environ.get("OUT") else None
    )
    if out:
        Path(out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
