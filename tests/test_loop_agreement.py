"""Ranks whose ``loop.windows`` disagree, or whose data raises, all raise: promptly, none hangs.

Each case runs on 2 gloo ranks with a process-group timeout of 60 s and gradaccum's own timeout
unset, so that "promptly" means: in the next collective, not at a timeout. Every rank must end
in an error (``GradAccumError`` on the rank that did nothing wrong, its own error on the rank
whose data raised), within a few seconds, with nothing yielded after the disagreement.
"""

from __future__ import annotations

import time
from typing import Any

import dist
import pytest

import gradaccum
from gradaccum.loop import windows

pytestmark = pytest.mark.distributed


class Broken:
    """A sized iterable that raises at micro-batch ``at`` (``None``: never)."""

    def __init__(self, length: int, at: int | None) -> None:
        self.length, self.at = length, at

    def __len__(self) -> int:
        return self.length

    def __iter__(self):
        for i in range(self.length):
            if i == self.at:
                raise OSError(f"disk read failed at micro-batch {i}")
            yield i


class Unsized:
    def __init__(self, length: int, at: int | None = None) -> None:
        self.length, self.at = length, at

    def __iter__(self):
        for i in range(self.length):
            if i == self.at:
                raise OSError(f"disk read failed at micro-batch {i}")
            yield i


def _loop(rank: int, world: int, case: str) -> dict[str, Any]:
    sync = gradaccum.all_reduce()
    kwargs: dict[str, Any] = {"sync": sync}
    data: Any = list(range(8))
    n: Any = 2
    if case == "n":
        n = 2 if rank == 0 else 4
    elif case == "schedule":
        n = 2 if rank == 0 else (lambda i: 2 if i == 0 else 3)
    elif case == "epochs":
        kwargs["epochs"] = 1 if rank == 0 else 2
    elif case == "endless":
        kwargs["epochs"] = 2 if rank == 0 else None
    elif case == "sized":
        data = list(range(8)) if rank == 0 else Unsized(8)
    elif case == "factory raises":

        def make(epoch: int) -> list[int]:
            if rank == 1:
                raise OSError("no such file: shard-1.bin")
            return list(range(8))

        data = make
    elif case == "len raises":
        data = list(range(8)) if rank == 0 else _NoLen()
    elif case == "peek raises":  # data without len(): read before the window's agreement
        data = Unsized(8, at=2 if rank == 1 else None)
    started = time.monotonic()
    got: list[list[int]] = []
    try:
        for window in windows(data, n, **kwargs):
            got.append(list(window))
    except Exception as err:  # noqa: BLE001 - reported to the test
        return {
            "error": type(err).__name__,
            "message": str(err),
            "got": got,
            "seconds": time.monotonic() - started,
        }
    return {"error": None, "got": got, "seconds": time.monotonic() - started}


class _NoLen:
    def __len__(self) -> int:
        raise OSError("the dataset's index file is missing")  # a broken __len__

    def __iter__(self):
        yield from range(8)


CASES = {
    "n": "the ranks disagree on the windows' sizes (n) (epoch 0): this rank's windows hold "
    "[{mine}] micro-batches, another rank's differ; pass the same n (or schedule) on every "
    "rank. Nothing was yielded.",
    "schedule": "the ranks disagree on the windows' sizes (n)",
    "epochs": "the ranks disagree on epochs (epoch 0): between 1 and 2 over the ranks; pass the "
    "same epochs= on every rank. Nothing was yielded.",
    "endless": "the ranks disagree on epochs (epoch 0): between None and 2 over the ranks",
    "sized": "the ranks disagree on whether the data has a len() (epoch 0): some ranks' data "
    "has a len(), others' has none; give every rank data of the same kind. Nothing was yielded.",
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_ranks_built_differently_all_raise(case: str) -> None:
    r0, r1 = dist.values(dist.run(_loop, case, timeout=120))
    for rank, got in enumerate((r0, r1)):
        assert got["error"] == "GradAccumError", (rank, got)
        assert got["got"] == []
        assert got["seconds"] < 20
        expected = CASES[case]
        if "{mine}" in expected:
            sizes = ", ".join(["2" if rank == 0 else "4"] * 8)
            expected = expected.format(mine=sizes)
        assert expected in got["message"], (rank, got["message"])
        assert got["message"].startswith("windows(data, n=")


@pytest.mark.parametrize("case", ["factory raises", "len raises", "peek raises"])
def test_a_data_error_on_one_rank_fails_every_rank(case: str) -> None:
    r0, r1 = dist.values(dist.run(_loop, case, timeout=120))
    assert r0["error"] == "GradAccumError", r0
    assert "another rank raised an error while" in r0["message"]
    assert "The cause is in the failing rank's traceback." in r0["message"]
    expected = {"factory raises": "OSError", "len raises": "OSError", "peek raises": "OSError"}
    assert r1["error"] == expected[case], r1
    assert r0["seconds"] < 20
    assert r1["seconds"] < 20
    if case == "peek raises":  # the windows before the failing read went through on both
        assert r0["got"] == r1["got"] == [[0, 1]]


def _after_error(rank: int, world: int) -> str:
    data = windows(Unsized(8, at=2 if rank == 1 else None), 2, sync=gradaccum.all_reduce())
    try:
        for window in data:
            list(window)
    except Exception:  # noqa: BLE001, S110 - the error of the test above
        pass
    try:
        for window in data:
            list(window)
    except RuntimeError as err:
        return str(err)
    return "no error"


def test_the_windows_refuse_to_go_on_after_a_data_error() -> None:
    r0, r1 = dist.values(dist.run(_after_error, timeout=120))
    assert r0 == (
        "windows(data, n=2): the windows cannot go on: another rank's data raised before window "
        "1, and the position of its iterator is lost; resume from a checkpoint "
        "(gradaccum.loop.load) in a new run."
    )
    assert r1.startswith("windows(data, n=2): the windows cannot go on: the data raised OSError")


def _different_places(rank: int, world: int, sized: bool) -> dict[str, Any]:
    def make() -> Any:
        return windows(list(range(8)) if sized else Unsized(8), 2, sync=gradaccum.all_reduce())

    data = make()
    if rank == 1:  # resumed from another checkpoint: one window further
        ahead = windows(list(range(8)), 2)
        loop = iter(ahead)
        list(next(loop))
        next(loop)
        position = ahead.state_dict()
        if not sized:
            position["identity"] = {"kind": "Unsized"}
        data.load_state_dict(position)
    started = time.monotonic()
    try:
        got = [list(w) for w in data]
    except gradaccum.GradAccumError as err:
        return {"message": str(err), "seconds": time.monotonic() - started}
    return {"message": None, "got": got}


@pytest.mark.parametrize("sized", [True, False], ids=["sized", "without-len"])
def test_ranks_at_different_places_all_raise(sized: bool) -> None:
    """Ranks resumed from different checkpoints raise before any window (they paired windows
    of different indices silently when the agreement did not carry the position)."""
    r0, r1 = dist.values(dist.run(_different_places, sized, timeout=120))
    for got in (r0, r1):
        assert got["message"] is not None, got
        assert got["seconds"] < 20
        assert "the ranks are at different places in the data" in got["message"]
    expected = (
        "this rank is at window 0 of epoch 0, the ranks' epochs range from 0 to 0 and their "
        "windows from 0 to 1"
    )
    assert expected in r0["message"]


def _uneven_job(rank: int, path: str, save: bool, resume: bool) -> Any:
    import torch

    from gradaccum import loop

    torch.manual_seed(0)
    model = torch.nn.Linear(5, 1).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(rank)
    f64 = torch.float64
    rows = [(torch.randn(2, 5, generator=g, dtype=f64), torch.randn(2, 1, generator=g, dtype=f64))]
    micro = rows * (7 if rank == 0 else 5)  # windows of [3, 3], [3, 2], [1, 0]
    data = windows(micro, 3, sync=gradaccum.all_reduce(timeout=20))

    def mse(m: Any, b: Any) -> Any:
        return torch.nn.functional.mse_loss(m(b[0]), b[1])

    step = loop.Step(model, mse, opt, data=data)
    if resume:
        loop.load(path, step)
    for window in data:
        for batch in window:
            step.add(batch)
        if save and window.index == 2:  # the documented idiom, in the uneven last window
            loop.save(path, step)
            return None
        step.apply()
    return [p.detach().clone() for p in model.parameters()]


def _uneven_resume(rank: int, world: int, path: str) -> bool:
    import torch

    whole = _uneven_job(rank, path + "/unused", save=False, resume=False)
    _uneven_job(rank, path, save=True, resume=False)
    again = _uneven_job(rank, path, save=False, resume=True)
    return all(torch.equal(a, b) for a, b in zip(whole, again))


def test_a_save_in_an_uneven_last_window_resumes_bit_identically(tmp_path) -> None:
    """Rank 1's data ran out in window 1 (2 of 3 micro-batches): its position at window 2 is
    its data's end, not window 2's start; it was refused there (and rank 0 waited)."""
    assert dist.values(dist.run(_uneven_resume, str(tmp_path), timeout=120)) == [True, True]
