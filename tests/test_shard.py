"""Sharded params and reduce-scatter sync (FSDP / ZeRO style) on 2 gloo processes (127.0.0.1).

The gradient shards a window returns must be this rank's slice of the gradient over the *global*
batch, whatever the policy, the step function, the gathering, the buckets and the split of the
rows over ranks and micro-batches. Also: the padded layout, mixed dtypes, parameter groups and
optimizers on shards, the collectives of a window, failures, checkpoints, the boundary
transforms with a group, and the errors of a world of one.

Each test spawns the 2 ranks once and runs many checks there (a spawn costs seconds); the ranks
send back numbers and the assertions run here.
"""

from __future__ import annotations

import functools
import os
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from dist import run, values
from models import (
    F64,
    accumulated_steps,
    max_diff,
    mean_loss,
    mlp_params,
    regression_batch,
    sum_loss,
    token_batch,
    token_mean_loss,
)
from test_distributed import _reversed_dict, _shard
from torch.func import grad

import gradaccum

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]

# Rows of the global batch held by each rank: deliberately unequal.
SPLIT = (7, 5)
ROWS = sum(SPLIT)
TOL = 1e-12


def _bad(diffs: dict[str, float], tol: float = TOL) -> dict[str, float]:
    return {k: v for k, v in diffs.items() if not v < tol}


def _assemble(out: gradaccum.sharding.Sharded, grads: Any) -> Any:
    """The full tree of gradient shards: copied into the shards of ``out``, then gathered.

    The shards must match ``out.shards`` in number, shape and dtype.
    """
    assert isinstance(grads, tuple), type(grads)
    assert len(grads) == len(out.shards)
    for g, s in zip(grads, out.shards, strict=True):
        assert (g.shape, g.dtype) == (s.shape, s.dtype), (g.shape, g.dtype, s.shape, s.dtype)
    with torch.no_grad():
        for s, g in zip(out.shards, grads, strict=True):
            s.copy_(g)
    return out.gather()


# -- 1. equivalence with one process on the global batch --------------------------------------


def _equivalence(rank: int, world: int) -> dict[str, float]:
    params = mlp_params(kind="dict")
    # Rank 1 builds the same dict in the opposite insertion order: the layout must agree.
    mine = _reversed_dict(params) if rank == 1 else params
    reg, tok = regression_batch(ROWS), token_batch(ROWS)
    batches = {"mean": reg, "sum": reg, "count": tok}
    ref = {
        "mean": grad(mean_loss)(params, reg),
        "sum": grad(sum_loss)(params, reg),
        "count": grad(token_mean_loss)(params, tok),
    }
    diffs: dict[str, float] = {}
    for mb in (1e-5, 25.0):  # 3 buckets (w2, w1, b2 + b1: 10-byte cap), or one
        sp = gradaccum.shard(mine, bucket_mb=mb)
        out = gradaccum.shard(mine, bucket_mb=mb)
        for policy in ("boundary", "every"):
            for gather in ("window", "micro_batch"):
                sync = gradaccum.reduce_scatter(sp, policy=policy, gather=gather)
                for fast in (True, False):
                    for n in (1, 3, 4):
                        steps = accumulated_steps(n, sync, fast)
                        for red, step in steps.items():
                            key = f"{red} {policy} gather={gather} fast={fast} n={n} mb={mb}"
                            g = step(sp, _shard(batches[red], rank, SPLIT))
                            diffs[key] = max_diff(_assemble(out, g), ref[red])
            # Params passed already gathered; grad_and_value on the fast path.
            sync = gradaccum.reduce_scatter(sp, policy=policy)
            step = gradaccum.accumulate(gradaccum.grad(mean_loss), 3, sync=sync)
            g = step(sp.gather(), _shard(reg, rank, SPLIT))
            diffs[f"mean {policy} pre-gathered mb={mb}"] = max_diff(_assemble(out, g), ref["mean"])
            step = gradaccum.accumulate(
                gradaccum.grad_and_value(mean_loss), 3, has_aux=True, sync=sync
            )
            g, _ = step(sp, _shard(reg, rank, SPLIT))
            diffs[f"mean {policy} grad_and_value mb={mb}"] = max_diff(
                _assemble(out, g), ref["mean"]
            )
    # A rank with fewer rows than n, and an empty rank, under both policies.
    sp = gradaccum.shard(mine, bucket_mb=1e-5)
    out = gradaccum.shard(mine, bucket_mb=1e-5)
    for split, what in (((ROWS - 2, 2), "rank 1 short"), ((ROWS, 0), "rank 1 empty")):
        for policy in ("boundary", "every"):
            for gather in ("window", "micro_batch"):
                sync = gradaccum.reduce_scatter(sp, policy=policy, gather=gather)
                for fast in (True, False):
                    for red, step in accumulated_steps(4, sync, fast).items():
                        key = f"{red} {what} {policy} gather={gather} fast={fast}"
                        g = step(sp, _shard(batches[red], rank, split))
                        diffs[key] = max_diff(_assemble(out, g), ref[red])
    return diffs


def test_gradient_shards_equal_one_process_on_the_global_batch() -> None:
    for diffs in values(run(_equivalence)):
        assert len(diffs) == 2 * (2 * 2 * 2 * 3 * 3 + 2 * 2) + 2 * 2 * 2 * 2 * 3
        bad = _bad(diffs)
        assert not bad, bad


# -- 2. padding, uneven leaf sizes, mixed dtypes, src ------------------------------------------


def _odd_loss(params: Any, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """A loss of leaves of any sizes and dtypes (computed in float64), every gradient nonzero."""
    x, y = batch
    s = x.sum(-1)
    total = torch.zeros_like(y)
    for k in sorted(params):
        total = total + torch.sin(s[:, None] * params[k].reshape(1, -1).to(F64)).sum(-1)
    return ((total - y) ** 2).mean()


def _expected_shard(
    tree: dict[str, torch.Tensor], buckets: list[list[str]], rank: int, world: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The shard of ``tree`` by the documented rule, and a mask of its padding."""
    parts, pads = [], []
    for keys in buckets:
        flat = torch.cat([tree[k].reshape(-1) for k in keys])
        padded = -(-flat.numel() // world) * world
        full = torch.cat([flat, flat.new_zeros(padded - flat.numel())])
        is_pad = torch.arange(padded) >= flat.numel()
        chunk = padded // world
        parts.append(full[rank * chunk : (rank + 1) * chunk])
        pads.append(is_pad[rank * chunk : (rank + 1) * chunk])
    return torch.cat(parts), torch.cat(pads)


def _bf16_sum(p: Any, x: torch.Tensor) -> torch.Tensor:
    return (x.to(torch.bfloat16)[:, None] * p["h"]).sum()


def _layout(rank: int, world: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(3)
    odd = {k: torch.randn(m, generator=g, dtype=F64) for k, m in (("a", 7), ("b", 13), ("c", 1))}
    reg = regression_batch(ROWS)
    ref = grad(_odd_loss)(odd, reg)
    out: dict[str, Any] = {"diffs": {}, "exact": {}, "sizes": {}, "pad": {}}
    # Reverse key order: c, b, a. A bucket closes once it holds bucket_mb: one bucket; c (8
    # bytes) and b together, then a (a 10-byte cap); one bucket per leaf (a 0-byte cap).
    layouts = (
        (25.0, [["c", "b", "a"]]),
        (1e-5, [["c", "b"], ["a"]]),
        (1e-7, [["c"], ["b"], ["a"]]),
    )
    for mb, buckets in layouts:
        sp = gradaccum.shard(odd, bucket_mb=mb)
        shard, _ = _expected_shard(odd, buckets, rank, world)
        out["sizes"][f"mb={mb}"] = [s.numel() for s in sp.shards]
        out["exact"][f"shard layout mb={mb}"] = len(sp.shards) == 1 and torch.equal(
            sp.shards[0], shard
        )
        full = sp.gather()
        out["exact"][f"gather mb={mb}"] = set(full) == set(odd) and all(
            torch.equal(full[k], odd[k]) for k in odd
        )
        want, pad = _expected_shard(ref, buckets, rank, world)
        out["pad"][f"mb={mb}"] = int(pad.sum())
        for policy in ("boundary", "every"):
            for fast in (True, False):
                fn = gradaccum.grad(_odd_loss) if fast else grad(_odd_loss)
                sync = gradaccum.reduce_scatter(sp, policy=policy)
                gs = gradaccum.accumulate(fn, 3, sync=sync)(sp, _shard(reg, rank, SPLIT))
                key = f"{policy} fast={fast} mb={mb}"
                out["diffs"][f"shard {key}"] = float((gs[0] - want).abs().max())
                out["exact"][f"padding zero {key}"] = bool((gs[0][pad] == 0).all())

    # Mixed dtypes: one shard per dtype; bfloat16 accumulates in float32.
    mixed = {
        "s": torch.randn(7, generator=g).float(),
        "d": torch.randn(13, generator=g, dtype=F64),
        "h": torch.randn(5, generator=g).to(torch.bfloat16),
    }
    up = {k: v.to(F64) for k, v in mixed.items()}
    ref = grad(_odd_loss)(up, reg)
    sp = gradaccum.shard(mixed, bucket_mb=1e-5)
    back = gradaccum.shard(mixed, bucket_mb=1e-5)
    out["mixed dtypes"] = sorted(str(s.dtype) for s in sp.shards)
    full = sp.gather()
    out["exact"]["mixed gather"] = all(
        full[k].dtype == mixed[k].dtype and torch.equal(full[k], mixed[k]) for k in mixed
    )
    rel: dict[str, float] = {}
    for policy in ("boundary", "every"):
        for fast in (True, False):
            fn = gradaccum.grad(_odd_loss) if fast else grad(_odd_loss)
            step = gradaccum.accumulate(fn, 4, sync=gradaccum.reduce_scatter(sp, policy=policy))
            gs = step(sp, _shard(reg, rank, SPLIT))
            out["exact"][f"mixed shard dtypes {policy} fast={fast}"] = [
                (s.dtype, s.shape) for s in gs
            ] == [(s.dtype, s.shape) for s in sp.shards]
            got = _assemble(back, gs)
            for k in mixed:
                scale = float(ref[k].abs().max())
                rel[f"{k} {policy} fast={fast}"] = (
                    float((got[k].to(F64) - ref[k]).abs().max()) / scale
                )
    out["mixed rel"] = rel

    # bfloat16 sums exactly in float32: 256 + 1 + 1 + 1 is 256 in bfloat16, 259 in float32.
    h = {"h": torch.zeros(2, dtype=torch.bfloat16)}
    sp = gradaccum.shard(h)
    x = torch.tensor([256.0, 1.0, 1.0, 1.0] if rank == 0 else [1.0, 1.0, 1.0, 1.0], dtype=F64)
    want = torch.tensor(263.0).to(torch.bfloat16)  # 264; 260 if summed in bfloat16
    bf: dict[str, Any] = {}
    for policy in ("boundary", "every"):
        for fast in (True, False):
            fn = gradaccum.grad(_bf16_sum) if fast else grad(_bf16_sum)
            step = gradaccum.accumulate(
                fn, 4, reduction="sum", sync=gradaccum.reduce_scatter(sp, policy=policy)
            )
            (gs,) = step(sp, x)
            full = _assemble(gradaccum.shard(h), (gs,))["h"]
            bf[f"{policy} fast={fast}"] = (str(gs.dtype), full.float().tolist())
    out["bf16"] = bf
    out["bf16 want"] = float(want)

    # src=0: rank 1 starts from other values and gets rank 0's.
    theirs = {k: v + 1 for k, v in odd.items()} if rank == 1 else odd
    full = gradaccum.shard(theirs, bucket_mb=1e-5, src=0).gather()
    out["exact"]["src=0"] = all(torch.equal(full[k], odd[k]) for k in odd)
    nested = mlp_params(kind="nested")
    full = gradaccum.shard(nested, bucket_mb=1e-5).gather()
    out["exact"]["nested gather"] = max_diff(full, nested) == 0
    return out


def test_padded_layout_mixed_dtypes_and_src() -> None:
    for rank, out in enumerate(values(run(_layout))):
        bad = {k: v for k, v in out["exact"].items() if v is not True}
        assert not bad, bad
        # ceil(21 / 2) in one bucket; ceil(14 / 2) + ceil(7 / 2) in two; ceil(1 / 2) +
        # ceil(13 / 2) + ceil(7 / 2) in three.
        assert out["sizes"] == {"mb=25.0": [11], "mb=1e-05": [7 + 4], "mb=1e-07": [1 + 7 + 4]}
        # All the padding is on the last rank: one element per bucket of odd size.
        assert out["pad"] == (
            {"mb=25.0": 0, "mb=1e-05": 0, "mb=1e-07": 0}
            if rank == 0
            else {"mb=25.0": 1, "mb=1e-05": 1, "mb=1e-07": 3}
        )
        assert len(out["diffs"]) == 12
        assert not _bad(out["diffs"]), out["diffs"]
        assert out["mixed dtypes"] == ["torch.bfloat16", "torch.float32", "torch.float64"]
        rel = out["mixed rel"]
        assert len(rel) == 12
        tol = {"d": 1e-12, "s": 1e-6, "h": 2e-2}
        bad = {k: v for k, v in rel.items() if not v < tol[k[0]]}
        assert not bad, bad
        assert out["bf16 want"] == 264.0
        assert out["bf16"] == dict.fromkeys(
            [f"{p} fast={f}" for p in ("boundary", "every") for f in (True, False)],
            ("torch.bfloat16", [264.0, 264.0]),
        ), out["bf16"]


# -- 3. parameter groups, mixed policies, optimizers on shards ---------------------------------


def _by_kind(path: str) -> str:
    return "b" if path.startswith("['b") else "w"


def _groups(rank: int, world: int) -> dict[str, Any]:
    params = mlp_params(kind="dict")
    reg = regression_batch(ROWS)
    ref = grad(mean_loss)(params, reg)
    out: dict[str, Any] = {"diffs": {}}
    sp = gradaccum.shard(params, bucket_mb=1e-5, param_groups=_by_kind)
    back = gradaccum.shard(params, bucket_mb=1e-5, param_groups=_by_kind)
    out["names"] = sp.names
    out["sizes"] = [s.numel() for s in sp.shards]
    out["group_shards"] = [
        [id(t) for t in sp.group_shards(name)] == [id(sp.shards[i])] for i, name in enumerate("wb")
    ]
    try:
        sp.group_shards("bias")
        out["unknown group"] = "no error"
    except KeyError as err:
        out["unknown group"] = str(err)
    full = sp.gather()
    out["gather"] = all(torch.equal(full[k], params[k]) for k in params)
    logs = {}
    for policy in ({"w": "every", "b": "boundary"}, {"w": "boundary", "b": "every"}):
        for gather in ("window", "micro_batch"):
            sync = gradaccum.reduce_scatter(sp, policy=policy, gather=gather)
            for fast in (True, False):
                for n in (1, 3):
                    fn = gradaccum.grad(mean_loss) if fast else grad(mean_loss)
                    step = gradaccum.accumulate(fn, n, sync=sync)
                    key = f"w={policy['w']} gather={gather} fast={fast} n={n}"
                    with gradaccum.sync.record_collectives() as log:
                        g = step(sp, _shard(reg, rank, SPLIT))
                    logs[key] = Counter(c.purpose for c in log if c.kind == "reduce_scatter")
                    out["diffs"][key] = max_diff(_assemble(back, g), ref)
    out["logs"] = logs

    # Optimizer steps on the shards equal the same steps on the full params in one process.
    def optimizers(w: list[torch.Tensor], b: list[torch.Tensor]) -> dict[str, Any]:
        return {
            "sgd": torch.optim.SGD(
                [{"params": w, "weight_decay": 0.01}, {"params": b}], lr=0.1, momentum=0.9
            ),
            "adamw": torch.optim.AdamW(
                [{"params": w, "weight_decay": 0.1}, {"params": b, "weight_decay": 0.0}], lr=0.05
            ),
        }

    for name in ("sgd", "adamw"):
        for policy in ("boundary", "every", {"w": "every", "b": "boundary"}):
            sp = gradaccum.shard(params, bucket_mb=1e-5, param_groups=_by_kind)
            opt = optimizers(sp.group_shards("w"), sp.group_shards("b"))[name]
            sync = gradaccum.reduce_scatter(sp, policy=policy)
            step = gradaccum.accumulate(gradaccum.grad(mean_loss), 3, sync=sync)
            whole = {k: v.clone() for k, v in params.items()}
            keys = sorted(whole)
            ref_opt = optimizers(
                [whole[k] for k in keys if k[0] == "w"], [whole[k] for k in keys if k[0] == "b"]
            )[name]
            for w in range(3):
                batch = regression_batch(ROWS, seed=10 + w)
                sp.write_grads(step(sp, _shard(batch, rank, SPLIT)))
                opt.step()
                opt.zero_grad(set_to_none=True)
                for k, gk in grad(mean_loss)(whole, batch).items():
                    whole[k].grad = gk
                ref_opt.step()
                ref_opt.zero_grad(set_to_none=True)
                out["diffs"][f"{name} policy={policy} window {w}"] = max_diff(sp.gather(), whole)
            moved = max_diff(whole, params) > 1e-3  # the comparison is not vacuous
            out["diffs"][f"{name} policy={policy} moved"] = 0.0 if moved else float("inf")
    return out


def test_parameter_groups_mixed_policies_and_optimizers_on_shards() -> None:
    for out in values(run(_groups)):
        assert out["names"] == ("w", "b")
        assert out["group_shards"] == [True, True]
        # w: w2 (7 -> 8) and w1 (35 -> 36), halved; b: b2 + b1 in one bucket (8), halved.
        assert out["sizes"] == [4 + 18, 4]
        assert out["unknown group"].startswith("\"Sharded.group_shards('bias'): no parameter "), (
            out["unknown group"]
        )
        assert "['b', 'w']" in out["unknown group"]
        assert out["gather"] is True
        assert len(out["diffs"]) == 2 * 2 * 2 * 2 + 2 * 3 * 4
        bad = _bad(out["diffs"])
        assert not bad, bad
        for key, counts in out["logs"].items():
            # w has 2 buckets, b 1: the "every" group's go once per micro-batch.
            n = int(key[-1])
            every, bound = (2, 1) if key.startswith("w=every") else (1, 2)
            assert counts == {"gradients (every)": every * n, "gradients": bound}, (key, counts)


# -- 4. the collectives of a window -----------------------------------------------------------


def _log(log: list[Any]) -> list[tuple[str, str, int]]:
    return [(c.kind, c.purpose, c.numel) for c in log]


def _windows(rank: int, world: int) -> dict[str, Any]:
    params = mlp_params(kind="dict")
    out: dict[str, Any] = {}
    with gradaccum.sync.record_collectives() as log:
        sp = gradaccum.shard(params, bucket_mb=1e-5)
    out["shard src=0"] = _log(log)
    with gradaccum.sync.record_collectives() as log:
        gradaccum.shard(params, bucket_mb=1e-5, src=None)
    out["shard src=None"] = _log(log)
    out["plan"] = [b.numel for b in gradaccum.reduce_scatter(sp).plan()]
    runs = {}
    for policy in ("boundary", "every"):
        for gather in ("window", "micro_batch", "pre-gathered"):
            for fast in (True, False):
                sync = gradaccum.reduce_scatter(
                    sp, policy=policy, gather="window" if gather == "pre-gathered" else gather
                )
                fn = gradaccum.grad(mean_loss) if fast else grad(mean_loss)
                step = gradaccum.accumulate(fn, 3, sync=sync)
                windows = []
                for w in range(2):
                    # Rank 1 is short in the first window and empty in the second: same log.
                    split = (ROWS - 2, 2) if w == 0 else (ROWS, 0)
                    batch = _shard(regression_batch(ROWS, seed=w), rank, split)
                    arg = sp.gather() if gather == "pre-gathered" else sp
                    with gradaccum.sync.record_collectives() as log:
                        step(arg, batch)
                    windows.append(_log(log))
                runs[(policy, gather, fast)] = windows
    out["runs"] = runs
    # Accumulator: nothing between the adds under boundary, B per add under every.
    acc_logs = {}
    for policy in ("boundary", "every"):
        acc = gradaccum.Accumulator(3, sync=gradaccum.reduce_scatter(sp, policy=policy))
        state = acc.init(sp)
        per = []
        for i in range(3):
            g = grad(mean_loss)(params, regression_batch(4, seed=i))
            with gradaccum.sync.record_collectives() as log:
                state = acc.add(state, g, size=4)
            per.append(_log(log))
        with gradaccum.sync.record_collectives() as log:
            acc.finalize(state)
        per.append(_log(log))
        acc_logs[policy] = per
    out["acc"] = acc_logs
    return out


def _expected(policy: str, gather: str, n: int, plan: list[int]) -> list[Any]:
    gathers = [("all_gather", "params", b) for b in plan]
    # The fingerprint, in every window, before any collective whose sizes depend on the layout.
    seq: list[Any] = [("all_reduce", "fingerprint", 2)]
    if gather == "window":
        seq += gathers
    for _ in range(n):
        if gather == "micro_batch":
            seq += gathers
        if policy == "every":
            seq += [("reduce_scatter", "gradients (every)", b) for b in plan]
    if policy == "boundary":
        seq += [("reduce_scatter", "gradients", b) for b in plan]
    return [*seq, ("all_reduce", "weight", 2)]


def test_collectives_of_a_window() -> None:
    r0, r1 = values(run(_windows))
    for out in (r0, r1):
        plan = out["plan"]
        assert plan == [8, 36, 8]  # w2, w1, b2 + b1, each padded to a multiple of 2
        b = len(plan)
        broadcasts = [("broadcast", "params", x) for x in plan]
        assert out["shard src=0"] == [("all_reduce", "fingerprint", 2), *broadcasts]
        assert out["shard src=None"] == [("all_reduce", "fingerprint", 2)]
        assert len(out["runs"]) == 12
        for (policy, gather, fast), windows in out["runs"].items():
            for w, log in enumerate(windows):
                key = (policy, gather, fast, w)
                assert log == _expected(policy, gather, 3, plan), key
                kinds = Counter((c[0], c[1]) for c in log)
                assert kinds[("reduce_scatter", "gradients")] == (b if policy == "boundary" else 0)
                assert kinds[("reduce_scatter", "gradients (every)")] == (
                    3 * b if policy == "every" else 0
                )
                assert kinds[("all_reduce", "weight")] == 1
                assert kinds[("all_reduce", "fingerprint")] == 1
                assert (
                    kinds[("all_gather", "params")]
                    == {
                        "window": b,
                        "micro_batch": 3 * b,
                        "pre-gathered": 0,
                    }[gather]
                )
        every = [("reduce_scatter", "gradients (every)", x) for x in plan]
        fingerprint = [("all_reduce", "fingerprint", 2)]
        assert out["acc"]["boundary"] == [
            fingerprint,
            [],
            [],
            [*[("reduce_scatter", "gradients", x) for x in plan], ("all_reduce", "weight", 2)],
        ]
        assert out["acc"]["every"] == [
            [*fingerprint, *every],
            every,
            every,
            [("all_reduce", "weight", 2)],
        ]
    assert r0["runs"] == r1["runs"]


# -- 5. one rank fails in the middle of a window ----------------------------------------------


def _failing(rank: int, world: int) -> dict[str, Any]:
    params = mlp_params(kind="dict")
    reg = regression_batch(ROWS)
    ref = grad(mean_loss)(params, reg)
    sp = gradaccum.shard(params, bucket_mb=1e-5)
    back = gradaccum.shard(params, bucket_mb=1e-5)
    calls, failing = [0], [False]

    def loss(p: Any, b: Any) -> torch.Tensor:
        calls[0] += 1
        if failing[0] and rank == 1 and calls[0] == 2:  # micro-batch 2 of 4
            raise FloatingPointError("loss is nan on rank 1")
        return mean_loss(p, b)

    out: dict[str, Any] = {}
    for policy in ("every", "boundary"):
        for gather in ("window", "micro_batch"):
            for fast in (True, False):
                key = f"{policy} gather={gather} fast={fast}"
                sync = gradaccum.reduce_scatter(sp, policy=policy, gather=gather, timeout=30)
                step = gradaccum.accumulate(
                    gradaccum.grad(loss) if fast else grad(loss), 4, sync=sync
                )
                calls[0], failing[0] = 0, True
                try:
                    step(sp, _shard(reg, rank, SPLIT))
                    first = "returned"
                except Exception as err:  # noqa: BLE001 - sent back to the test
                    first = f"{type(err).__name__}: {err}"
                failing[0] = False
                g = step(sp, _shard(reg, rank, SPLIT))
                out[key] = (first, max_diff(_assemble(back, g), ref))
    # Accumulator: rank 1 aborts after one add; rank 0's finalize raises; the next window works.
    for policy in ("every", "boundary"):
        acc = gradaccum.Accumulator(4, sync=gradaccum.reduce_scatter(sp, policy=policy, timeout=30))
        state = acc.init(sp)
        mbs = list(torch.tensor_split(torch.arange(SPLIT[rank]) + sum(SPLIT[:rank]), 4))
        stage = "add"
        try:
            for i, idx in enumerate(mbs):
                if rank == 1 and i == 1:
                    raise KeyError("bad record")
                g = grad(mean_loss)(params, (reg[0][idx], reg[1][idx]))
                state = acc.add(state, g, size=len(idx))
            stage = "finalize"
            acc.finalize(state)
            first = "returned"
        except KeyError as err:
            state = acc.abort(state)
            first = f"KeyError: {err}"
        except gradaccum.GradAccumError as err:  # on at the next window, as rank 1's abort
            state = acc.init(sp)._replace(window=state.window + 1)
            first = f"GradAccumError in {stage}: {err}"
        for idx in mbs:
            state = acc.add(
                state, grad(mean_loss)(params, (reg[0][idx], reg[1][idx])), size=len(idx)
            )
        g, _ = acc.finalize(state)
        out[f"Accumulator {policy}"] = (first, max_diff(_assemble(back, g), ref))
    return out


@functools.cache
def _failing_results() -> tuple[dict[str, Any], dict[str, Any]]:
    r0, r1 = values(run(_failing, timeout=110))
    return r0, r1


OTHER_FAILED = (
    "1 other rank(s) of the 2 in the group raised an error during this window (rank 0 did not); "
    "no gradient is returned on any rank. The cause is in the failing rank's traceback."
)


def test_an_error_on_one_rank_fails_the_window_on_every_rank_and_the_next_one_works() -> None:
    r0, r1 = _failing_results()
    assert len(r0) == len(r1) == 10
    for key in r0:
        (first0, after0), (first1, after1) = r0[key], r1[key]
        assert after0 < TOL, (key, after0)
        assert after1 < TOL, (key, after1)
        if key.startswith("Accumulator"):
            assert first1 == "KeyError: 'bad record'", (key, first1)
            # Raised by finalize (the only collective that carries the failure flag).
            assert first0.startswith("GradAccumError in finalize: "), (key, first0)
            assert first0.endswith(f": {OTHER_FAILED}"), (key, first0)
        else:
            assert first1 == "FloatingPointError: loss is nan on rank 1", (key, first1)
            assert first0 == f"GradAccumError: accumulate(loss, n=4)(...): {OTHER_FAILED}", (
                key,
                first0,
            )


def test_accumulator_finalize_errors_name_finalize() -> None:
    r0, _ = _failing_results()
    for policy in ("every", "boundary"):
        assert r0[f"Accumulator {policy}"][0] == (
            f"GradAccumError in finalize: Accumulator(n=4).finalize(state): {OTHER_FAILED}"
        )


def _mismatched(rank: int, world: int) -> dict[str, str]:
    """Rank 1 passes a params tree that differs from rank 0's, in one way per case."""
    base = {"w": torch.ones(3, 4, dtype=torch.float64), "b": torch.zeros(4, dtype=torch.float64)}
    cases = {
        "shape": {**base, "b": torch.zeros(5, dtype=torch.float64)},
        "dtype": {**base, "b": torch.zeros(4, dtype=torch.float32)},
        "leaf": {**base, "c": torch.zeros(1, dtype=torch.float64)},
    }
    out = {
        key: _error(gradaccum.shard, other if rank == 1 else base) for key, other in cases.items()
    }
    # The group still works: the same tree on both ranks shards and gathers.
    sp = gradaccum.shard(base)
    out["after"] = str(max_diff(sp.gather(), base))
    return out


def test_ranks_with_different_params_raise_on_every_rank() -> None:
    r0, r1 = values(run(_mismatched, timeout=60))
    for key, names in (("shape", "['b']"), ("dtype", "['b']"), ("leaf", "['c']")):
        for rank, got in enumerate((r0[key], r1[key])):
            assert got.startswith(
                "GradAccumError: shard(params, group, bucket_mb=..., param_groups=..., src=...): "
                "the ranks disagree on the params to shard: "
            ), (key, rank, got)
            assert got.endswith("the same bucket_mb and param_groups; nothing was sharded."), got
            assert f": rank {rank} has params leaf " in got, (key, rank, got)
            assert f" but rank {1 - rank} has params leaf " in got, (key, rank, got)
            assert f"leaf {names} of shape" in got, (key, rank, got)
    assert float(r0["after"]) == float(r1["after"]) == 0.0


def _stuck_peer(rank: int, world: int, gather: str) -> Any:
    sp = gradaccum.shard(mlp_params(kind="dict"))
    out: dict[str, Any] = {}
    sync = gradaccum.reduce_scatter(sp, policy="every", gather=gather, timeout=2)
    step = gradaccum.accumulate(grad(mean_loss), 2, sync=sync)
    step(sp, regression_batch(8))
    if rank == 1:
        time.sleep(8)  # alive, but never reaches the next window
        return "slept"
    start = time.monotonic()
    try:
        step(sp, regression_batch(8, seed=5))
    except gradaccum.GradAccumError as err:
        out["error"] = (str(err), time.monotonic() - start)
    return out


@pytest.mark.parametrize("gather", ["window", "micro_batch"])
def test_a_stuck_peer_is_a_clear_error_within_the_timeout(gather: str) -> None:
    """The window's first collective, the fingerprint exchange (before the params all-gather),
    fails after the sync's timeout, and the error path does not wait on the broken group again
    (it would until the peer left)."""
    r0, r1 = values(run(_stuck_peer, gather, timeout=60))
    assert r1 == "slept"
    message, took = r0["error"]
    assert message.startswith(
        "accumulate(mean_loss, n=2)(...): the fingerprint exchange with the other ranks failed "
        "on rank 0: "
    ), message
    assert message.endswith(
        "A peer process died, failed before the boundary, or did not reach it in time (timeout: "
        "2 s); every rank must call the accumulated function the same number of times. The "
        "process group cannot be reused: destroy it and restart from a checkpoint."
    ), message
    assert took < 2 + 3, took


# -- 6. checkpoints mid-window ------------------------------------------------------------------


def _micro_batches(rank: int, w: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    x, y = _shard(regression_batch(ROWS, seed=20 + w), rank, SPLIT)
    return list(zip(torch.tensor_split(x, 4), torch.tensor_split(y, 4), strict=True))


def _error(fn: Callable[..., Any], *args: Any) -> str:
    try:
        fn(*args)
    except Exception as err:  # noqa: BLE001 - sent back to the test
        return f"{type(err).__name__}: {err}"
    return "no error"


def _train(rank: int, world: int, folder: str, resume: bool) -> dict[str, Any]:
    """3 windows of 4 micro-batches with AdamW on the shards; save after 1.5 windows (or resume
    there), and compare the final shards with the uninterrupted run's."""
    out: dict[str, Any] = {}
    for policy in ("boundary", "every"):
        path = os.path.join(folder, f"{policy}-{{}}-rank{{}}.pt").format
        # The resumed run starts from other params: the checkpoint must overwrite them.
        params = mlp_params(kind="dict", seed=5 if resume else 0)
        sp = gradaccum.shard(params, bucket_mb=1e-5)
        acc = gradaccum.Accumulator(4, sync=gradaccum.reduce_scatter(sp, policy=policy))
        opt = torch.optim.AdamW(sp.shards, lr=0.05, weight_decay=0.1)
        if resume:
            sp.load_state_dict(torch.load(path("sp", rank), weights_only=True))
            opt.load_state_dict(torch.load(path("opt", rank), weights_only=True))
            state = acc.load_state_dict(
                acc.init(sp), torch.load(path("acc", rank), weights_only=True)
            )
            now = sp.gather()
            start = 6
        else:
            state = acc.init(sp.gather())
            start = 0
        for k in range(start, 12):
            w, i = divmod(k, 4)
            if i == 0:
                now = sp.gather()
            x, y = _micro_batches(rank, w)[i]
            state = acc.add(state, grad(mean_loss)(now, (x, y)), size=len(x))
            if not resume and (w, i) == (1, 1):
                torch.save(sp.state_dict(), path("sp", rank))
                torch.save(opt.state_dict(), path("opt", rank))
                sd = acc.state_dict(state)
                torch.save(sd, path("acc", rank))
                out[f"{policy} saved"] = (
                    [None if f is None else f.numel() for f in sd["full"]],
                    [o.numel() for o in sd["out"]],
                    sd["micro_step"],
                )
            if i == 3:
                g, state = acc.finalize(state)
                sp.write_grads(g)
                opt.step()
                opt.zero_grad(set_to_none=True)
        if not resume:
            torch.save([s.clone() for s in sp.shards], path("final", rank))
            continue
        final = torch.load(path("final", rank), weights_only=True)
        out[f"{policy} identical"] = all(
            torch.equal(a, b) for a, b in zip(sp.shards, final, strict=True)
        )
        out[f"{policy} moved"] = not torch.equal(
            sp.shards[0], gradaccum.shard(mlp_params(kind="dict"), bucket_mb=1e-5).shards[0]
        )
        # Another rank's files, another world size, another layout: refused, nothing changed.
        before = [s.clone() for s in sp.shards]
        theirs = torch.load(path("sp", 1 - rank), weights_only=True)
        faked = {**torch.load(path("sp", rank), weights_only=True), "world": 4}
        other_layout = gradaccum.shard(mlp_params(kind="dict"), bucket_mb=25.0).state_dict()
        acc_theirs = torch.load(path("acc", 1 - rank), weights_only=True)
        acc_mine = torch.load(path("acc", rank), weights_only=True)
        errors = {
            "acc short": _error(
                acc.load_state_dict, acc.init(sp), {**acc_mine, "full": acc_mine["full"][:-1]}
            ),
            "other rank": _error(sp.load_state_dict, theirs),
            "other world": _error(sp.load_state_dict, faked),
            "other layout": _error(sp.load_state_dict, other_layout),
            "acc other rank": _error(acc.load_state_dict, acc.init(sp), acc_theirs),
        }
        out[f"{policy} errors"] = errors
        out[f"{policy} unchanged"] = all(
            torch.equal(a, b) for a, b in zip(sp.shards, before, strict=True)
        )
    return out


def test_checkpoint_mid_window_resumes_bit_identically(tmp_path: Any) -> None:
    first = values(run(_train, str(tmp_path), False))
    for out in first:
        # boundary: the full padded buckets; every: only the shard accumulator.
        assert out["boundary saved"] == ([8, 36, 8], [4 + 18 + 4], 2)
        assert out["every saved"] == ([None, None, None], [4 + 18 + 4], 2)
    for rank, out in enumerate(values(run(_train, str(tmp_path), True))):
        for policy in ("boundary", "every"):
            assert out[f"{policy} identical"] is True, policy
            assert out[f"{policy} moved"] is True, policy
            assert out[f"{policy} unchanged"] is True, policy
            errors = out[f"{policy} errors"]
            where = "GradAccumError: Sharded.load_state_dict(state_dict): "
            assert errors["other rank"].startswith(
                f"{where}the state was saved by rank {1 - rank} but this is rank {rank}"
            ), errors
            assert errors["other world"].startswith(
                f"{where}the state was saved with world size 4 but this group has 2 ranks"
            ), errors
            assert errors["other layout"].startswith(
                f"{where}the state was saved for another sharded layout"
            ), errors
            assert errors["acc short"].startswith(
                "GradAccumError: Accumulator.load_state_dict(state, state_dict): the state holds "
                "2 bucket and 1 shard buffers, but this window has 3 and 1"
            ), errors
            assert errors["acc other rank"].startswith(
                "GradAccumError: Accumulator.load_state_dict(state, state_dict): the state was "
                f"saved by rank {1 - rank} but this is rank {rank}"
            ), errors


# -- 7. boundary transforms over the group ------------------------------------------------------


def _transforms(rank: int, world: int) -> dict[str, Any]:
    params = mlp_params(kind="dict")
    reg = regression_batch(ROWS)
    ref = grad(mean_loss)(params, reg)
    sp = gradaccum.shard(params, bucket_mb=1e-5)
    back = gradaccum.shard(params, bucket_mb=1e-5)
    step = gradaccum.accumulate(
        gradaccum.grad(mean_loss), 3, sync=gradaccum.reduce_scatter(sp, policy="every")
    )
    g = step(sp, _shard(reg, rank, SPLIT))
    out: dict[str, Any] = {"diffs": {}}
    for max_norm in (0.05, 100.0):
        with gradaccum.sync.record_collectives() as log:
            clipped, norm = gradaccum.boundary.clip_by_global_norm(
                g, max_norm, group=dist.group.WORLD
            )
        out[f"clip log {max_norm}"] = _log(log)
        want, want_norm = gradaccum.boundary.clip_by_global_norm(ref, max_norm)
        tensors = [v.clone() for v in ref.values()]
        for t in tensors:
            t.grad = t.clone()
        torch_norm = torch.nn.utils.clip_grad_norm_(tensors, max_norm)
        out["diffs"][f"norm {max_norm}"] = float((norm - want_norm).abs())
        out["diffs"][f"torch norm {max_norm}"] = float((norm - torch_norm).abs())
        out["diffs"][f"clipped {max_norm}"] = max_diff(_assemble(back, clipped), want)
        out["diffs"][f"clipped vs torch {max_norm}"] = max(
            float((a - t.grad).abs().max()) for a, t in zip(want.values(), tensors, strict=True)
        )
        out[f"norm {max_norm}"] = float(norm)
    scaler = gradaccum.boundary.LossScale(init_scale=1024.0)
    scaled = tuple(s * 1024.0 for s in g)
    unscaled, finite, state = scaler.unscale(scaled, scaler.init(), group=dist.group.WORLD)
    out["diffs"]["unscaled"] = max_diff(_assemble(back, unscaled), ref)
    out["finite"] = (finite, state)
    for bad_value in (float("inf"), float("nan")):
        mine = [s.clone() for s in scaled]
        if rank == 1:
            mine[0][0] = bad_value
        with gradaccum.sync.record_collectives() as log:
            _, finite, state = scaler.unscale(mine, scaler.init(), group=dist.group.WORLD)
        _, alone, _ = scaler.unscale(mine, scaler.init())
        out[f"found {bad_value}"] = (finite, state, alone, _log(log))
    return out


def test_clip_and_loss_scale_over_the_group_use_the_whole_gradient() -> None:
    r0, r1 = values(run(_transforms))
    for rank, out in enumerate((r0, r1)):
        assert len(out["diffs"]) == 9
        bad = _bad(out["diffs"])
        assert not bad, bad
        assert out["norm 0.05"] > 0.05  # clipped
        assert out["norm 100.0"] < 100.0  # not clipped
        for max_norm in (0.05, 100.0):
            assert out[f"clip log {max_norm}"] == [("all_reduce", "norm", 1)]
        assert out["finite"] == (True, gradaccum.boundary.LossScaleState(1024.0, 1))
        for bad_value in ("inf", "nan"):
            finite, state, alone, log = out[f"found {bad_value}"]
            assert finite is False, bad_value
            assert state == gradaccum.boundary.LossScaleState(512.0, 0)
            assert alone is (rank == 0), bad_value  # only rank 1's shard is bad
            assert log == [("all_reduce", "found_inf", 1)]
    assert r0["norm 0.05"] == r1["norm 0.05"]


# -- 8. errors in one process --------------------------------------------------------------------


def test_shard_needs_an_initialised_process_group() -> None:
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match=r"\Ashard\(params, .*needs torch\.distributed init"):
        gradaccum.shard(mlp_params())


@pytest.mark.usefixtures("world_of_one")
def test_errors_in_a_world_of_one() -> None:
    params = mlp_params(kind="dict")
    reg = regression_batch(8)
    sp = gradaccum.shard(params, bucket_mb=1e-5, param_groups=_by_kind)
    assert [s.numel() for s in sp.shards] == [7 + 35, 1 + 7]  # no padding in a world of one

    with pytest.raises(TypeError, match=r"sharded must be what gradaccum\.shard\(params\) return"):
        gradaccum.reduce_scatter(params)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"policy must be 'boundary' or 'every'.*got 'always'"):
        gradaccum.reduce_scatter(sp, policy="always")
    with pytest.raises(ValueError, match=r"missing \['b'\], unknown groups \[\], unknown pol"):
        gradaccum.reduce_scatter(sp, policy={"w": "every"})
    with pytest.raises(ValueError, match=r"unknown groups \['x'\], unknown policies \{\}"):
        gradaccum.reduce_scatter(sp, policy={"w": "every", "b": "every", "x": "every"})
    with pytest.raises(ValueError, match=r"unknown policies \{'w': 'often'\}"):
        gradaccum.reduce_scatter(sp, policy={"w": "often", "b": "every"})
    with pytest.raises(TypeError, match=r"policy must be 'boundary', 'every' or a dict"):
        gradaccum.reduce_scatter(sp, policy=3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"gather must be 'window' or 'micro_batch'"):
        gradaccum.reduce_scatter(sp, gather="step")

    sync = gradaccum.reduce_scatter(sp)

    def two_params(p: Any, b: Any, q: Any) -> torch.Tensor:
        return mean_loss(p, b) + q.sum()

    step = gradaccum.accumulate(grad(two_params, argnums=(0, 2)), 2, argnums=(0, 2), sync=sync)
    with pytest.raises(ValueError, match=r"must be taken with respect to one argument .*\(0, 2\)"):
        step(sp, reg, torch.ones(2, dtype=F64))

    other = gradaccum.shard(params, bucket_mb=1e-5, param_groups=_by_kind)
    step = gradaccum.accumulate(grad(mean_loss), 2, sync=sync)
    with pytest.raises(ValueError, match=r"a Sharded object other than the one the sync"):
        step(other, reg)
    with pytest.raises(ValueError, match=r"the gradients are for params that differ .*\['b1'\]"):
        step({k: v for k, v in params.items() if k != "b1"}, reg)
    with pytest.raises(ValueError, match=r"has 3 micro-batches but n=2; with sync=reduce_sc"):
        step(sp, gradaccum.MicroBatches([tuple(t[i : i + 2] for t in reg) for i in (0, 2, 4)]))
    g = step(sp, reg)  # still usable
    assert max_diff(_assemble(other, g), grad(mean_loss)(params, reg)) < TOL

    with pytest.raises(ValueError, match=r"expected 2 tensors, one per shard, got"):
        sp.write_grads(list(g[:1]))
    with pytest.raises(ValueError, match=r"gradient shard 1 is .*, expected shape \(8,\) float64"):
        sp.write_grads([g[0], torch.zeros(9, dtype=F64)])
    with pytest.raises(ValueError, match=r"gradient shard 0 is .*, expected shape \(42,\) float64"):
        sp.write_grads([g[0].float(), g[1]])
    assert all(s.grad is None for s in sp.shards)  # nothing written
    sp.write_grads(g)
    assert all(s.grad is t for s, t in zip(sp.shards, g, strict=True))

    acc = gradaccum.Accumulator(2, sync=sync)
    state = acc.init(sp)
    for i in range(2):
        state = acc.add(state, grad(mean_loss)(params, regression_batch(4, seed=i)), size=4)
    with pytest.raises(ValueError, match=r"already holds its n=2 micro-batches; with sync=red"):
        acc.add(state, grad(mean_loss)(params, regression_batch(4)), size=4)
    g, _ = acc.finalize(state)
    both = tuple(torch.cat(t) for t in zip(*(regression_batch(4, seed=i) for i in range(2))))
    assert max_diff(_assemble(other, g), grad(mean_loss)(params, both)) < TOL

    with pytest.raises(KeyError, match=r"no parameter group 'decay'; the groups are \['b', 'w'\]"):
        sp.group_shards("decay")
    with pytest.raises(gradaccum.GradAccumError, match=r"expected a dict of format 'gradaccum"):
        sp.load_state_dict({"shards": list(sp.shards)})
    with pytest.raises(
        ValueError, match=r"bucket_mb must be a positive, finite number of MiB, got int 0"
    ):
        gradaccum.shard(params, bucket_mb=0)
    with pytest.raises(ValueError, match=r"src must be None or a rank of the group \(0 to 0\)"):
        gradaccum.shard(params, src=1)
    with pytest.raises(TypeError, match=r"param_groups\(\"\['b1'\]\"\) returned"):
        gradaccum.shard(params, param_groups=lambda path: 1)  # type: ignore[arg-type,return-value]
    with pytest.raises(TypeError):
        gradaccum.shard({"i": torch.arange(3)})


def _unshard(sharded: gradaccum.sharding.Sharded, grads: tuple[torch.Tensor, ...]) -> Any:
    """Gradient shards as a full tree: put them in the shards a while and gather."""
    saved = [s.clone() for s in sharded.shards]
    with torch.no_grad():
        for s, g in zip(sharded.shards, grads, strict=True):
            s.copy_(g)
        full = sharded.gather()
        for s, t in zip(sharded.shards, saved, strict=True):
            s.copy_(t)
    return full


@pytest.mark.usefixtures("world_of_one")
def test_a_world_of_one_equals_the_whole_batch() -> None:
    """One process (a group of one rank): both policies, both gathers, both step kinds, n."""
    params = mlp_params()
    batch = regression_batch(12)
    ref = grad(mean_loss)(params, batch)
    sharded = gradaccum.shard(params, bucket_mb=1e-5)  # several buckets
    diffs = {}
    for policy in ("boundary", "every"):
        for gather in ("window", "micro_batch"):
            sync = gradaccum.reduce_scatter(sharded, policy=policy, gather=gather)
            for name, step_fn in (("fast", gradaccum.grad(mean_loss)), ("func", grad(mean_loss))):
                for n in (1, 3, 4):
                    step = gradaccum.accumulate(step_fn, n, sync=sync)
                    got = _unshard(sharded, step(sharded, batch))
                    diffs[f"{policy} {gather} {name} n={n}"] = max_diff(got, ref)
    bad = {k: v for k, v in diffs.items() if not v <= 1e-12}
    assert not bad, bad
    assert len(diffs) == 24
