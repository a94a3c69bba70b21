"""Sharded syncs on the wire (issue 28): FSDP2's units and mixed precision, dtypes, copies, devices.

- An FSDP2 model's buckets are its ``fully_shard`` units: one all-gather and one reduce-scatter
  per unit, in FSDP2's rank-major layout (``ShardBucket.to_wire`` / ``from_wire``).
- FSDP2's ``MixedPrecisionPolicy`` is honoured: params gathered in ``param_dtype``, gradients
  reduce-scattered in ``reduce_dtype`` (``param_dtype`` when None), sums kept in float32, inputs
  and outputs cast as FSDP2's hooks would.
- ``reduce_scatter(reduce_dtype=...)``: the wire dtype, the sums in the accumulation dtype.
- ``Sharded`` keeps no copy of an FSDP2 model's rows, and a one-member unit's all-gather reads
  the parameter's own storage.
- A CPU bucket is refused under a backend that takes no CPU tensors (NCCL), by name.

The fast tier runs on a gloo world of one process; the 2-process tests are marked.
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Any

import pytest
import torch
from dist import run, values
from models import regression_batch
from test_distributed import _shard
from torch import nn

import gradaccum
from gradaccum import _tree
from gradaccum._errors import describe
from gradaccum.sharding import _sharded
from gradaccum.sharding._fsdp import local_chunk
from gradaccum.sharding._plan import ShardBucket, make_shard_plan

N = 4
ROWS = 12


def _net(dtype: torch.dtype = torch.float32) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3), nn.Linear(3, 1)).to(dtype)


def _fsdp2(mesh: Any, dtype: torch.dtype = torch.float32, **options: Any) -> nn.Sequential:
    from torch.distributed.fsdp import fully_shard

    model = _net(dtype)
    for layer in (model[0], model[2], model[3]):
        fully_shard(layer, mesh=mesh, **options)
    fully_shard(model, mesh=mesh, **options)
    return model


def _mesh(world: int = 1) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (world,))


def _step(model: nn.Module, sharded: Any, seen: list[Any] | None = None, **sync: Any) -> Any:
    def loss(params: Any, batch: Any) -> torch.Tensor:
        if seen is not None:
            seen.extend(v.dtype for v in params.values())
        x, y = batch
        out, _ = gradaccum.call_module(model, params, {}, x)
        if seen is not None:
            seen.append(("out", out.dtype))
        return ((out.squeeze(-1).double() - y) ** 2).mean()

    return gradaccum.accumulate(
        gradaccum.grad(loss), N, sync=gradaccum.reduce_scatter(sharded, **sync)
    )


def _model_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        k.replace("_fsdp_wrapped_module.", ""): p.grad.full_tensor()  # type: ignore[union-attr]
        for k, p in model.named_parameters()
    }


def _reference(batch: Any, dtype: torch.dtype = torch.float64) -> dict[str, torch.Tensor]:
    """The whole batch's gradient in float64, of the net with its parameters rounded to dtype."""
    ref = _net().to(dtype).double()
    x, y = batch
    ((ref(x.to(dtype).double()).squeeze(-1) - y.double()) ** 2).mean().backward()
    return {k: p.grad for k, p in ref.named_parameters()}  # type: ignore[misc]


def _worst(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    assert sorted(got) == sorted(want)
    return max(float((got[k].double() - want[k]).abs().max() / want[k].abs().max()) for k in want)


# -- FSDP2's layout: a bucket per unit, rank-major on the wire -----------------------------------


def test_a_packed_bucket_goes_rank_major_on_the_wire_and_back() -> None:
    """Members (3, 2) and (5,) rows over 3 ranks: each rank's chunk is its rows of each."""
    world, parts = 3, (1 * 2, 2 * 1)  # ceil(3/3)=1 row of 2, ceil(5/3)=2 rows of 1
    b = ShardBucket(0, (0, 1), (0, world * parts[0]), world * 4, 4, 0, torch.float64,
                    torch.device("cpu"), parts)  # fmt: skip
    full = torch.zeros(b.padded, dtype=torch.float64)
    a, c = torch.arange(1.0, 7.0), torch.arange(10.0, 15.0)
    full[0:6] = a  # member 0: 3 rows of 2, padded to 3 rows
    full[6 : 6 + 5] = c  # member 1: 5 rows of 1, padded to 6 rows
    wire = b.to_wire(full, torch.float64)
    # rank r's chunk: member 0's row r, then member 1's rows 2r, 2r+1.
    assert wire.view(world, 4).tolist() == [
        [1, 2, 10, 11],
        [3, 4, 12, 13],
        [5, 6, 14, 0],
    ]
    assert torch.equal(b.from_wire(wire), full)
    assert b.to_wire(full, torch.bfloat16).dtype == torch.bfloat16
    one = ShardBucket(0, (0,), (0,), 6, 2, 0, torch.float64, torch.device("cpu"), (2,))
    same = torch.zeros(6, dtype=torch.float64)
    assert one.to_wire(same, torch.float64) is same  # one member: already rank-major
    assert one.from_wire(same) is same


def test_fsdp2_plan_has_one_bucket_per_unit_in_rows() -> None:
    from gradaccum._layout import make_layout

    params = {"a.weight": torch.zeros(5, 3), "a.bias": torch.zeros(5), "b.weight": torch.zeros(2)}
    lay = make_layout("test", params, None)
    units = tuple(0 if p.startswith("['a") else 1 for p in lay.paths)
    plan = make_shard_plan(lay, 2, 1, ("params",) * 3, units)
    assert [[lay.paths[i] for i in b.members] for b in plan.buckets] == [
        ["['b.weight']"],
        ["['a.weight']", "['a.bias']"],
    ]
    (bw, ab) = plan.buckets
    assert (bw.parts, bw.chunk, bw.padded, bw.start) == ((1,), 1, 2, 0)
    # a.weight: 3 rows of 3 per rank; a.bias: 3 rows of 1; rank chunk 12, full bucket 24
    assert (ab.parts, ab.offsets, ab.chunk, ab.padded, ab.start) == ((9, 3), (0, 18), 12, 24, 1)
    assert plan.sizes == (13,)


def test_an_fsdp2_window_runs_one_collective_of_each_kind_per_unit(world: None) -> None:
    model = _fsdp2(_mesh())
    sharded = gradaccum.shard(model)
    batch = tuple(t.float() for t in regression_batch(ROWS))
    for policy, scatters in (("boundary", 3), ("every", 3 * N)):
        step = _step(model, sharded, policy=policy)
        with gradaccum.sync.record_collectives() as log:
            sharded.write_grads(step(sharded, batch))
        counts = Counter((c.kind, c.purpose) for c in log)
        assert counts[("all_gather", "params")] == 3, policy  # was 6: one per parameter
        scatter = "gradients (every)" if policy == "every" else "gradients"
        assert counts[("reduce_scatter", scatter)] == scatters, policy  # was 6 and 6 * N
        assert _worst(_model_grads(model), _reference(batch, torch.float32)) < 1e-5


# -- copies -----------------------------------------------------------------------------------


def test_sharded_keeps_no_copy_of_an_fsdp2_models_rows(world: None) -> None:
    model = _fsdp2(_mesh())
    sharded = gradaccum.shard(model)
    assert {s.device.type for s in sharded.shards} == {"meta"}  # shapes only, no storage
    assert sum(s.numel() for s in sharded.shards) == sum(p.numel() for p in model.parameters())
    with pytest.raises(
        gradaccum.GradAccumError,
        match=re.escape(
            "Sharded.group_shards('params'): these shards are an FSDP2 model's parameters, "
            "which stay in the model; build the optimizer on model.parameters()."
        ),
    ):
        sharded.group_shards("params")
    # A one-member unit's all-gather input is the parameter's own storage (no copy-in).
    from torch.distributed.fsdp import fully_shard

    solo = nn.Linear(3, 1, bias=False)
    fully_shard(solo, mesh=_mesh())
    chunk = local_chunk(gradaccum.shard(solo), 0, torch.float32)
    (p,) = solo.parameters()
    assert chunk.untyped_storage().data_ptr() == p.to_local().untyped_storage().data_ptr()


def test_the_gathered_params_follow_optimizer_steps_on_the_model(world: None) -> None:
    model = _fsdp2(_mesh())
    sharded = gradaccum.shard(model)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    gathered = sharded.gather()
    for k, p in model.named_parameters():
        assert torch.equal(gathered[k], p.full_tensor()), k


# -- mixed precision --------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["boundary", "every"])
def test_fsdp2_param_dtype_reduce_dtype_and_output_dtype_are_honoured(
    world: None, policy: str
) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, output_dtype=torch.float32)
    model = _fsdp2(_mesh(), mp_policy=mp)
    sharded = gradaccum.shard(model)
    seen: list[Any] = []
    batch = tuple(t.float() for t in regression_batch(ROWS))
    step = _step(model, sharded, seen, policy=policy)
    with gradaccum.sync.record_collectives() as log:
        grads = step(sharded, batch)
    assert {d for d in seen if isinstance(d, torch.dtype)} == {torch.bfloat16}
    assert {d for d in seen if isinstance(d, tuple)} == {("out", torch.float32)}
    assert {g.dtype for g in grads} == {torch.float32}  # the sums stay float32
    assert {c.dtype for c in log if c.kind == "all_gather"} == {torch.bfloat16}
    assert {c.dtype for c in log if c.kind == "reduce_scatter"} == {torch.bfloat16}
    sharded.write_grads(grads)
    assert _worst(_model_grads(model), _reference(batch, torch.bfloat16)) < 5e-2
    # reduce_scatter(reduce_dtype=...) overrides the policy's wire dtype.
    step = _step(model, sharded, policy=policy, reduce_dtype=torch.float32)
    with gradaccum.sync.record_collectives() as log:
        step(sharded, batch)
    assert {c.dtype for c in log if c.kind == "reduce_scatter"} == {torch.float32}


def test_fsdp2_policy_without_input_casts_leaves_inputs_alone(world: None) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, cast_forward_inputs=False)
    model = _fsdp2(_mesh(), mp_policy=mp)
    sharded = gradaccum.shard(model)
    step = _step(model, sharded)
    with pytest.raises(RuntimeError, match="dtype"):  # float32 input, bfloat16 weight: torch's
        step(sharded, tuple(t.float() for t in regression_batch(ROWS)))


# -- reduce_dtype -----------------------------------------------------------------------------


def test_reduce_dtype_moves_half_the_bytes_and_keeps_the_sums(world: None) -> None:
    params = {"w": torch.randn(6, 3, dtype=torch.float64), "b": torch.zeros(3, dtype=torch.float64)}

    def loss(p: Any, batch: Any) -> torch.Tensor:
        x, y = batch
        return (((x[:, :3] @ p["w"].T).sum(-1) + p["b"].sum() - y) ** 2).mean()

    batch = regression_batch(ROWS)
    want = torch.func.grad(loss)(params, batch)
    sharded = gradaccum.shard(params)
    for policy in ("boundary", "every"):
        out = {}
        for wire in (None, torch.float32):
            sync = gradaccum.reduce_scatter(sharded, policy=policy, reduce_dtype=wire)
            step = gradaccum.accumulate(gradaccum.grad(loss), N, sync=sync)
            with gradaccum.sync.record_collectives() as log:
                out[wire] = step(sharded, batch)
            (rs,) = {(c.dtype, c.nbytes) for c in log if c.kind == "reduce_scatter"}
            assert rs == (wire or torch.float64, (4 if wire else 8) * (18 + 3)), (policy, wire)
            assert [b.dtype for b in sync.plan()] == [wire or torch.float64]
        assert out[None][0].dtype == out[torch.float32][0].dtype == torch.float64
        flat = torch.cat([want["w"].reshape(-1), want["b"]])
        assert torch.allclose(out[None][0], flat, rtol=1e-12, atol=1e-14), policy  # exact
        err = (out[torch.float32][0] - flat).abs().max() / flat.abs().max()
        assert 0 < err < 1e-6, (policy, err)  # one float32 rounding (per micro-batch: every)


@pytest.mark.parametrize(
    ("bad", "exc"),
    [(torch.int32, ValueError), ("bfloat16", TypeError), (torch.complex64, ValueError)],
)
def test_reduce_dtype_must_be_a_floating_dtype(world: None, bad: Any, exc: type) -> None:
    sharded = gradaccum.shard({"w": torch.zeros(3)})
    got = describe(bad)
    with pytest.raises(
        exc,
        match=re.escape(
            "reduce_scatter(sharded, policy=..., gather=...): reduce_dtype must be a floating "
            f"torch.dtype, got {got}; pass e.g. reduce_dtype=torch.bfloat16 (half the bytes of "
            "float32 on the wire), or None (the default: each bucket in its accumulation dtype, "
            "exact; for an FSDP2 model, the reduce_dtype of its MixedPrecisionPolicy)."
        ),
    ):
        gradaccum.reduce_scatter(sharded, reduce_dtype=bad)


# -- devices ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("backend", "device", "ok"),
    [
        ("gloo", "cpu", True),
        ("nccl", "cpu", False),
        ("nccl", "cuda", True),
        ("xccl", "cpu", False),
        ("cpu:gloo,cuda:nccl", "cpu", True),
        ("cpu:gloo,cuda:nccl", "cuda", True),
        ("cuda:nccl", "cpu", False),
        ("mpi", "cpu", True),
    ],
)
def test_which_backend_reaches_which_device(backend: str, device: str, ok: bool) -> None:
    assert _sharded.reaches(backend, torch.device(device)) is ok


def test_cpu_params_under_nccl_are_refused_by_name(
    world: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_sharded, "backend_of", lambda group: "nccl")
    with pytest.raises(
        ValueError,
        match=re.escape(
            "shard(params, group, bucket_mb=..., param_groups=..., src=...): params leaf "
            "['w'] is on cpu, but the group's backend is 'nccl', whose collectives take no "
            "cpu tensors; move the params to the group's device first, or initialise the "
            "group with a backend for each device type, e.g. "
            "init_process_group('cpu:gloo,cuda:nccl')."
        ),
    ):
        gradaccum.shard({"w": torch.zeros(3)})
    monkeypatch.setattr(_sharded, "backend_of", lambda group: "cpu:gloo,cuda:nccl")
    gradaccum.shard({"w": torch.zeros(3)})  # CPU tensors go to gloo


def test_fsdp2_cpu_offload_under_nccl_is_refused_by_name(
    world: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    from torch.distributed.fsdp import CPUOffloadPolicy

    model = _fsdp2(_mesh(), offload_policy=CPUOffloadPolicy(pin_memory=False))
    monkeypatch.setattr(_sharded, "backend_of", lambda group: "nccl")
    with pytest.raises(
        ValueError,
        match=re.escape(
            "shard(params, group, bucket_mb=..., param_groups=..., src=...): params leaf "
            "['3.weight'] is on cpu (FSDP2's CPUOffloadPolicy keeps it there), but the "
            "group's backend is 'nccl', whose collectives take no cpu tensors; fully_shard "
            "the model without offload_policy=CPUOffloadPolicy() (gradaccum gathers each "
            "parameter on the device of its shard), or initialise the group with a backend "
            "for each device type, e.g. init_process_group('cpu:gloo,cuda:nccl')."
        ),
    ):
        gradaccum.shard(model)


# -- 2 processes ------------------------------------------------------------------------------

SPLIT = (7, 5)


def _two(rank: int, world: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    batch = regression_batch(sum(SPLIT))
    mine = _shard(batch, rank, SPLIT)
    out: dict[str, Any] = {}
    hybrid = init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard"))
    net64 = _net(torch.float64)

    def loss(p: Any, b: Any) -> torch.Tensor:
        x, y = b
        pred = torch.func.functional_call(net64, p, (x,))
        return ((pred.squeeze(-1) - y) ** 2).mean()

    for policy in ("boundary", "every"):
        # float64 FSDP2 units of 2 members over 2 ranks (7 and 3 rows: uneven), wire float32.
        model = _fsdp2(_mesh(world), torch.float64)
        sharded = gradaccum.shard(model)
        for wire in (None, torch.float32):
            step = _step(model, sharded, policy=policy, reduce_dtype=wire)
            with gradaccum.sync.record_collectives() as log:
                sharded.write_grads(step(sharded, mine))
            out[f"{policy} {wire} err"] = _worst(_model_grads(model), _reference(batch))
            out[f"{policy} {wire} wire"] = {c.dtype for c in log if c.kind == "reduce_scatter"}
            out[f"{policy} {wire} scatters"] = sum(c.kind == "reduce_scatter" for c in log)
        # bf16 compute through the policy, float32 sums.
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
        model = _fsdp2(_mesh(world), mp_policy=mp)
        sharded = gradaccum.shard(model)
        step = _step(model, sharded, policy=policy)
        sharded.write_grads(step(sharded, tuple(t.float() for t in mine)))
        out[f"{policy} bf16 err"] = _worst(_model_grads(model), _reference(batch, torch.bfloat16))
        # Hybrid over a (2 replicas, 1 shard) mesh: the replicas' all-reduce in the wire dtype.
        sharded = gradaccum.shard(gradaccum.params_of(net64), hybrid)
        for wire in (None, torch.float32):
            sync = gradaccum.reduce_scatter(sharded, policy=policy, reduce_dtype=wire)
            step = gradaccum.accumulate(gradaccum.grad(loss), N, sync=sync)
            with gradaccum.sync.record_collectives() as log:
                shards = step(sharded, mine)
            got = _tree.unflatten(sharded.layout.spec, _unflat(sharded, shards))
            out[f"{policy} {wire} hybrid err"] = _worst(got, _reference(batch))
            out[f"{policy} {wire} hybrid wire"] = {
                c.dtype for c in log if c.purpose.startswith("gradients")
            }
    return out


def _unflat(sharded: Any, shards: Any) -> list[torch.Tensor]:
    """The full gradients (one shard, one rank per shard group) in the params' order."""
    lay, plan = sharded.layout, sharded.plan
    out: list[torch.Tensor] = [torch.empty(0)] * len(lay.paths)
    for b in plan.buckets:
        flat = shards[b.shard][b.start : b.start + b.padded]
        for i, off in zip(b.members, b.offsets):
            out[i] = flat[off : off + lay.shapes[i].numel()].view(lay.shapes[i])
    return out


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_two_ranks_fsdp2_units_and_wire_dtypes_match_the_whole_batch() -> None:
    for out in values(run(_two, timeout=240)):
        for policy, scatters in (("boundary", 3), ("every", 3 * N)):
            assert out[f"{policy} None err"] < 1e-12, out  # float64 sums and wire: exact
            assert out[f"{policy} None wire"] == {torch.float64}
            assert 0 < out[f"{policy} torch.float32 err"] < 1e-6, out
            assert out[f"{policy} torch.float32 wire"] == {torch.float32}
            assert out[f"{policy} None scatters"] == scatters
            assert out[f"{policy} bf16 err"] < 5e-2, out
            assert out[f"{policy} None hybrid err"] < 1e-12, out
            assert out[f"{policy} None hybrid wire"] == {torch.float64}
            assert 0 < out[f"{policy} torch.float32 hybrid err"] < 1e-6, out
            assert out[f"{policy} torch.float32 hybrid wire"] == {torch.float32}
