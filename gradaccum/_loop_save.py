"""``gradaccum.loop.save`` / ``load``: the whole training state, one call each way, mid-window too.

A checkpoint is a directory. Each rank writes ``rank{r}.pt``: its window in progress, the
model's buffers, its data position and its random states. Under a sync (the parameters,
optimizer and scheduler are the same on every rank) rank 0 also writes ``shared.pt`` with those,
once; without a sync each rank's file holds its own. Files are written to a temporary name and
renamed, and carry a tag that ``load`` compares, so a checkpoint cut short by a crash is refused.
"""

from __future__ import annotations

import os
import random
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ._errors import GradAccumError, describe
from ._loop_data import Windows
from ._loop_plan import Agreement, data_axes
from ._loop_step import Step

__all__ = ["load", "save"]

FORMAT = "gradaccum.loop.checkpoint/1"


def _where(verb: str) -> str:
    return f"gradaccum.loop.{verb}(path, step=..., data=...)"


def _check(where: str, step: Any, data: Any) -> None:
    if step is None and data is None:
        raise ValueError(f"{where}: step and data are both None; pass step=, data= or both.")
    if step is not None and not isinstance(step, Step):
        raise TypeError(f"{where}: step must be a gradaccum.loop.Step, got {describe(step)}.")
    if data is not None and not isinstance(data, Windows):
        raise TypeError(
            f"{where}: data must be what gradaccum.loop.windows() returned, got {describe(data)}."
        )


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def rng_state() -> dict[str, Any]:
    """The random states of this process: torch (CPU, CUDA), Python, NumPy if imported."""
    out: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        out["cuda"] = torch.cuda.get_rng_state_all()
    np = sys.modules.get("numpy")
    if np is not None:
        name, keys, pos, has_gauss, cached = np.random.get_state()
        out["numpy"] = [name, torch.from_numpy(keys.astype("int64")), pos, has_gauss, cached]
    return out


def set_rng_state(where: str, saved: dict[str, Any]) -> None:
    """Restore what ``rng_state`` returned."""
    cuda = saved.get("cuda")
    if cuda is not None and torch.cuda.device_count() != len(cuda):
        raise GradAccumError(
            f"{where}: the checkpoint holds the CUDA random states of {len(cuda)} device(s), "
            f"but this process sees {torch.cuda.device_count()}; resume on the same devices."
        )
    torch.set_rng_state(saved["torch"])
    random.setstate(saved["python"])
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)
    if saved.get("numpy") is not None:
        import numpy as np

        name, keys, pos, has_gauss, cached = saved["numpy"]
        np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))


def _data_position(where: str, step: Step, data: Windows[Any]) -> dict[str, Any]:
    """The data position to save, lined up with the step's window (see the module notes)."""
    d = data.state_dict()
    dw, taken, closed = d["window"], d["in_window"], d["closed"]
    sw, sm = step.window, step.micro_step
    current = data._current
    if sw == dw and sm == taken:
        return {**d, "closed": False}  # the loop ended but apply() is still to come
    if sw == dw + 1 and sm == 0:
        done = closed or (current is not None and current._len is not None and current._left == 0)
        if done:
            return {**d, "closed": True}
    raise ValueError(
        f"{where}: the step is at window {sw} with {sm} micro-batch(es) added, but the data at "
        f"window {dw} with {taken} taken; save between step.add(batch) calls, or after "
        f"step.apply(), with the step fed by this data (step.add each micro-batch taken)."
    )


def save(path: str | os.PathLike[str], *, step: Step | None = None, data: Any = None) -> None:
    """Save the whole training state to the directory ``path``, mid-window included.

    With ``step``: the model (parameters and buffers), the optimizer, the scheduler and the
    window in progress (its running sums and statistics). With ``data``: the data position
    (epoch, micro-batch, the random states of the epoch's iterator). Always: this process's
    random states (torch CPU and CUDA, Python's ``random``, NumPy's if imported).
    [`load()`][gradaccum.loop.load] resumes bit-identically: the same updates, on every rank.

    Every rank calls it at the same point of the loop (between ``step.add`` calls, or after
    ``step.apply()``). Under the step's sync, rank 0 writes the parameters, optimizer and
    scheduler once (``shared.pt``), each rank its own part (``rank{r}.pt``), and one 8-byte
    all-reduce (logged as ``"checkpoint"``) makes it return when every rank's files are
    written. Without a sync each rank writes all of its state to its own file, and returns.
    For sharded parameters (a [`reduce_scatter()`][gradaccum.reduce_scatter] sync, FSDP2),
    save them, their optimizer and the accumulator with
    [`dcp_save()`][gradaccum.sync.dcp_save], and the data position and random states here
    (``save(path, data=data)``).

    Args:
        path: A directory (created if missing); files in it are replaced.
        step: The [`Step`][gradaccum.loop.Step] to save, or ``None``.
        data: The [`Windows`][gradaccum.loop.Windows] feeding it, or ``None``.

    Raises:
        TypeError: ``step`` or ``data`` is of the wrong kind.
        ValueError: Neither is given, or the step and the data are at different windows (a
            micro-batch taken but not added).

    Examples:
        >>> import tempfile, torch, gradaccum
        >>> from gradaccum.loop import Step, load, save, windows
        >>> def run(stop=None, resume=None):
        ...     torch.manual_seed(0)
        ...     model = torch.nn.Linear(2, 1)
        ...     opt = torch.optim.SGD(model.parameters(), lr=0.1)
        ...     step = Step(model, lambda m, x: m(x).pow(2).mean(), optimizer=opt)
        ...     data = windows([torch.randn(3, 2) for _ in range(5)], 2)
        ...     if resume:
        ...         load(resume, step=step, data=data)
        ...     for window in data:
        ...         for batch in window:
        ...             step.add(batch)
        ...             if (window.index, step.micro_step) == stop:  # mid-window
        ...                 save(path, step=step, data=data)
        ...                 return None
        ...         step.apply()
        ...     return model.weight.detach().clone()
        >>> path = tempfile.mkdtemp()
        >>> run(stop=(1, 1)), torch.equal(run(), run(resume=path))
        (None, True)
    """
    where = _where("save")
    _check(where, step, data)
    rank, world = _rank_world()
    tag = [step.window if step is not None else data.window, step.micro_step if step else -1]
    own: dict[str, Any] = {"format": FORMAT, "rank": rank, "world": world, "tag": tag}
    own["rng"] = rng_state()
    shared: dict[str, Any] | None = None
    if data is not None:
        own["data"] = data.state_dict() if step is None else _data_position(where, step, data)
    if step is not None:
        sd = step.state_dict()
        params = {k for k, v in step.model.state_dict(keep_vars=True).items() if v.requires_grad}
        model = sd.pop("model")
        own["buffers"] = {k: v for k, v in model.items() if k not in params}
        part = {**sd, "params": {k: v for k, v in model.items() if k in params}}
        own["shared"] = step.sync is not None
        if step.sync is None:
            own["step"] = part
        else:
            own["step"] = {"accumulator": part.pop("accumulator")}
            shared = {"format": FORMAT, "world": world, "tag": tag, "step": part}
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    if shared is not None and rank == 0:
        _write(folder / "shared.pt", shared)
    _write(folder / f"rank{rank}.pt", own)
    if shared is not None and step is not None:  # complete on every rank when save returns
        found = data_axes(where, step.sync, None)
        if found is not None:
            timeout = getattr(step.sync, "timeout", None)
            Agreement(where, found, timeout, "gradaccum.loop.save").max([1], "checkpoint")


def _write(file: Path, obj: Any) -> None:
    tmp = file.with_name(file.name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, file)


def _read(where: str, file: Path) -> dict[str, Any]:
    if not file.exists():
        raise FileNotFoundError(
            f"{where}: {file} does not exist; pass the directory gradaccum.loop.save() wrote "
            f"(on as many ranks as saved it)."
        )
    got = torch.load(file, map_location="cpu", weights_only=True)
    if not isinstance(got, dict) or got.get("format") != FORMAT:
        raise GradAccumError(f"{where}: {file} is not a gradaccum.loop checkpoint ({FORMAT}).")
    return got


def load(path: str | os.PathLike[str], *, step: Step | None = None, data: Any = None) -> None:
    """Load what [`save()`][gradaccum.loop.save] wrote into ``step`` and ``data``; resume.

    Call it on every rank after building the model, optimizer, scheduler,
    [`Step`][gradaccum.loop.Step] and [`windows()`][gradaccum.loop.windows] as for a fresh
    run, before the loop: the loop then goes on exactly where the saved run was (the
    micro-batches already taken are skipped), with this process's random states restored.

    Args:
        path: The directory ``save`` wrote.
        step: The [`Step`][gradaccum.loop.Step] to restore (if it was saved).
        data: The [`Windows`][gradaccum.loop.Windows] to restore (if it was saved).

    Raises:
        FileNotFoundError: This rank's file (or the shared one) is missing.
        GradAccumError: The checkpoint was saved on another number of processes, its files
            are from different saves (one was cut short), or what it holds does not fit
            ``step`` or ``data`` (the message names the part).
        ValueError: ``step`` or ``data`` is given but was not saved, or the other way round.

    Examples:
        The data position alone (with its random states); [`save()`][gradaccum.loop.save] has
        a whole mid-window resume:

        >>> import tempfile, gradaccum
        >>> from gradaccum.loop import load, save, windows
        >>> data = windows(range(7), 3)
        >>> window = next(iter(data))
        >>> first = [next(iter(window))]  # one micro-batch of window 0 taken
        >>> path = tempfile.mkdtemp()
        >>> save(path, data=data)
        >>> again = windows(range(7), 3)
        >>> load(path, data=again)
        >>> [list(w) for w in again]  # the rest of window 0, then the others
        [[1, 2], [3, 4, 5], [6]]
    """
    where = _where("load")
    _check(where, step, data)
    rank, world = _rank_world()
    folder = Path(path)
    own = _read(where, folder / f"rank{rank}.pt")
    if own["world"] != world:
        raise GradAccumError(
            f"{where}: the checkpoint was saved by {own['world']} process(es), but this run has "
            f"{world}; each rank's window and data position are its own: resume on "
            f"{own['world']}."
        )
    for name, given in (("step", step), ("data", data)):
        if (given is None) != (name not in own):
            raise ValueError(
                f"{where}: {name}= is {'not ' if given is None else ''}given but the checkpoint "
                f"{'holds' if given is None else 'does not hold'} one; pass what was saved."
            )
    if step is not None:
        part = own["step"]
        if own["shared"]:
            shared = _read(where, folder / "shared.pt")
            if shared["tag"] != own["tag"]:
                raise GradAccumError(
                    f"{where}: shared.pt is from another save (window {shared['tag'][0]}) than "
                    f"rank{rank}.pt (window {own['tag'][0]}): a save was cut short; resume "
                    f"from a complete checkpoint."
                )
            part = {**shared["step"], **part}
        model = {**part.pop("params"), **own["buffers"]}
        step.load_state_dict({**part, "model": model})
    if data is not None:
        data.load_state_dict(own["data"])
    set_rng_state(where, own["rng"])
