"""coupled(): exact accumulation of a loss that couples a window's examples, on 1, 2 and 4 ranks.

Every case is checked in float64 against a whole-batch reference computed in one process: the
global window's representations embedded with a graph (each rank's micro-batches in order, from
that rank's random seed, so dropout draws the same masks), the sum over the ranks of each rank's
share of the loss, and ``torch.autograd.grad`` of that sum. The distributed cases run all
scenarios in one spawn per world size.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

import gradaccum
from gradaccum import Rows
from tests.dist import run, values

TOL = 1e-12
DT = torch.float64


# -- models and losses -----------------------------------------------------------------------------


def _tower(seed: int, d_in: int = 6, d_out: int = 4) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "w1": torch.randn(d_in, 8, generator=g, dtype=DT) / 2,
        "b1": torch.randn(8, generator=g, dtype=DT) / 4,
        "w2": torch.randn(8, d_out, generator=g, dtype=DT) / 2,
    }


def _encode(p: dict[str, torch.Tensor], x: torch.Tensor, drop: float = 0.0) -> torch.Tensor:
    h = torch.tanh(x @ p["w1"] + p["b1"])
    if drop:
        h = F.dropout(h, drop, training=True)
    return F.normalize(h @ p["w2"], dim=-1)


def _params() -> dict[str, Any]:
    return {"q": _tower(1), "d": _tower(2), "log_scale": torch.tensor(1.5, dtype=DT)}


def _embed_towers(p: dict[str, Any], batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {"q": _encode(p["q"], batch["q"]), "d": _encode(p["d"], batch["d"])}


def _clip(p: dict[str, Any], reps: dict[str, torch.Tensor], rows: Rows) -> torch.Tensor:
    """Symmetric InfoNCE of this rank's rows against every row, with a learned temperature."""
    scale = p["log_scale"].exp()
    q, d = reps["q"], reps["d"]
    target = rows.arange()
    lq = F.cross_entropy(scale * q[rows.local] @ d.T, target, reduction="sum")
    ld = F.cross_entropy(scale * d[rows.local] @ q.T, target, reduction="sum")
    return (lq + ld) / (2 * rows.total)


def _embed_dropout(p: dict[str, Any], batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {"q": _encode(p["q"], batch["q"], 0.3), "d": _encode(p["q"], batch["d"], 0.3)}


def _embed_labels(p: dict[str, Any], batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {"z": _encode(p["q"], batch["q"]), "y": batch["y"]}


def _supcon(p: dict[str, Any], reps: dict[str, torch.Tensor], rows: Rows) -> torch.Tensor:
    """Supervised contrastive: positives are the other rows of the same label (an int leaf)."""
    z, y = reps["z"], reps["y"]
    sim = z[rows.local] @ z.T * p["log_scale"].exp()
    self_mask = torch.zeros_like(sim, dtype=torch.bool)
    self_mask[torch.arange(sim.shape[0]), rows.arange()] = True
    sim = sim.masked_fill(self_mask, -1e9)
    logp = sim.log_softmax(dim=1)
    pos = (y[rows.local, None] == y[None, :]) & ~self_mask
    per_row = -(logp * pos).sum(1) / pos.sum(1).clamp(min=1)
    return per_row.sum() / rows.total


class _BNEncoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.lin = nn.Linear(6, 8).double()
        self.bn = nn.BatchNorm1d(8).double()
        self.out = nn.Linear(8, 4).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.normalize(self.out(torch.tanh(self.bn(self.lin(x)))), dim=-1)


def _bn_model() -> _BNEncoder:
    return _BNEncoder()


# -- data ------------------------------------------------------------------------------------------


def _rows_of(rank: int) -> int:
    return 7 + 2 * rank  # uneven rows per rank


def _global(world: int, seed: int = 0) -> dict[str, torch.Tensor]:
    total = sum(_rows_of(r) for r in range(world))
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(total, 6, generator=g, dtype=DT)
    return {
        "q": q,
        "d": q + 0.3 * torch.randn(total, 6, generator=g, dtype=DT),
        "y": torch.randint(0, 3, (total,), generator=g),
    }


def _mine(batch: dict[str, torch.Tensor], rank: int) -> dict[str, torch.Tensor]:
    start = sum(_rows_of(r) for r in range(rank))
    return {k: v[start : start + _rows_of(rank)] for k, v in batch.items()}


def _micro(batch: Any, sizes: list[int]) -> list[Any]:
    out, at = [], 0
    for s in sizes:
        out.append({k: v[at : at + s] for k, v in batch.items()})
        at += s
    return out


def _split_sizes(rows: int, n: int) -> list[int]:
    """accumulate's split: the first micro-batches get one row more (one per row when short)."""
    k = min(n, rows)
    return [rows // k + (1 if i < rows % k else 0) for i in range(k)]


def _reference(
    embed: Callable[..., Any],
    loss: Callable[..., Any],
    params: Any,
    world: int,
    sizes: Callable[[int], list[int]],
    seed_of: Callable[[int], int] | None = None,
) -> tuple[Any, torch.Tensor]:
    """The whole-batch gradient and objective: every rank's rows embedded with a graph."""
    leaves, spec = gradaccum._tree.flatten(params)
    live = [t.detach().requires_grad_() for t in leaves]
    p = gradaccum._tree.unflatten(spec, live)
    batch = _global(world)
    parts = []
    for r in range(world):
        if seed_of is not None:
            torch.manual_seed(seed_of(r))
        for mb in _micro(_mine(batch, r), sizes(r)):
            parts.append(embed(p, mb))
    reps = gradaccum._tree.map_(lambda *xs: torch.cat(xs), *parts)
    per_rank = tuple(_rows_of(r) for r in range(world))
    total = 0
    for r in range(world):
        start = sum(per_rank[:r])
        total = total + loss(p, reps, Rows(start, start + per_rank[r], sum(per_rank), per_rank, r))
    grads = torch.autograd.grad(total, live, allow_unused=True, materialize_grads=True)
    return gradaccum._tree.unflatten(spec, list(grads)), total.detach()


def _diff(a: Any, b: Any) -> float:
    la, lb = gradaccum._tree.flatten(a)[0], gradaccum._tree.flatten(b)[0]
    assert len(la) == len(lb)
    return max(float((x - y).abs().max()) for x, y in zip(la, lb))


# -- the scenarios (one process, or one rank of many) ----------------------------------------------


def _scenarios(rank: int, world: int, sync_of: Callable[[], Any]) -> dict[str, float]:
    """Each scenario's largest difference with the whole-batch reference (grads, objective)."""
    out: dict[str, float] = {}
    batch = _mine(_global(world), rank)
    rows = _rows_of(rank)

    # Two towers, a learned temperature, n that does not divide the rows (ragged split).
    params = _params()
    step = gradaccum.coupled(_embed_towers, _clip, 3, sync=sync_of())
    for window in range(2):  # a second window: the same function, state carried
        grads, value = step(params, batch)
        want, total = _reference(
            _embed_towers, _clip, params, world, lambda r: _split_sizes(_rows_of(r), 3)
        )
        out[f"towers[{window}]"] = max(_diff(grads, want), float((value - total).abs()))
    out["towers: no temperature gradient"] = float(grads["log_scale"].abs() < 1e-3)

    # Micro-batches of chosen, uneven sizes (MicroBatches), different on each rank.
    sizes = [1, rows - 3, 2]
    mbs = gradaccum.MicroBatches(_micro(batch, sizes))
    grads, value = gradaccum.coupled(_embed_towers, _clip, 2, sync=sync_of())(params, mbs)
    want, total = _reference(_embed_towers, _clip, params, world, lambda r: [1, _rows_of(r) - 3, 2])
    out["micro-batches"] = max(_diff(grads, want), float((value - total).abs()))

    # Dropout: pass 2 replays pass 1's masks; the reference draws them from the same seed.
    torch.manual_seed(100 + rank)
    grads, value = gradaccum.coupled(_embed_dropout, _clip, 4, sync=sync_of())(params, batch)
    after = torch.rand(1)
    want, total = _reference(
        _embed_dropout,
        _clip,
        params,
        world,
        lambda r: _split_sizes(_rows_of(r), 4),
        seed_of=lambda r: 100 + r,
    )
    out["dropout"] = max(_diff(grads, want), float((value - total).abs()))
    # The random state ends as after one forward per micro-batch.
    torch.manual_seed(100 + rank)
    for mb in _micro(batch, _split_sizes(rows, 4)):
        _embed_dropout(params, mb)
    out["dropout: random state after the step"] = float((torch.rand(1) - after).abs())

    # An integer leaf (labels) gathered beside the representations.
    grads, value = gradaccum.coupled(_embed_labels, _supcon, 2, sync=sync_of())(params, batch)
    want, total = _reference(
        _embed_labels, _supcon, params, world, lambda r: _split_sizes(_rows_of(r), 2)
    )
    out["labels"] = max(_diff(grads, want), float((value - total).abs()))

    # BatchNorm: the gradient, and the running statistics as one forward per micro-batch left them.
    model = _bn_model()
    mparams = gradaccum.params_of(model)

    def embed_bn(p: Any, mb: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {"q": functional_call(model, p["m"], (mb["q"],)), "d": _encode(p["d"], mb["d"])}

    bparams = {"m": mparams, "d": _tower(2), "log_scale": torch.tensor(1.0, dtype=DT)}
    grads, value = gradaccum.coupled(embed_bn, _clip, 3, sync=sync_of())(bparams, batch)
    got_buffers = {k: v.clone() for k, v in model.named_buffers()}
    ref_model = _bn_model()

    def embed_ref(p: Any, mb: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {"q": functional_call(ref_model, p["m"], (mb["q"],)), "d": _encode(p["d"], mb["d"])}

    ref_params = {
        "m": gradaccum.params_of(ref_model),
        "d": _tower(2),
        "log_scale": bparams["log_scale"],
    }
    want, total = _reference(
        embed_ref, _clip, ref_params, world, lambda r: _split_sizes(_rows_of(r), 3)
    )
    out["batchnorm"] = max(_diff(grads, want), float((value - total).abs()))
    # The reference ran every rank's micro-batches: this rank's buffers are those of its own.
    own = _bn_model()
    with torch.no_grad():
        for mb in _micro(batch, _split_sizes(rows, 3)):
            own(mb["q"])
    out["batchnorm: buffers"] = max(
        float((got_buffers[k].double() - v.double()).abs().max()) for k, v in own.named_buffers()
    )
    return out


def _naive_gap(world: int) -> float:
    """How far plain accumulation (each micro-batch's own negatives) is: the test can fail."""
    params = _params()
    batch = _global(world)
    total = batch["q"].shape[0]

    def per_micro(p: Any, mb: dict[str, torch.Tensor]) -> torch.Tensor:
        k = mb["q"].shape[0]
        return _clip(p, _embed_towers(p, mb), Rows(0, k, k, (k,))) * 1.0

    naive = gradaccum.accumulate(gradaccum.grad(per_micro), 4)(params, batch)
    want, _ = _reference(_embed_towers, _clip, params, 1, lambda r: _split_sizes(total, 4))
    return _diff(naive, want) if world == 1 else 0.0


# -- one process -----------------------------------------------------------------------------------


def test_one_process_matches_the_whole_batch() -> None:
    out = _scenarios(0, 1, lambda: None)
    bad = {k: v for k, v in out.items() if not v < TOL}
    assert not bad, bad


def test_compiled_with_dict_representations_matches_the_whole_batch() -> None:
    # torch.compile(coupled(...)) ended in an error inside Dynamo: it now runs eagerly (a graph
    # break); coupled(torch.compile(embed), ...) compiles the part that can be compiled.
    params, batch = _params(), _global(1)
    want, value = _reference(_embed_towers, _clip, params, 1, lambda r: _split_sizes(7, 3))
    for step in (
        torch.compile(gradaccum.coupled(_embed_towers, _clip, 3), backend="aot_eager"),
        gradaccum.coupled(torch.compile(_embed_towers, backend="aot_eager"), _clip, 3),
    ):
        grads, got = step(params, batch)
        assert _diff(grads, want) < TOL
        assert abs(float(got - value)) < TOL


def test_plain_accumulation_is_not_the_objective() -> None:
    # The reference is not trivially met: per-micro-batch negatives give another gradient.
    assert _naive_gap(1) > 1e-3


# -- across ranks ----------------------------------------------------------------------------------


def _sharded(rank: int, world: int) -> dict[str, float]:
    """A reduce-scatter sync over a Sharded: both passes gather; this rank's shards are exact."""

    params = _params()
    sp = gradaccum.shard(params, bucket_mb=1e-4)
    out_sp = gradaccum.shard(params, bucket_mb=1e-4)
    step = gradaccum.coupled(_embed_towers, _clip, 3, sync=gradaccum.reduce_scatter(sp))
    batch = _mine(_global(world), rank)
    with gradaccum.sync.record_collectives() as log:
        shards, value = step(sp, batch)
    full = _assemble(out_sp, shards)
    want, total = _reference(
        _embed_towers, _clip, params, world, lambda r: _split_sizes(_rows_of(r), 3)
    )
    purposes = [c.purpose for c in log]
    dist.barrier()
    return {
        "sharded": max(_diff(full, want), float((value - total).abs())),
        "sharded: pass-1 gathers": float(purposes.count("params") < 1),
    }


def _assemble(out: Any, grads: Any) -> Any:
    with torch.no_grad():
        for s, g in zip(out.shards, grads, strict=True):
            s.copy_(g)
    return out.gather()


def _collectives(rank: int, world: int) -> list[tuple[str, str]]:
    step = gradaccum.coupled(_embed_towers, _clip, 3, sync=gradaccum.all_reduce())
    with gradaccum.sync.record_collectives() as log:
        step(_params(), _mine(_global(world), rank))
    return [(c.kind, c.purpose) for c in log]


def _across(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = dict(_scenarios(rank, world, gradaccum.all_reduce))
    out.update(_sharded(rank, world))
    # A short window: fewer rows than n on this rank (one micro-batch per row).
    params = _params()
    batch = _mine(_global(world), rank)
    grads, value = gradaccum.coupled(_embed_towers, _clip, 16, sync=gradaccum.all_reduce())(
        params, batch
    )
    want, total = _reference(_embed_towers, _clip, params, world, lambda r: [1] * _rows_of(r))
    out["short window"] = max(_diff(grads, want), float((value - total).abs()))
    out["collectives"] = _collectives(rank, world)

    # A custom reduction (the user's sum of the shares, with a state carried between windows).
    def summed(grads: Any, state: Any, group: Any) -> tuple[Any, Any]:
        for g in gradaccum._tree.flatten(grads)[0]:
            dist.all_reduce(g, group=group)
        return grads, state + 1

    sync = gradaccum.custom_reduce(summed, init=lambda g: 0)
    step = gradaccum.coupled(_embed_towers, _clip, 3, sync=sync)
    for _ in range(2):
        grads, value = step(params, batch)
    want, total = _reference(
        _embed_towers, _clip, params, world, lambda r: _split_sizes(_rows_of(r), 3)
    )
    out["custom_reduce"] = max(_diff(grads, want), float((value - total).abs()))
    out["custom_reduce: state"] = float(sync.state != 2)
    if world == 4:  # hybrid sharding: a 2-D mesh is refused, before any collective
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        sp = gradaccum.shard(params, mesh)
        step = gradaccum.coupled(_embed_towers, _clip, 2, sync=gradaccum.reduce_scatter(sp))
        try:
            step(sp, batch)
            out["2-D mesh refused"] = 1.0
        except ValueError as err:
            out["2-D mesh refused"] = float(
                "the sync's data is split over a 2-D mesh, but the representations are "
                "exchanged over one process group" not in str(err)
            )
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 4])
def test_ranks_match_the_whole_batch(world: int) -> None:
    for rank, out in enumerate(values(run(_across, world=world, timeout=240), world=world)):
        coll = out.pop("collectives")
        bad = {k: v for k, v in out.items() if not v < TOL}
        assert not bad, (rank, bad)
        # The exchange: the rows, one gather (one dtype: the towers are float64), one
        # reduce-scatter; then the sync's window (fingerprint, buckets), as for any step.
        mine = [c for c in coll if c[1].startswith("coupled")]
        assert mine == [
            ("all_gather", "coupled rows"),
            ("all_gather", "coupled representations"),
            ("reduce_scatter", "coupled gradient"),
        ], coll


# -- a fault on one rank, ranks that disagree ------------------------------------------------------


def _faults(rank: int, world: int) -> dict[str, str]:
    """Each fault ends in an error on every rank, and the next window runs normally."""
    params = _params()
    batch = _mine(_global(world), rank)
    out: dict[str, str] = {}

    def embed_fails(p: Any, mb: Any) -> Any:
        if rank == 1:
            raise RuntimeError("embed broke on rank 1")
        return _embed_towers(p, mb)

    def loss_fails(p: Any, reps: Any, rows: Rows) -> torch.Tensor:
        if rank == 0:
            raise RuntimeError("loss broke on rank 0")
        return _clip(p, reps, rows)

    def embed_differs(p: Any, mb: Any) -> Any:
        reps = _embed_towers(p, mb)
        return reps if rank == 0 else {**reps, "extra": reps["q"]}

    cases = {
        "embed": (embed_fails, _clip, batch),
        "loss": (_embed_towers, loss_fails, batch),
        "layout": (embed_differs, _clip, batch),
        "no rows": (_embed_towers, _clip, batch if rank == 0 else gradaccum.MicroBatches([])),
        # A batch that does not split (its leaves disagree on dim 0), on rank 1 only.
        "batch": (_embed_towers, _clip, batch if rank == 0 else {**batch, "d": batch["d"][1:]}),
    }
    for name, (embed, loss, b) in cases.items():
        step = gradaccum.coupled(embed, loss, 2, sync=gradaccum.all_reduce())
        try:
            step(params, b)
            out[name] = "no error"
        except Exception as err:  # noqa: BLE001 - the test reads what each rank raised
            out[name] = f"{type(err).__name__}: {err}"
    # The group is still usable: a healthy window right after.
    grads, _ = gradaccum.coupled(_embed_towers, _clip, 2, sync=gradaccum.all_reduce())(
        params, batch
    )
    want, _ = _reference(
        _embed_towers, _clip, params, world, lambda r: _split_sizes(_rows_of(r), 2)
    )
    out["after"] = f"{_diff(grads, want):.3g}"
    return out


@pytest.mark.distributed
def test_a_fault_on_one_rank_ends_in_an_error_on_every_rank() -> None:
    r0, r1 = values(run(_faults, timeout=120))
    assert r1["embed"] == "RuntimeError: embed broke on rank 1"
    assert r0["embed"].startswith(
        "GradAccumError: coupled(embed_fails, _clip, n=2)(params, batch): rank(s) [1] failed "
        "before the representations were exchanged"
    ), r0["embed"]
    assert r0["loss"] == "RuntimeError: loss broke on rank 0"
    # A failed loss sends zeros (no host read to find out) and raises in pass 2, inside the
    # sync's window: the boundary tells the other ranks.
    assert r1["loss"].startswith(
        "GradAccumError: coupled(_embed_towers, loss_fails, n=2)(params, batch): 1 other rank(s) "
        "of the 2 in the group raised an error during this window (rank 1 did not)"
    ), r1["loss"]
    assert r1["batch"].startswith("ValueError: coupled(_embed_towers, _clip, n=2)(params, batch)")
    assert r0["batch"].startswith(
        "GradAccumError: coupled(_embed_towers, _clip, n=2)(params, batch): rank(s) [1] failed"
    ), r0["batch"]
    for r in (r0, r1):
        assert "the ranks' representations differ in key paths, dtypes or shapes" in r["layout"]
        assert r["layout"].startswith("GradAccumError")
        assert r["no rows"].endswith(
            "rank(s) [1] have no rows in this window (rows by rank: [7, 0]); coupled() needs at "
            "least one row on every rank; give every rank at least one row (uneven rows are "
            "fine), or train with gradaccum.loop.Step and a gradaccum.loop.Coupled loss, where a "
            "rank without rows holds a share of 0."
        ), r["no rows"]
        assert float(r["after"]) < TOL


# -- bad input, in one process ---------------------------------------------------------------------


def _call(embed: Any, loss: Any = _clip, n: int = 2, batch: Any = None) -> Any:
    batch = _mine(_global(1), 0) if batch is None else batch
    return gradaccum.coupled(embed, loss, n)(_params(), batch)


def test_bad_input_is_refused_with_the_fix() -> None:
    with pytest.raises(
        TypeError,
        match=re.escape(
            "coupled(embed, loss, n): embed must be a function embed(params, micro_batch) -> reps, "
            "got NoneType None."
        ),
    ):
        gradaccum.coupled(None, _clip, 2)  # type: ignore[arg-type]
    with pytest.raises(
        TypeError, match=re.escape("loss must be a function loss(params, reps, rows)")
    ):
        gradaccum.coupled(_embed_towers, 3, 2)  # type: ignore[arg-type]
    with pytest.raises(
        ValueError, match=re.escape("coupled(_embed_towers, _clip, n=0): n must be")
    ):
        gradaccum.coupled(_embed_towers, _clip, 0)
    with pytest.raises(TypeError, match=re.escape("coupled(_embed_towers, _clip, n=2): sync must")):
        gradaccum.coupled(_embed_towers, _clip, 2, sync="all_reduce")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("embed", "error", "message"),
    [
        (
            lambda p, mb: [mb["q"], 1.0],
            TypeError,
            "embed returned a non-tensor leaf [1] (float 1.0)",
        ),
        (lambda p, mb: mb["q"].sum(), ValueError, "embed's output <root> has a 0-dim tensor"),
        (
            lambda p, mb: mb["q"][:1],
            ValueError,
            "embed's output <root> has 1 rows for micro-batch 0 of 4 rows",
        ),
        (
            lambda p, mb: mb["y"],
            TypeError,
            "embed returned no floating tensor (<root> torch.int64 [])",
        ),
        (
            lambda p, mb: mb["q"] if mb["q"].shape[0] == 4 else mb["q"].float(),
            ValueError,
            "embed's output for micro-batch 1 differs from micro-batch 0's: <root> torch.float32 "
            "[6] against <root> torch.float64 [6]",
        ),
    ],
)
def test_bad_representations_are_refused(embed: Any, error: type, message: str) -> None:
    with pytest.raises(error, match=re.escape(message)):
        _call(embed)


@pytest.mark.parametrize(
    ("loss", "got"),
    [
        (lambda p, reps, rows: reps["q"].sum(1), "Tensor(shape=(7,), dtype=float64)"),
        (lambda p, reps, rows: 1.0, "float 1.0"),
        (lambda p, reps, rows: torch.tensor(3), "Tensor(shape=(), dtype=int64)"),
    ],
)
def test_a_loss_that_is_not_a_scalar_share_is_refused(loss: Any, got: str) -> None:
    with pytest.raises(
        TypeError,
        match=re.escape(
            "loss must return this rank's share of the objective as a 0-dim floating tensor, "
            f"got {got}"
        ),
    ):
        _call(_embed_towers, loss)


def test_nothing_changes_when_a_call_is_refused() -> None:
    params = _params()
    before = [t.clone() for t in gradaccum._tree.flatten(params)[0]]
    torch.manual_seed(5)
    state = torch.get_rng_state()
    with pytest.raises(TypeError):
        gradaccum.coupled(_embed_towers, lambda p, r, rows: 1.0, 2)(params, _mine(_global(1), 0))
    assert all(torch.equal(a, b) for a, b in zip(before, gradaccum._tree.flatten(params)[0]))
    assert torch.equal(state, torch.get_rng_state())  # this embed draws no random numbers


def test_under_a_torch_func_transform_it_is_refused() -> None:
    step = gradaccum.coupled(_embed_towers, _clip, 2)
    batch = _mine(_global(1), 0)
    with pytest.raises(
        ValueError, match=re.escape("coupled(_embed_towers, _clip, n=2)(params, batch)")
    ):
        torch.func.grad(lambda s: step({**_params(), "log_scale": s}, batch)[1])(
            torch.tensor(1.0, dtype=DT)
        )


# -- an FSDP2 model -------------------------------------------------------------------------------


def _fsdp2(rank: int, world: int) -> dict[str, Any]:
    """A fully_shard model: both passes gather its units (counted); the gradients are exact."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    def build() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 4)).double()

    def embed_with(model: nn.Module) -> Callable[..., Any]:
        def embed(p: Any, mb: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            q = gradaccum.call_module(model, p, {}, mb["q"])[0]
            d = gradaccum.call_module(model, p, {}, mb["d"])[0]
            return {"q": F.normalize(q, dim=-1), "d": F.normalize(d, dim=-1)}

        return embed

    def loss(p: Any, reps: dict[str, torch.Tensor], rows: Rows) -> torch.Tensor:
        sim = 5.0 * reps["q"][rows.local] @ reps["d"].T
        return F.cross_entropy(sim, rows.arange(), reduction="sum") / rows.total

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
    model = build()
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    sharded = gradaccum.shard(model)
    step = gradaccum.coupled(embed_with(model), loss, 3, sync=gradaccum.reduce_scatter(sharded))
    with gradaccum.sync.record_collectives() as log:
        grads, value = step(sharded, _mine(_global(world), rank))
    sharded.write_grads(grads)
    ref = build()
    want, total = _reference(
        embed_with(ref),
        loss,
        dict(ref.named_parameters()),
        world,
        lambda r: _split_sizes(_rows_of(r), 3),
    )
    diffs = {
        k: float((p.grad.full_tensor() - want[k.replace("_fsdp_wrapped_module.", "")]).abs().max())
        for k, p in model.named_parameters()
    }
    return {
        "diff": max(*diffs.values(), abs(float(value - total))),
        "log": [(c.kind, c.purpose) for c in log],
    }


@pytest.mark.distributed
def test_an_fsdp2_model_matches_the_whole_batch() -> None:
    for out in values(run(_fsdp2, timeout=180)):
        assert out["diff"] < TOL, out
        log = out["log"]
        # Pass 1 gathers each of the 2 units once; pass 2 as the sync does (once per window,
        # policy "boundary"); the exchange's three; one reduce-scatter per unit.
        assert log.count(("all_gather", "params")) == 4, log
        assert log.count(("reduce_scatter", "gradients")) == 2, log
        assert [c for c in log if c[1].startswith("coupled")] == [
            ("all_gather", "coupled rows"),
            ("all_gather", "coupled representations"),
            ("reduce_scatter", "coupled gradient"),
        ], log


def _stalled(rank: int, world: int) -> tuple[str, float]:
    """Rank 1 reaches the window 4 s late; the sync's timeout is 1 s."""
    import time

    step = gradaccum.coupled(_embed_towers, _clip, 2, sync=gradaccum.all_reduce(timeout=1.0))
    batch = _mine(_global(world), rank)
    if rank == 1:
        time.sleep(4.0)
    start = time.monotonic()
    try:
        step(_params(), batch)
        return "no error", time.monotonic() - start
    except Exception as err:  # noqa: BLE001 - the test reads what each rank raised
        return f"{type(err).__name__}: {err}", time.monotonic() - start


@pytest.mark.distributed
def test_a_stalled_rank_ends_in_an_error_within_the_timeout() -> None:
    (m0, t0), (m1, _) = values(run(_stalled, timeout=120, pg_timeout=30))
    assert m0.startswith(
        "GradAccumError: coupled(_embed_towers, _clip, n=2)(params, batch): the rows of each "
        "rank (all_gather) failed on rank 0"
    ), m0
    assert t0 < 15.0, t0  # the sync's timeout (1 s) fired, not the process group's (30 s)
    assert m1.startswith("GradAccumError: coupled(_embed_towers, _clip, n=2)(params, batch):"), m1
