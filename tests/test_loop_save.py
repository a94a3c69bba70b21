"""gradaccum.loop.save / load: bit-identical resume, one identity per save, a load that is all or
nothing on every rank, the format version, and the refusals with their messages in full.

Every resume is compared with the uninterrupted run: ``torch.equal`` on the parameters, the
buffers and the optimizer state, in float64.
"""

from __future__ import annotations

import copy
import functools
import random
import re
import shutil
import time
from pathlib import Path
from typing import Any

import dist
import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import gradaccum
from gradaccum.loop import Step, load, save, windows

SAVE = "gradaccum.loop.save(path, step, data=...)"
LOAD = "gradaccum.loop.load(path, step, data=...)"


def make_model(seed: int = 0, hidden: int = 8, dtype: torch.dtype = torch.float64) -> nn.Module:
    """A model with dropout (the random states matter) and BatchNorm (buffers, per rank)."""
    torch.manual_seed(seed)
    layers = [nn.Linear(5, hidden), nn.BatchNorm1d(hidden), nn.Tanh(), nn.Dropout(0.2)]
    return nn.Sequential(*layers, nn.Linear(hidden, 1)).to(dtype)


def mse(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return F.mse_loss(model(x), y)


def make_optim(model: nn.Module, kind: str = "adamw", scheduler: str | None = "lambda"):
    if kind == "adamw":
        opt: torch.optim.Optimizer = torch.optim.AdamW(
            model.parameters(), lr=0.05, weight_decay=0.01
        )
    elif kind == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    else:  # two groups
        first, *rest = model.parameters()
        opt = torch.optim.AdamW([{"params": [first]}, {"params": rest}], lr=0.05)
    if scheduler == "lambda":
        return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))
    if scheduler == "step":
        return opt, torch.optim.lr_scheduler.StepLR(opt, 2)
    return opt, None


def xy(rows: int, seed: int, dtype: torch.dtype = torch.float64):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 5, generator=g).to(dtype), torch.randn(rows, 1, generator=g).to(dtype)


def loader(dtype: torch.dtype = torch.float64) -> DataLoader:
    x, y = xy(38, 5, dtype)
    return DataLoader(TensorDataset(x, y), batch_size=3, shuffle=True)  # 13 micro-batches


def equal(a: Any, b: Any) -> bool:
    """Bit-identical, recursively: tensors (values and dtype), dicts, lists, numbers."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and torch.equal(a, b)
        )
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(equal(x, z) for x, z in zip(a, b))
    return bool(a == b)


def trained(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """What the comparisons compare: parameters and buffers, optimizer state (copies)."""
    return copy.deepcopy({"model": model.state_dict(), "optimizer": opt.state_dict()})


# -- one process --------------------------------------------------------------------------------


def train(path, cut=None, resume=False, sync=None, refused=None) -> dict[str, Any] | None:
    """Two epochs of windows of 4 (the last window of each epoch short) with dropout and a
    shuffling loader: the random states, the data position and the window's running sums all
    matter for resuming. Returns what ``trained`` compares, or ``None`` when it stopped at
    ``cut``: ``(kind, window, micro-batches added)``.

    ``refused``: a checkpoint directory that ``load`` must refuse first, leaving no trace.
    """
    model = make_model()
    opt, sched = make_optim(model)
    step = Step(model, mse, optimizer=opt, scheduler=sched, clip=1.0, sync=sync)
    windowed = windows(loader(), 4, epochs=2, sync=sync)
    if resume:
        torch.manual_seed(999)  # a new process: everything random differs until load
        if refused is not None:
            with pytest.raises((gradaccum.GradAccumError, FileNotFoundError)):
                load(refused, step, data=windowed)
        load(path, step, data=windowed)
    for window in windowed:
        for batch in window:
            step.add(batch)
            if cut == ("add", window.index, step.micro_step):
                save(path, step, data=windowed)
                return None
        if cut == ("before apply", window.index, step.micro_step):
            save(path, step, data=windowed)
            return None
        step.apply()
        if cut == ("after apply", window.index + 1, 0):
            save(path, step, data=windowed)
            return None
    assert sched.last_epoch == 8  # ceil(13 / 4) = 4 windows an epoch
    return trained(model, opt)


CUTS = [
    ("add", 0, 1),
    ("add", 2, 3),
    ("add", 3, 1),  # the short last window of epoch 0
    ("before apply", 1, 4),
    ("before apply", 3, 1),
    ("after apply", 2, 0),
    ("after apply", 4, 0),  # between epochs
    ("add", 6, 2),
]


@functools.lru_cache
def whole(sync: bool = False) -> dict[str, Any]:
    torch.manual_seed(0)
    got = train(None, sync=gradaccum.all_reduce() if sync else None)
    assert got is not None
    return got


@pytest.mark.parametrize("cut", CUTS, ids=[f"{k}-{w}-{m}".replace(" ", "_") for k, w, m in CUTS])
def test_resume_is_bit_identical(tmp_path, cut) -> None:
    torch.manual_seed(0)
    assert train(tmp_path, cut=cut) is None
    assert equal(train(tmp_path, resume=True), whole())
    assert sorted(f.name for f in tmp_path.iterdir()) == ["rank0.pt"]


def build(seed: int = 0, sync=None, hidden: int = 8, dtype=torch.float64, **options):
    """A step and its windows as ``train`` builds them; ``options`` change the optimizer
    (``opt=``), the scheduler (``scheduler=``), the reduction, the trainable parameters
    (``freeze=True``) or ``n``."""
    model = make_model(seed, hidden, dtype)
    if options.get("freeze"):
        model[0].bias.requires_grad_(False)
    opt, sched = make_optim(model, options.get("opt", "adamw"), options.get("scheduler", "lambda"))
    reduction = options.get("reduction", "mean")
    step = Step(model, mse, optimizer=opt, scheduler=sched, clip=1.0, reduction=reduction, sync=sync)
    return step, windows(loader(dtype), options.get("n", 4), epochs=2, sync=sync)


def advance(step: Step, data, upto: tuple[int, int]) -> None:
    """Train until ``(window.index, step.micro_step) == upto``, and leave the loop there."""
    for window in data:
        for batch in window:
            step.add(batch)
            if (window.index, step.micro_step) == upto:
                return
        step.apply()


def test_under_a_sync_save_communicates_nothing_and_load_agrees_twice(
    tmp_path, world_of_one
) -> None:
    sync = gradaccum.all_reduce()
    torch.manual_seed(0)
    step, data = build(sync=sync)
    advance(step, data, (5, 2))
    with gradaccum.sync.record_collectives() as log:
        save(tmp_path, step, data=data)
    assert list(log) == []  # a save that only some ranks reach cannot hang
    assert sorted(f.name for f in tmp_path.iterdir()) == ["rank0.pt", "shared.pt"]
    step, data = build(seed=3, sync=sync)
    with gradaccum.sync.record_collectives() as log:
        load(tmp_path, step, data=data)
    assert [(c.kind, c.purpose, c.nbytes) for c in log] == [
        ("all_reduce", "checkpoint load", 8),  # every rank is in load: every save is written
        ("all_reduce", "checkpoint verdict", 48),  # a failure flag and the save's identity
    ]
    torch.manual_seed(0)
    assert train(tmp_path / "cut", cut=("add", 5, 2), sync=sync) is None
    assert equal(train(tmp_path / "cut", resume=True, sync=sync), whole(sync=True))


def test_a_refused_load_leaves_no_trace(tmp_path) -> None:
    torch.manual_seed(0)
    assert train(tmp_path / "good", cut=("add", 2, 3)) is None
    torch.manual_seed(1)
    assert train(tmp_path / "bad", cut=("add", 2, 3)) is None
    (tmp_path / "bad" / "rank0.pt").write_bytes((tmp_path / "bad" / "rank0.pt").read_bytes()[:999])
    resumed = train(tmp_path / "good", resume=True, refused=tmp_path / "bad")
    assert equal(resumed, whole())
