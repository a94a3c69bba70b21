"""DeviceMesh and hybrid sharding (HSDP) on 4 gloo processes (127.0.0.1).

On 2x2, 1x4 and 4x1 meshes of (replicate, shard) dims, for the ``boundary``, ``every`` and mixed
policies, the gradient shards of a window must be the slice of the gradient over the *global*
batch (float64, relative error at most 1e-12), with rows split unevenly over the 4 ranks and one
rank empty; and the collectives of a window must be exactly: reduce-scatters within the shard
dim (n x buckets under ``every``, buckets under ``boundary``), and all-reduces across the
replicate dim once per window (one per bucket). Also: a 1-D mesh wherever a group is accepted,
the errors for meshes of the wrong shape, and the boundary transforms over a hybrid mesh.

Each test spawns the 4 ranks once and runs its checks there; the assertions run here.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
from dist import run, values
from models import (
    accumulated_steps,
    max_diff,
    mean_loss,
    mlp_params,
    regression_batch,
    sum_loss,
    token_batch,
    token_mean_loss,
)
from test_distributed import _shard
from torch.func import grad

import gradaccum

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]

WORLD = 4
SPLIT = (6, 0, 5, 4)  # rows per global rank: uneven, rank 1 empty
ROWS = sum(SPLIT)
N = 3
TOL = 1e-12
MESHES = {"2x2": (2, 2), "1x4": (1, 4), "4x1": (4, 1)}
DIMS = ("replicate", "shard")
# bucket_mb=1e-5 (a 10-byte cap), reverse key order per group: decay = [w2], [w1];
# no_decay = [b2, b1]. Three buckets: two in "decay", one in "no_decay".
BUCKETS = {"decay": 2, "no_decay": 1}
POLICIES: dict[str, Any] = {
    "boundary": "boundary",
    "every": "every",
    "mixed": {"decay": "every", "no_decay": "boundary"},
}


def _groups(path: str) -> str:
    return "no_decay" if "'b" in path else "decay"


def _rel(a: Any, b: Any) -> float:
    scale = max(float(x.abs().max()) for x in b.values())
    return max_diff(a, b) / scale


def _assemble(out: gradaccum.sharding.Sharded, grads: Any) -> Any:
    with torch.no_grad():
        for s, g in zip(out.shards, grads, strict=True):
            s.copy_(g)
    return out.gather()


def _hybrid(rank: int, world: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    params = mlp_params(kind="dict")
    reg, tok = regression_batch(ROWS), token_batch(ROWS)
    batches = {"mean": reg, "sum": reg, "count": tok}
    ref = {
        "mean": grad(mean_loss)(params, reg),
        "sum": grad(sum_loss)(params, reg),
        "count": grad(token_mean_loss)(params, tok),
    }
    out: dict[str, Any] = {"diffs": {}, "counts": {}, "plans": {}, "meta": {}}
    for name, shape in MESHES.items():
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=DIMS)
        # Every rank starts from other values: src=0 must give all of them rank 0's.
        mine = {k: v + rank for k, v in params.items()}
        sp = gradaccum.shard(mine, mesh, bucket_mb=1e-5, param_groups=_groups)
        out["diffs"][f"{name} src"] = max_diff(sp.gather(), params)
        back = gradaccum.shard(params, mesh, bucket_mb=1e-5, param_groups=_groups)
        out["meta"][name] = (sp.world, sp.replicas, sp.state_dict().get("replicas"), repr(sp))
        for policy, pol in POLICIES.items():
            sync = gradaccum.reduce_scatter(sp, policy=pol)
            out["plans"][f"{name} {policy}"] = [b.collectives for b in sync.plan()]
            for fast in (True, False):
                for red, step in accumulated_steps(N, sync, fast).items():
                    key = f"{name} {policy} {red} fast={fast}"
                    with gradaccum.sync.record_collectives() as log:
                        g = step(sp, _shard(batches[red], rank, SPLIT))
                    out["diffs"][key] = _rel(_assemble(back, g), ref[red])
                    out["counts"][key] = Counter((c.kind, c.purpose, c.dim) for c in log)
        # The boundary transforms over the mesh: the norm of the whole gradient.
        sync = gradaccum.reduce_scatter(sp, policy="boundary")
        g = gradaccum.accumulate(gradaccum.grad(mean_loss), N, sync=sync)(
            sp, _shard(reg, rank, SPLIT)
        )
        _, norm = gradaccum.boundary.clip_by_global_norm(g, 1.0, group=mesh)
        want = torch.linalg.vector_norm(torch.cat([v.reshape(-1) for v in ref["mean"].values()]))
        out["diffs"][f"{name} clip norm"] = abs(float(norm) - float(want)) / float(want)
        scaler = gradaccum.boundary.LossScale()
        bad = tuple(t.clone() for t in g)
        if rank % shape[1] == shape[1] - 1:  # the last shard, on every replica (they agree)
            bad[0][0] = float("inf")
        _, finite, _ = scaler.unscale(bad, scaler.init(), group=mesh)
        out["meta"][f"{name} finite"] = finite
    return out


@pytest.fixture(scope="module")
def hybrid() -> list[dict[str, Any]]:
    return values(run(_hybrid, world=WORLD, timeout=240), world=WORLD)


def test_hybrid_shards_equal_one_process_on_the_global_batch(hybrid: list[dict[str, Any]]) -> None:
    for rank, out in enumerate(hybrid):
        assert len(out["diffs"]) == len(MESHES) * (len(POLICIES) * 2 * 3 + 2)
        bad = {k: v for k, v in out["diffs"].items() if not v < TOL}
        assert not bad, (rank, bad)


def _expected(name: str, policy: str) -> Counter[tuple[str, str, str | None]]:
    replicas, shards = MESHES[name]
    pol = POLICIES[policy]
    every = sum(
        b for g, b in BUCKETS.items() if (pol if isinstance(pol, str) else pol[g]) == "every"
    )
    buckets = sum(BUCKETS.values())
    want: Counter[tuple[str, str, str | None]] = Counter()
    want["all_reduce", "fingerprint", "shard"] = 1
    want["all_gather", "params", "shard"] = buckets  # once per window: given the Sharded
    want["reduce_scatter", "gradients (every)", "shard"] = N * every
    want["reduce_scatter", "gradients", "shard"] = buckets - every
    want["all_reduce", "weight", "shard"] = 1
    if replicas > 1:  # across replicas: once per window, whatever n
        want["all_reduce", "fingerprint", "replicate"] = 1
        want["all_reduce", "gradients", "replicate"] = buckets
        want["all_reduce", "weight", "replicate"] = 1
    return +want


def test_collectives_per_window_by_mesh_dim(hybrid: list[dict[str, Any]]) -> None:
    for out in hybrid:
        for key, counts in out["counts"].items():
            name, policy = key.split()[:2]
            assert counts == _expected(name, policy), key
        for key, plan in out["plans"].items():
            name = key.split()[0]
            wire = (("reduce_scatter", "shard"),)
            if MESHES[name][0] > 1:
                wire += (("all_reduce", "replicate"),)
            assert plan == [wire] * sum(BUCKETS.values()), key


def test_hybrid_sharded_layout_and_boundary_transforms(hybrid: list[dict[str, Any]]) -> None:
    for rank, out in enumerate(hybrid):
        meta = out["meta"]
        for name, (replicas, shards) in MESHES.items():
            world, reps, saved, text = meta[name]
            assert (world, reps) == (shards, replicas), name
            assert saved == (replicas if replicas > 1 else None), name
            assert f"of {shards}" in text, text
            # The last shard holds an inf: every rank of the mesh skips the step.
            assert meta[f"{name} finite"] is False, (rank, name)


# -- a 1-D mesh wherever a group is accepted; meshes of the wrong shape ------------------------


def _summed(grads: Any, state: Any, group: Any) -> tuple[Any, Any]:
    import torch.distributed as dist

    for g in grads.values():
        dist.all_reduce(g, group=group)
    return grads, (state or 0) + 1


def _error(fn: Any) -> str:
    try:
        fn()
    except Exception as err:  # noqa: BLE001 - the message is the result
        return f"{type(err).__name__}: {err}"
    return "no error"


def _one_dim(rank: int, world: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    params = mlp_params(kind="dict")
    reg = regression_batch(ROWS)
    ref = grad(mean_loss)(params, reg)
    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("dp",))
    two = init_device_mesh("cpu", (2, 2), mesh_dim_names=DIMS)
    three = init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("pp", "replicate", "shard"))
    out: dict[str, Any] = {"diffs": {}, "dims": {}}
    syncs = {
        "all_reduce": gradaccum.all_reduce(mesh, bucket_mb=1e-5),
        "custom_reduce": gradaccum.custom_reduce(_summed, group=mesh),
        "topk": gradaccum.compression.topk_all_reduce(1.0, group=mesh),
    }
    for name, sync in syncs.items():
        for fast in (True, False):
            fn = gradaccum.grad(mean_loss) if fast else grad(mean_loss)
            with gradaccum.sync.record_collectives() as log:
                g = gradaccum.accumulate(fn, N, sync=sync)(params, _shard(reg, rank, SPLIT))
            out["diffs"][f"{name} fast={fast}"] = _rel(g, ref)
            out["dims"][f"{name} fast={fast}"] = sorted({str(c.dim) for c in log})
    out["plan"] = [b.collectives for b in syncs["all_reduce"].plan(params)]
    sp = gradaccum.shard(params, mesh, bucket_mb=1e-5)
    g = gradaccum.accumulate(gradaccum.grad(mean_loss), N, sync=gradaccum.reduce_scatter(sp))(
        sp, _shard(reg, rank, SPLIT)
    )
    back = gradaccum.shard(params, mesh, bucket_mb=1e-5)
    out["diffs"]["reduce_scatter 1-D"] = _rel(_assemble(back, g), ref)
    out["errors"] = {
        "all_reduce 2-D": _error(lambda: gradaccum.all_reduce(two)),
        "custom_reduce 2-D": _error(lambda: gradaccum.custom_reduce(_summed, group=two)),
        "shard 3-D": _error(lambda: gradaccum.shard(params, three)),
    }
    return out


def test_a_one_dim_mesh_is_its_group_and_wrong_shapes_are_refused() -> None:
    for out in values(run(_one_dim, world=WORLD, timeout=180), world=WORLD):
        bad = {k: v for k, v in out["diffs"].items() if not v < TOL}
        assert len(out["diffs"]) == 7
        assert not bad, bad
        for key, dims in out["dims"].items():
            # custom reductions communicate inside fn: gradaccum logs only the weight tail.
            assert dims == ["dp"], (key, dims)
        assert out["plan"] == [(("all_reduce", "dp"),)] * 3
        errors = out["errors"]
        assert errors["all_reduce 2-D"].startswith(
            "ValueError: all_reduce(group, bucket_mb=..., check=..., timeout=...): group is a "
            "2-D DeviceMesh (replicate=2, shard=2), but this sync reduces over one process "
            "group; pass a 1-D mesh (e.g. mesh['shard']) or its group."
        ), errors
        assert errors["custom_reduce 2-D"].startswith(
            "ValueError: custom_reduce(fn, init=..., group=..., timeout=...): group is a 2-D "
            "DeviceMesh"
        ), errors
        assert errors["shard 3-D"].startswith(
            "ValueError: shard(params, group, bucket_mb=..., param_groups=..., src=...): group "
            "is a 3-D DeviceMesh (pp=1, replicate=2, shard=2); gradaccum shards over a 1-D mesh"
        ), errors
