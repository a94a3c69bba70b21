"""``all_reduce(reduce_dtype=...)``: the buckets' wire dtype (issue 28, mixed precision).

The sums stay in the accumulation dtype; at the boundary each gradient bucket is cast to
``reduce_dtype``, all-reduced and cast back, as DDP's ``bf16_compress_hook``. The tail (weight,
failure flag, metrics) stays exact in a bucket of its own. Checked against a hand-made reference
(cast each rank's sum, add, cast back) exactly, on 2 gloo ranks; the collectives' record shows
the wire dtype and its bytes.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
import torch.distributed as dist
from dist import run, values
from models import mean_loss, mlp_params, regression_batch, sum_loss
from torch.func import grad

import gradaccum
from gradaccum._dist import buckets

F32, BF16, F64 = torch.float32, torch.bfloat16, torch.float64
WHERE = "all_reduce(group, bucket_mb=..., check=..., timeout=...): "


def f32_params(seed: int = 0) -> dict[str, torch.Tensor]:
    return {k: v.float() for k, v in mlp_params(seed).items()}  # type: ignore[attr-defined]


def f32_batch(rows: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = regression_batch(rows, seed)
    return x.float(), y.float()


# -- the plan ----------------------------------------------------------------------------------


def test_default_plan_is_unchanged_and_sent_in_the_accumulation_dtype() -> None:
    params = f32_params()
    (bucket,) = gradaccum.all_reduce().plan(params)
    assert bucket.tail
    assert bucket.reduce_dtype is None
    assert bucket.nbytes == bucket.numel * 4


def test_bf16_wire_sends_the_gradients_in_bf16_and_the_tail_apart_in_float32() -> None:
    params = f32_params()
    grads_bucket, tail = gradaccum.all_reduce(reduce_dtype=BF16).plan(params)
    numel = sum(v.numel() for v in params.values())
    assert (grads_bucket.dtype, grads_bucket.reduce_dtype) == (F32, BF16)
    assert (grads_bucket.numel, grads_bucket.nbytes, grads_bucket.tail) == (numel, 2 * numel, False)
    assert (tail.dtype, tail.reduce_dtype, tail.paths) == (F32, None, ())
    assert (tail.numel, tail.nbytes, tail.tail) == (2, 8, True)


def test_the_tail_rides_in_the_widest_bucket_sent_as_is() -> None:
    params = {"a": torch.zeros(3, dtype=F64), "b": torch.zeros(4)}
    plan = gradaccum.all_reduce(reduce_dtype=F32).plan(params)
    assert [(b.dtype, b.reduce_dtype, b.numel, b.tail) for b in plan] == [
        (F32, None, 6, True),  # already float32: sent as is, with the tail
        (F64, F32, 3, False),  # float64 sums sent in float32
    ]
    plan = gradaccum.all_reduce(reduce_dtype=BF16).plan(params)
    assert [(b.dtype, b.reduce_dtype, b.numel, b.tail) for b in plan] == [
        (F32, BF16, 4, False),
        (F64, BF16, 3, False),
        (F64, None, 2, True),  # nothing is sent as is: a float64 tail of its own
    ]


def test_a_wire_dtype_equal_to_the_accumulation_dtype_changes_nothing() -> None:
    params = f32_params()
    assert gradaccum.all_reduce(reduce_dtype=F32).plan(params) == gradaccum.all_reduce().plan(
        params
    )


def test_float32_wire_for_bf16_accumulators_goes_the_other_way() -> None:
    params = {"w": torch.zeros(8, dtype=BF16)}
    grads_bucket, tail = gradaccum.all_reduce(reduce_dtype=F32).plan(params, accum_dtype=BF16)
    assert (grads_bucket.dtype, grads_bucket.reduce_dtype, grads_bucket.nbytes) == (BF16, F32, 32)
    assert (tail.dtype, tail.numel, tail.tail) == (F32, 2, True)


@pytest.mark.parametrize(
    ("value", "exc", "got"),
    [("bf16", TypeError, "str 'bf16'"), (torch.int32, ValueError, "torch.int32")],
)
def test_reduce_dtype_must_be_a_floating_dtype(value: Any, exc: type[Exception], got: str) -> None:
    message = (
        f"{WHERE}reduce_dtype must be a floating torch.dtype, got {got}; pass e.g. "
        f"reduce_dtype=torch.bfloat16 (half the bytes of float32 on the wire), or None (the "
        f"default: each bucket in its accumulation dtype, exact)."
    )
    with pytest.raises(exc, match=rf"\A{re.escape(message)}\Z"):
        gradaccum.all_reduce(reduce_dtype=value)


# -- one process: the cast path runs, the record shows the wire --------------------------------


def summed(path: str, sync: Any, params: Any, batch: Any) -> Any:
    """The sum over 2 micro-batches of 4 rows: ``accumulate`` (fast path) or ``Accumulator``."""
    if path != "accumulator":
        return gradaccum.accumulate(grad(sum_loss), 2, reduction="sum", sync=sync)(params, batch)
    acc = gradaccum.Accumulator(2, reduction="sum", sync=sync)
    state = acc.init(params)
    for i in range(2):
        mb = (batch[0][4 * i : 4 * i + 4], batch[1][4 * i : 4 * i + 4])
        state = acc.add(state, grad(sum_loss)(params, mb), size=4)
    got, _ = acc.finalize(state)
    return got


@pytest.mark.usefixtures("world_of_one")
@pytest.mark.parametrize("path", ["fast", "no-overlap", "accumulator"])
def test_world_of_one_bf16_wire_is_the_rounded_sum(path: str) -> None:
    params, batch = f32_params(), f32_batch(8)
    local = gradaccum.accumulate(grad(sum_loss), 2, reduction="sum")(params, batch)
    sync = gradaccum.all_reduce(reduce_dtype=BF16, overlap=path != "no-overlap")
    with gradaccum.sync.record_collectives() as log:
        got = summed(path, sync, params, batch)
    for k in params:
        assert got[k].dtype == F32
        assert torch.equal(got[k], local[k].bfloat16().float())
    wire = [(c.purpose, c.dtype, c.nbytes) for c in log if c.purpose == "gradients"]
    numel = sum(v.numel() for v in params.values())
    assert wire == [("gradients", BF16, 2 * numel), ("gradients", F32, 8)]


@pytest.mark.usefixtures("world_of_one")
def test_world_of_one_mean_with_a_bf16_wire_divides_by_the_exact_weight() -> None:
    params, batch = f32_params(), f32_batch(8)
    step = gradaccum.accumulate(grad(mean_loss), 2, sync=gradaccum.all_reduce(reduce_dtype=BF16))
    plain = gradaccum.accumulate(grad(mean_loss), 2)
    for _ in range(3):  # the first window, then windows with the last total as the hint
        got, want = step(params, batch), plain(params, batch)
        for k in params:
            assert torch.allclose(got[k], want[k], rtol=2**-7, atol=0)


# -- two ranks ---------------------------------------------------------------------------------


def _two_ranks(rank: int, world: int) -> dict[str, Any]:
    params = f32_params()
    batch = f32_batch(8, seed=10 + rank)  # different data on each rank
    out: dict[str, Any] = {}
    local = gradaccum.accumulate(grad(sum_loss), 2, reduction="sum")(params, batch)
    for k, v in local.items():  # every rank's local sum, for the references
        parts = [torch.empty_like(v) for _ in range(world)]
        dist.all_gather(parts, v)
        out[f"local {k}"] = parts
    for path in ("fast", "no-overlap", "accumulator"):
        for wire in (None, BF16):
            sync = gradaccum.all_reduce(reduce_dtype=wire, overlap=path != "no-overlap")
            with gradaccum.sync.record_collectives() as log:
                got = summed(path, sync, params, batch)
            out[f"{path} {wire}"] = got
            out[f"{path} {wire} log"] = [
                (c.dtype, c.nbytes) for c in log if c.purpose == "gradients"
            ]
    # Ranks that disagree on the wire dtype raise before any gradient is sent.
    mine = gradaccum.all_reduce(reduce_dtype=BF16 if rank == 0 else None)
    try:
        gradaccum.accumulate(grad(sum_loss), 2, reduction="sum", sync=mine)(params, batch)
        out["mismatch"] = None
    except gradaccum.GradAccumError as err:
        out["mismatch"] = str(err)
    return out


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_two_ranks_bf16_wire_equals_the_cast_sum_cast_back_reference() -> None:
    results = values(run(_two_ranks))
    numel = sum(v.numel() for v in f32_params().values())
    for r, out in enumerate(results):
        for path in ("fast", "no-overlap", "accumulator"):
            exact, wire = out[f"{path} None"], out[f"{path} {BF16}"]
            for k in exact:
                g0, g1 = out[f"local {k}"]
                reference = (g0.bfloat16().float() + g1.bfloat16().float()).bfloat16().float()
                assert torch.equal(wire[k], reference), (r, path, k)
                assert torch.equal(exact[k], g0 + g1), (r, path, k)
                # Two bf16 roundings of each rank's sum and one of the total.
                bound = 2**-7 * (g0.abs() + g1.abs())
                assert bool(((wire[k] - exact[k]).abs() <= bound).all()), (r, path, k)
            assert out[f"{path} None log"] == [(F32, 4 * (numel + 2))]
            assert out[f"{path} {BF16} log"] == [(BF16, 2 * numel), (F32, 8)]
        assert out["mismatch"] is not None
        assert "the ranks disagree on the gradients to synchronise" in out["mismatch"]
        assert "sent as bfloat16" in out["mismatch"]


# -- devices: an empty layout's bucket ---------------------------------------------------------


def test_an_empty_layouts_bucket_is_on_the_given_device() -> None:
    lay = gradaccum._layout.make_layout("test", {}, None)
    (bucket,) = buckets.make_plan(lay, 2**20, device=torch.device("meta")).buckets
    assert (bucket.device, bucket.tail, bucket.paths) == (torch.device("meta"), True, ())
    (bucket,) = buckets.make_plan(lay, 2**20).buckets
    assert bucket.device == torch.device("cpu")


@pytest.mark.usefixtures("world_of_one")
def test_an_empty_layouts_bucket_goes_to_the_nccl_groups_device(monkeypatch: Any) -> None:
    assert gradaccum.all_reduce().plan({})[0].device == torch.device("cpu")  # gloo
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    (bucket,) = gradaccum.all_reduce().plan({})
    assert (bucket.device, bucket.tail) == (torch.device("cuda", 1), True)
