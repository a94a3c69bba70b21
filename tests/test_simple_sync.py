"""The simple tier of the sync protocol, tried as a hostile user would: a ``Sync`` that only
overrides ``reduce`` (and ``describe``), with what it returns wrong, its options different
across ranks, and one rank raising. Compared with the whole-batch gradient in float64."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from dist import run, values

import gradaccum
from gradaccum.sync import Sync

X = torch.arange(24, dtype=torch.float64).reshape(6, 4) / 10
PARAMS = {"w": torch.ones(4, dtype=torch.float64), "b": torch.zeros(3, dtype=torch.float64)}
CALL = "accumulate(f, n=2)(...)"


def f(p: dict[str, torch.Tensor], x: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"w": x.mean(0) * p["w"], "b": p["b"] + x[:, :3].mean(0)}


def whole_batch() -> dict[str, torch.Tensor]:
    return f(PARAMS, X)


class Returns(Sync):
    """A sync whose ``reduce`` returns what the test says."""

    def __init__(self, out: Any) -> None:
        self.out = out

    def reduce(self, spec: Any, shares: Any, state: Any, comm: Any) -> Any:
        return self.out(shares) if callable(self.out) else self.out


def test_the_identity_reduce_equals_the_whole_batch_in_one_process() -> None:
    step = gradaccum.accumulate(f, 2, sync=Returns(lambda shares: (shares, None)))
    got = step(PARAMS, X)
    for k, v in whole_batch().items():
        torch.testing.assert_close(got[k], v, rtol=0, atol=1e-15)


@pytest.mark.parametrize(
    ("out", "exc", "message"),
    [
        (
            lambda shares: shares,
            TypeError,
            f"{CALL}: Returns.reduce(spec, shares, state, comm) must return a pair (summed, "
            f"state), got list; return the summed tensors, one per leaf, and the "
            f"state for the next window (None if it keeps none).",
        ),
        (
            lambda shares: (shares[:1], None),
            TypeError,
            f"{CALL}: Returns.reduce(spec, shares, state, comm) returned list as the "
            f"summed gradients; expected a list of 2 tensors, one per leaf in spec.layout order, "
            f"each shaped like its share.",
        ),
        (
            lambda shares: ([s.reshape(1, -1) for s in shares], None),
            ValueError,
            f"{CALL}: Returns.reduce(spec, shares, state, comm) returned a tensor of shape (1, 3) "
            f"for leaf ['b'], whose share has shape (3,); return one tensor per leaf, shaped like "
            f"its share (reshape what a collective gave back).",
        ),
    ],
    ids=["not-a-pair", "too-few-leaves", "wrong-shape"],
)
def test_a_wrong_reduce_result_is_refused_with_its_name(out: Any, exc: type, message: str) -> None:
    step = gradaccum.accumulate(f, 2, sync=Returns(out))
    with pytest.raises(exc) as info:
        step(PARAMS, X)
    assert str(info.value) == message


class Describes(Sync):
    def __init__(self, lines: Any) -> None:
        self.lines = lines

    def describe(self) -> Any:
        return self.lines

    def reduce(self, spec: Any, shares: Any, state: Any, comm: Any) -> Any:
        return shares, state


def _describe_case(rank: int, world: int, lines: Any) -> Any:
    step = gradaccum.accumulate(f, 2, sync=Describes(lines))
    return step(PARAMS, X)


@pytest.mark.distributed
def test_describe_must_return_strings_on_every_rank() -> None:
    results = run(_describe_case, ("compress", 1))
    expected = (
        f"{CALL}: Describes.describe() must return a tuple of strings (the sync's options that "
        f"every rank must agree on), got tuple; return e.g. "
        f'(f"compress={{self.compress}}",), or () for none.'
    )
    for rank in range(2):
        assert results[rank][:2] == ("err", "TypeError"), results[rank]
        assert results[rank][2] == expected


def _differs(rank: int, world: int) -> Any:
    step = gradaccum.accumulate(f, 2, sync=Describes((f"compress={rank == 0}",)))
    return step(PARAMS, X)


@pytest.mark.distributed
def test_ranks_whose_options_differ_all_raise_before_any_gradient_moves() -> None:
    results = run(_differs)
    for rank in range(2):
        kind, name, message = results[rank][:3]
        assert (kind, name) == ("err", "GradAccumError"), results[rank]
        assert re.search(r"compress=(True|False)", message), message


def _raises_on_rank_1(rank: int, world: int) -> Any:
    def g(p: dict[str, torch.Tensor], x: torch.Tensor) -> dict[str, torch.Tensor]:
        if rank == 1:
            raise RuntimeError("rank 1's step failed")
        return f(p, x)

    step = gradaccum.accumulate(g, 2, sync=Describes(()))
    return step(PARAMS, X)


@pytest.mark.distributed
def test_a_fault_on_one_rank_ends_in_an_error_on_every_rank() -> None:
    results = run(_raises_on_rank_1)
    assert results[1][:3] == ("err", "RuntimeError", "rank 1's step failed")
    assert results[0][:3] == (
        "err",
        "GradAccumError",
        "accumulate(g, n=2)(...): 1 other rank(s) of the 2 in the group raised an error during "
        "this window (rank 0 did not); no gradient is returned on any rank. The cause is in the "
        "failing rank's traceback.",
    )


def _two_ranks_exact(rank: int, world: int) -> Any:
    half = X.tensor_split(world)[rank]

    class AllReduceShares(Sync):
        def reduce(self, spec: Any, shares: Any, state: Any, comm: Any) -> Any:
            for s in shares:
                comm.wait(comm.all_reduce(s, "a leaf", "gradients"), "a leaf")
            return shares, state

    step = gradaccum.accumulate(f, 2, sync=AllReduceShares())
    return {k: v.tolist() for k, v in step(PARAMS, half).items()}


@pytest.mark.distributed
def test_a_one_method_sync_equals_the_whole_batch_on_two_ranks() -> None:
    got = values(run(_two_ranks_exact))
    ref = whole_batch()
    for rank_result in got:
        for k, v in ref.items():
            torch.testing.assert_close(
                torch.tensor(rank_result[k], dtype=torch.float64), v, rtol=0, atol=1e-15
            )
