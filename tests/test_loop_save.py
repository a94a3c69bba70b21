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
import tempfile
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


def raises(error: type[Exception], message: str):
    """``pytest.raises`` of the whole message."""
    return pytest.raises(error, match=f"^{re.escape(message)}$")


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
# Each cut trains twice (2 s): one of each kind runs in the fast tier, the others in the slow one.
FAST_CUTS = [("add", 3, 1), ("before apply", 1, 4), ("after apply", 4, 0)]


@functools.lru_cache
def whole(sync: bool = False) -> dict[str, Any]:
    torch.manual_seed(0)
    got = train(None, sync=gradaccum.all_reduce() if sync else None)
    assert got is not None
    return got


@pytest.mark.parametrize(
    "cut",
    [c if c in FAST_CUTS else pytest.param(c, marks=pytest.mark.slow) for c in CUTS],
    ids=[f"{k}-{w}-{m}".replace(" ", "_") for k, w, m in CUTS],
)
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
    step = Step(
        model, mse, optimizer=opt, scheduler=sched, clip=1.0, reduction=reduction, sync=sync
    )
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


# -- refusals: each leaves the step, the data and the random states bit-identical ---------------


def state_of(step: Step, data) -> dict[str, Any]:
    """Everything a load may change, copied: the step (model, optimizer, scheduler, window),
    the data position, the random states."""
    return copy.deepcopy(
        {
            "step": step.state_dict(),
            "data": data.state_dict(),
            "rng": [torch.get_rng_state(), random.getstate()],
        }
    )


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A mid-window checkpoint (window 2, 2 micro-batches added) of the run of seed 0."""
    path = tmp_path_factory.mktemp("checkpoint")
    torch.manual_seed(0)
    step, data = build()
    advance(step, data, (2, 2))
    save(path, step, data=data)
    return path


def refused(path, error: type[Exception], message: str, **options) -> None:
    """A step and data a little way into a run of their own refuse ``path``, unchanged."""
    torch.manual_seed(7)
    step, data = build(seed=1, **options)
    advance(step, data, (1, 2))
    before = state_of(step, data)
    with raises(error, message):
        load(path, step, data=data)
    assert equal(state_of(step, data), before)


FIX_MODEL = "build the model as the one that was saved (the same shapes and dtype)."
STEPS = {
    "model-shape": (
        {"hidden": 9},
        "the checkpoint's model does not fit this model: '0.weight' is a float64 tensor of "
        f"shape (8, 5) in the checkpoint, but a float64 tensor of shape (9, 5) in this model; "
        f"{FIX_MODEL}",
    ),
    "model-dtype": (
        {"dtype": torch.float32},
        "the checkpoint's model does not fit this model: '0.weight' is a float64 tensor of "
        f"shape (8, 5) in the checkpoint, but a float32 tensor of shape (8, 5) in this model; "
        f"{FIX_MODEL}",
    ),
    "optimizer-kind": (
        {"opt": "sgd"},
        "the checkpoint's optimizer is AdamW, this one SGD; its state (momentum, moments) "
        "holds only for the optimizer it came from: build the optimizer as AdamW(...), as in "
        "the run that was saved.",
    ),
    "optimizer-groups": (
        {"opt": "groups"},
        "the checkpoint's optimizer has 1 parameter group(s), this one 2; build the optimizer "
        "over the same parameter groups as the one that was saved.",
    ),
    "no-scheduler": (
        {"scheduler": None},
        "the saved step has a scheduler, this one has none; build the Step as the one that "
        "was saved.",
    ),
    "scheduler-kind": (
        {"scheduler": "step"},
        "the checkpoint's scheduler is LambdaLR, this one StepLR; build the scheduler as "
        "LambdaLR(...), as in the run that was saved.",
    ),
    "reduction": (
        {"reduction": "sum"},
        "the checkpoint's Step has reduction='mean', this one reduction='sum'; the window's "
        "running sums hold for the reduction they were taken with: build the Step with "
        "reduction='mean'.",
    ),
    "frozen": (
        {"freeze": True},
        "the checkpoint's step trained 6 parameter(s), this one 5: ['0.bias'] (1) not trained "
        "here (requires_grad=False); set requires_grad as in the run that was saved, before "
        "building the Step.",
    ),
}


@pytest.mark.parametrize("case", STEPS)
def test_a_step_that_does_not_fit_is_refused_unchanged(checkpoint, case) -> None:
    options, message = STEPS[case]
    refused(checkpoint, ValueError, f"{LOAD}: {message}", **options)


def edited(checkpoint: Path, tmp_path: Path, edit) -> Path:
    path = tmp_path / "edited"
    shutil.copytree(checkpoint, path)
    file = path / "rank0.pt"
    if callable(edit):
        edit(file)
    else:
        saved = torch.load(file, weights_only=True)
        torch.save({**saved, **edit}, file)
    return path


def _damage_window(file: Path) -> None:
    saved = torch.load(file, weights_only=True)
    saved["step"]["accumulator"]["weight"] = -1.0
    torch.save(saved, file)


def _drop_data(file: Path) -> None:
    saved = torch.load(file, weights_only=True)
    del saved["data"]
    torch.save(saved, file)


FILES = {
    "missing": (
        lambda file: file.unlink(),
        FileNotFoundError,
        "{file} does not exist; pass the directory gradaccum.loop.save() wrote (on as many "
        "ranks as saved it).",
    ),
    "truncated": (
        lambda file: file.write_bytes(file.read_bytes()[:2000]),
        gradaccum.GradAccumError,
        "{file} cannot be read by torch.load (RuntimeError): it was cut short (a copy or a "
        "save that did not finish) or is not a checkpoint; resume from a complete checkpoint.",
    ),
    "newer": (
        {"format": "gradaccum.loop.checkpoint/3"},
        gradaccum.GradAccumError,
        "{file} was written by a newer gradaccum (format 'gradaccum.loop.checkpoint/3'); this "
        "version reads 'gradaccum.loop.checkpoint/2': upgrade gradaccum to resume it.",
    ),
    "foreign": (
        lambda file: torch.save({"model": 1}, file),
        gradaccum.GradAccumError,
        "{file} is not a gradaccum.loop checkpoint (gradaccum.loop.checkpoint/2).",
    ),
    "world": (
        {"world": 2},
        gradaccum.GradAccumError,
        "rank0.pt was saved by rank 0 of 2 process(es), but this is rank 0 of 1; each rank's "
        "window and data position are its own: resume on 2.",
    ),
    "no-identity": (
        {"save": None},
        gradaccum.GradAccumError,
        "{file} is damaged (it lacks ['save']); resume from a complete checkpoint.",
    ),
    "damaged-window": (
        _damage_window,
        gradaccum.GradAccumError,
        "the checkpoint's window in progress does not load: Accumulator.load_state_dict(state, "
        "state_dict): weight is -1.0, expected a finite number >= 0 after 2 micro-batch(es) "
        "under reduction='count'; pass the dict that state_dict() returned (torch.load(path, "
        "weights_only=True)).",
    ),
    "no-data": (
        _drop_data,
        ValueError,
        "a data position is to be loaded but the checkpoint holds none; load only what was "
        "saved (save(path, step) saves the step's data too).",
    ),
}


@pytest.mark.parametrize("case", FILES)
def test_a_bad_file_is_refused_unchanged(checkpoint, tmp_path, case) -> None:
    edit, error, message = FILES[case]
    path = edited(checkpoint, tmp_path, edit)
    refused(path, error, f"{LOAD}: " + message.format(file=path / "rank0.pt"))


def test_a_checkpoint_of_the_older_format_names_its_version(tmp_path) -> None:
    # What gradaccum.loop.checkpoint/1 wrote without a sync: one file, a tag, no identity.
    model = make_model()
    opt, sched = make_optim(model)
    step = {
        "format": "gradaccum.loop.Step/1",
        "params": dict(model.named_parameters()),
        "optimizer": opt.state_dict(),
        "scheduler": sched.state_dict(),
        "accumulator": {"format": "gradaccum.AccumState/1"},
    }
    old = {"format": "gradaccum.loop.checkpoint/1", "rank": 0, "world": 1, "tag": [2, 2]}
    torch.save({**old, "shared": False, "step": step, "buffers": {}}, tmp_path / "rank0.pt")
    refused(
        tmp_path,
        gradaccum.GradAccumError,
        f"{LOAD}: {tmp_path / 'rank0.pt'} was written by an older gradaccum (format "
        "'gradaccum.loop.checkpoint/1', before checkpoints carried a save identity); this "
        "version reads 'gradaccum.loop.checkpoint/2'. Resume it with the gradaccum version "
        "that wrote it, or start a new run from its weights: they are under ['step']['params'] "
        "of shared.pt (of rank0.pt when saved without a sync).",
    )
    fresh = Step(model, mse, optimizer=opt)
    with raises(
        ValueError,
        (
            "Step.load_state_dict(state_dict): the state has format 'gradaccum.loop.Step/1', but "
            "this gradaccum reads 'gradaccum.loop.Step/2'; load it with the gradaccum version that "
            "saved it."
        ),
    ):
        fresh.load_state_dict({**step, "model": model.state_dict()})


def test_files_of_two_saves_never_mix(tmp_path, world_of_one) -> None:
    """Two runs saved at the same point (the same window and micro-step) in one process, and
    two saves of one run: a shared.pt of one with a rank0.pt of the other is refused."""
    sync = gradaccum.all_reduce()
    for name, seed in (("a", 0), ("c", 1)):  # a and b: the same run, saved twice
        torch.manual_seed(seed)
        step, data = build(seed=seed, sync=sync)
        advance(step, data, (2, 2))
        save(tmp_path / name, step, data=data)
        if name == "a":
            save(tmp_path / "b", step, data=data)
    for other in ("b", "c"):
        mixed = tmp_path / f"a+{other}"
        shutil.copytree(tmp_path / "a", mixed)
        shutil.copy(tmp_path / other / "rank0.pt", mixed / "rank0.pt")
        refused(
            mixed,
            gradaccum.GradAccumError,
            f"{LOAD}: shared.pt and rank0.pt are from different saves (a save was cut short, "
            f"or two runs saved into {mixed}); resume from a checkpoint that every rank saved "
            f"at once.",
            sync=sync,
        )
    a = torch.load(tmp_path / "a" / "rank0.pt", weights_only=True)["save"]
    b = torch.load(tmp_path / "b" / "rank0.pt", weights_only=True)["save"]
    c = torch.load(tmp_path / "c" / "rank0.pt", weights_only=True)["save"]
    # One process group: one token (test_two_runs_never_mix: two runs, two tokens); the
    # saves are counted.
    assert a[0] == b[0] == c[0]
    assert [b[1] - a[1], c[1] - a[1]] == [1, 2]


def test_a_step_state_dict_is_all_or_nothing() -> None:
    torch.manual_seed(0)
    step, data = build()
    advance(step, data, (1, 2))
    saved = copy.deepcopy(step.state_dict())
    other, _ = build(seed=1, opt="sgd")
    before = copy.deepcopy(other.state_dict())
    with pytest.raises(ValueError, match=re.escape("the checkpoint's optimizer is AdamW")):
        other.load_state_dict(saved)
    assert equal(other.state_dict(), before)
    again, _ = build(seed=2)
    again.load_state_dict(saved)
    assert equal(again.state_dict(), saved)


# -- save's arguments ---------------------------------------------------------------------------


def test_a_path_that_names_no_directory_is_refused_before_anything_is_written(
    tmp_path, monkeypatch
) -> None:
    monkeypatch.chdir(tmp_path)
    step, data = build()
    advance(step, data, (0, 1))
    (tmp_path / "a-file").write_text("kept")
    for call, name in ((save, SAVE), (load, LOAD)):
        with raises(
            ValueError,
            (
                f"{name}: path is '', which names no directory; pass the checkpoint's directory, "
                f"e.g. 'checkpoints/run1' ('.' for the current one)."
            ),
        ):
            call("", step, data=data)
        with raises(
            TypeError,
            (
                f"{name}: path must be a directory's path (a str or os.PathLike), got NoneType "
                f"None; pass e.g. 'checkpoints/run1'."
            ),
        ):
            call(None, step, data=data)
        with raises(
            ValueError,
            (
                f"{name}: path {str(tmp_path / 'a-file')!r} is a file, but a checkpoint is a "
                f"directory (of rank{{r}}.pt and shared.pt); pass a directory's path."
            ),
        ):
            call(tmp_path / "a-file", step, data=data)
    assert sorted(f.name for f in tmp_path.iterdir()) == ["a-file"]
    assert (tmp_path / "a-file").read_text() == "kept"


def test_save_counts_itself_and_checks_its_arguments(tmp_path, monkeypatch) -> None:
    step, data = build()
    advance(step, data, (0, 1))
    assert getattr(step, "_saves", 0) == 0
    save(tmp_path / "a", step, data=data)
    save(tmp_path / "b", step=step, data=data)  # step= as a keyword still works
    assert step._saves == 2  # carried into the boundary (a save some ranks missed fails it)
    with raises(
        ValueError,
        f"{SAVE}: step and data are both None; pass a step, data= or both.",
    ):
        save(tmp_path)
    with raises(
        TypeError,
        f"{SAVE}: step must be a gradaccum.loop.Step, got Sequential; pass the Step that trains "
        f"the model (gradaccum.loop.Step(model, loss, optimizer)).",
    ):
        save(tmp_path, step.model)
    # data defaults to the step's (Step(..., data=)); another is refused.
    monkeypatch.setattr(step, "data", data, raising=False)
    save(tmp_path / "c", step)
    assert "data" in torch.load(tmp_path / "c" / "rank0.pt", weights_only=True)
    with raises(
        ValueError,
        (
            f"{SAVE}: data= is not the step's data (the windows given to Step(..., data=)); leave "
            f"data= out to use the step's."
        ),
    ):
        save(tmp_path / "d", step, data=windows(loader(), 4))
    assert not (tmp_path / "d").exists()
    # A micro-batch taken but not added.
    fresh = Step(make_model(), mse, optimizer=make_optim(make_model())[0])
    fed = windows(loader(), 4)
    next(iter(next(iter(fed))))
    with raises(
        ValueError,
        (
            f"{SAVE}: the step is at window 0 with 0 micro-batch(es) added, but the data at window "
            f"0 with 1 taken; save between step.add(batch) calls, or after step.apply(), with the "
            f"step fed by this data (step.add each micro-batch taken)."
        ),
    ):
        save(tmp_path / "e", fresh, data=fed)


# -- the data: Windows checks its own identity (length, batch size, sampler, n) at load ----------


@pytest.mark.parametrize("change", [{"n": 2}, {"n": 5}])
def test_a_changed_n_is_refused_at_load_unchanged(checkpoint, change) -> None:
    torch.manual_seed(7)
    step, data = build(seed=1, **change)
    before = state_of(step, data)
    n = change["n"]
    message = (
        f"windows(data, n={n}).load_state_dict(state_dict): the checkpoint was saved with "
        f"windows of n=4 (window sizes [4, 4, 4, 4, 4, 4, 4, 4] from window 0 on), but these "
        f"windows have {[n] * 8}; resume with the n of the run that saved (another n would "
        f"move every window boundary and optimizer step)."
    )
    with pytest.raises(gradaccum.GradAccumError, match=re.escape(message)):
        load(checkpoint, step, data=data)
    assert equal(state_of(step, data), before)


@pytest.mark.parametrize(
    ("rows", "batch_size", "what"),
    [
        (41, 3, "length is 14 micro-batches, the checkpoint's 13 micro-batches"),
        (26, 2, "batch size is 2 rows, the checkpoint's 3 rows"),
    ],
)
def test_a_changed_dataset_is_refused_at_load_unchanged(checkpoint, rows, batch_size, what) -> None:
    torch.manual_seed(7)
    step, _ = build(seed=1)
    x, y = xy(rows, 5)
    loader = DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=True)
    data = windows(loader, 4, epochs=2)
    before = state_of(step, data)
    with pytest.raises(gradaccum.GradAccumError, match=re.escape(what)):
        load(checkpoint, step, data=data)
    assert equal(state_of(step, data), before)


# -- over 2 ranks -------------------------------------------------------------------------------


def ranked(rank: int, seed: int = 0, hidden: int = 8):
    """Rank 0 holds 21 micro-batches of 2 rows, rank 1 holds 20; windows of 4 over two epochs:
    each epoch's last window (index 5, 11) holds 1 micro-batch on rank 0 and none on rank 1."""
    sync = gradaccum.all_reduce(timeout=60)
    model = make_model(seed, hidden)
    opt, sched = make_optim(model)
    step = Step(model, mse, optimizer=opt, scheduler=sched, clip=0.5, sync=sync)
    x, y = xy(82, 11)
    rows = slice(0, 42) if rank == 0 else slice(42, 82)
    shards = DataLoader(TensorDataset(x[rows], y[rows]), batch_size=2, shuffle=True)
    data = windows(shards, 4, epochs=2, sync=sync)
    if getattr(data, "sync", None) is None:  # Windows.sync (api.md), for data-only loads
        data.sync = sync
    torch.manual_seed(100 + rank)  # dropout and shuffling differ between the ranks
    return step, data


def run2(rank: int, path=None, cut=None, resume: bool = False, seed: int = 0):
    """A run over 2 ranks, saved at ``cut`` with the rank-independent idiom: ``("idiom", i)``
    after window i's loop, before ``apply()``; ``("after", i)`` after its ``apply()``;
    ``("add", i, m)`` mid-window, where both ranks hold m micro-batches."""
    step, data = ranked(rank, seed)
    if resume:
        torch.manual_seed(999)
        load(path, step, data=data)
    for window in data:
        for batch in window:
            step.add(batch)
            if cut == ("add", window.index, step.micro_step):
                save(path, step, data=data)
                return None
        if cut == ("idiom", window.index):
            save(path, step, data=data)
            return None
        step.apply()
        if cut == ("after", window.index):
            save(path, step, data=data)
            return None
    return trained(step.model, step.optimizer)


CUTS2 = [
    ("idiom", 5),  # the uneven last window: 1 micro-batch on rank 0, none on rank 1
    ("after", 5),  # after the window that was empty on rank 1
    ("idiom", 11),
    ("after", 11),  # the run's end
    ("add", 2, 3),
    ("idiom", 0),
]


def _resumes(rank: int, world: int, root: str) -> list[Any]:
    whole = run2(rank)
    out: list[Any] = []
    for k, cut in enumerate(CUTS2):
        path = Path(root) / str(k)
        assert run2(rank, path, cut) is None
        try:
            out.append(equal(run2(rank, path, resume=True), whole))
        except Exception as err:  # noqa: BLE001 - reported to the test
            out.append(f"{type(err).__name__}: {err}")
    return out


@pytest.mark.distributed
def test_uneven_and_empty_windows_resume_bit_identically(tmp_path) -> None:
    """Saved while the ranks hold different micro-step counts, or after a window that was
    empty on one rank: both load (they were refused before the save identity), and resume
    bit-identically on both ranks."""
    r0, r1 = dist.values(dist.run(_resumes, str(tmp_path), timeout=300))
    assert r0 == r1 == [True] * len(CUTS2)


def _save_twice(rank: int, world: int, root: str) -> None:
    """One run saves twice at window 2 (before apply), step and data, and data alone."""
    step, data = ranked(rank)
    advance(step, data, (2, 3))
    for name in ("a", "b"):
        save(Path(root) / name, step, data=data)
        save(Path(root) / f"{name}-data", data=data)


def _refusals(rank: int, world: int, root: str, cases: list[tuple[str, str]]) -> list[Any]:
    """Load each case's directory into a step and data of their own (or data alone): what
    each rank raised, and whether everything is as it was."""
    out = []
    for name, kind in cases:
        hidden = 9 if kind == "model on rank 1" and rank == 1 else 8
        step, data = ranked(rank, seed=1, hidden=hidden)
        if kind == "step":
            advance(step, data, (1, 2))
        before = state_of(step, data)
        with gradaccum.sync.record_collectives() as log:
            try:
                if kind == "data":
                    load(Path(root) / name, data=data)
                else:
                    load(Path(root) / name, step, data=data)
                got: tuple[str, str] | str = "loaded"
            except Exception as err:  # noqa: BLE001 - reported to the test
                got = (type(err).__name__, str(err))
        logged = [(c.kind, c.purpose) for c in log]
        out.append((got, equal(state_of(step, data), before), logged))
    return out


@pytest.mark.distributed
def test_two_runs_never_mix_and_a_refusal_is_every_ranks(tmp_path) -> None:
    """Two runs, identical but for their identity, save at the same point into the same
    directory names; files of the two, of two saves of one run, or one rank's file cut short
    or missing: refused on every rank, and nothing changed on any rank."""
    for run in ("r1", "r2"):
        dist.values(dist.run(_save_twice, str(tmp_path / run), timeout=180))
    cases = {
        "runs-step": ("step", "r2/a"),  # rank 1's file from the other run
        "runs-data": ("data", "r2/a-data"),
        "saves-step": ("step", "r1/b"),  # rank 1's file from the run's other save
        "saves-data": ("data", "r1/b-data"),
        "cut-short": ("step", None),
        "missing": ("step", None),
        "model": ("model on rank 1", None),
    }
    for name, (kind, other) in cases.items():
        path = tmp_path / name
        shutil.copytree(tmp_path / ("r1/a-data" if kind == "data" else "r1/a"), path)
        if other is not None:
            shutil.copy(tmp_path / other / "rank1.pt", path / "rank1.pt")
    (tmp_path / "cut-short" / "rank1.pt").write_bytes(
        (tmp_path / "cut-short" / "rank1.pt").read_bytes()[:3000]
    )
    (tmp_path / "missing" / "rank1.pt").unlink()
    listed = [(name, kind) for name, (kind, _) in cases.items()]
    r0, r1 = dist.values(dist.run(_refusals, str(tmp_path), listed, timeout=300))
    agreed = [("all_reduce", "checkpoint load"), ("all_reduce", "checkpoint verdict")]
    for (_, same0, log0), (_, same1, log1) in zip(r0, r1):
        assert (same0, same1) == (True, True)  # nothing changed on any rank
        assert log0 == log1 == agreed  # the refusal costs the two agreements, nothing more
    rank1 = {name: got1 for (name, _), (got1, _, _) in zip(listed, r1)}
    rank0 = {name: got0 for (name, _), (got0, _, _) in zip(listed, r0)}

    def other_refused(name: str) -> tuple[str, str]:
        return (
            "GradAccumError",
            f"{LOAD}: rank 1 refused the checkpoint in {tmp_path / name} (its error says why), "
            f"so no rank loads it; nothing was changed on this rank. Fix what rank 1's error "
            f"names, or resume from another checkpoint.",
        )

    for name in ("runs-step", "saves-step"):
        assert rank1[name] == (
            "GradAccumError",
            f"{LOAD}: shared.pt and rank1.pt are from different saves (a save was cut short, or "
            f"two runs saved into {tmp_path / name}); resume from a checkpoint that every rank "
            f"saved at once.",
        )
        assert rank0[name] == other_refused(name)
    runs, saves = tmp_path / "runs-data", tmp_path / "saves-data"
    assert rank0["runs-data"] == rank1["runs-data"]
    assert rank0["runs-data"] == (
        "GradAccumError",
        f"{LOAD}: the ranks' files in {runs} are from different runs (two runs saved into it, "
        f"and a save was cut short); nothing was loaded on any rank: resume from a checkpoint "
        f"that every rank of one run saved.",
    )
    assert rank0["saves-data"] == rank1["saves-data"]
    assert rank0["saves-data"] == (
        "GradAccumError",
        f"{LOAD}: the ranks' files in {saves} are from different saves of one run (saves 2 and "
        f"4): a save was cut short, or not every rank saved; nothing was loaded on any rank: "
        f"resume from a checkpoint that every rank saved at once.",
    )
    assert rank1["cut-short"] == (
        "GradAccumError",
        f"{LOAD}: {tmp_path / 'cut-short' / 'rank1.pt'} cannot be read by torch.load "
        f"(RuntimeError): it was cut short (a copy or a save that did not finish) or is not a "
        f"checkpoint; resume from a complete checkpoint.",
    )
    assert rank1["missing"] == (
        "FileNotFoundError",
        f"{LOAD}: {tmp_path / 'missing' / 'rank1.pt'} does not exist; pass the directory "
        f"gradaccum.loop.save() wrote (on as many ranks as saved it).",
    )
    assert rank1["model"][0] == "ValueError"
    assert rank1["model"][1].startswith(f"{LOAD}: the checkpoint's model does not fit this model")
    for name in ("cut-short", "missing", "model"):
        assert rank0[name] == other_refused(name)


def _late_writer(rank: int, world: int, root: str) -> bool:
    """Rank 0 saves late; rank 1 saves and loads at once: its load waits for rank 0's."""
    whole = run2(rank)
    step, data = ranked(rank)
    advance(step, data, (2, 3))
    if rank == 0:
        time.sleep(2.0)
    save(root, step, data=data)
    return equal(run2(rank, root, resume=True), whole)


@pytest.mark.distributed
def test_load_waits_until_every_rank_has_saved(tmp_path) -> None:
    assert dist.values(dist.run(_late_writer, str(tmp_path), timeout=180)) == [True, True]


def _one_rank_saves(rank: int, world: int, root: str) -> dict[str, Any]:
    step, data = ranked(rank)
    advance(step, data, (1, 4))
    with gradaccum.sync.record_collectives() as log:
        if rank == 0:  # a save reached by one rank only
            save(root, step, data=data)
    out: dict[str, Any] = {"logged": list(log), "saves": getattr(step, "_saves", 0)}
    try:
        step.apply()
        out["apply"] = "no error"
    except Exception as err:  # noqa: BLE001 - reported to the test
        out["apply"] = f"{type(err).__name__}: {err}"
    return out


@functools.lru_cache
def one_rank_saves() -> tuple[dict[str, Any], ...]:
    return tuple(dist.values(dist.run(_one_rank_saves, tempfile.mkdtemp(), timeout=180)))


@pytest.mark.distributed
def test_a_save_on_one_rank_returns_and_counts_itself() -> None:
    r0, r1 = one_rank_saves()
    assert (r0["logged"], r0["saves"], r1["saves"]) == ([], 1, 0)  # no collective: no hang


@pytest.mark.distributed
def test_a_save_on_one_rank_fails_the_next_boundary_on_every_rank() -> None:
    r0, r1 = one_rank_saves()
    assert r0["apply"].startswith("GradAccumError: ")
    assert r1["apply"].startswith("GradAccumError: ")
