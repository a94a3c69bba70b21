"""``gradaccum.loop.save`` / ``load``: the whole training state, one call each way, mid-window too.

A checkpoint is a directory. Each rank writes ``rank{r}.pt``: its window in progress, the
model's buffers, its data position and its random states. Under a sync (the parameters,
optimizer and scheduler are the same on every rank) rank 0 also writes ``shared.pt`` with those,
once; without a sync each rank's file holds its own. Files are written to a temporary name and
renamed. The format is versioned (``FORMAT``); ``load`` names the version of an older file.

``save`` communicates nothing with the other ranks, so a save that only some ranks reach cannot
hang: it returns once this rank's files are written, and counts itself in ``step._saves``,
which the step carries into its boundary (every rank raises there when the counts differ).

The save's identity. Every file of one save carries ``(run, count)``: ``run`` is a token of the
run, the same on every rank without a collective (``_loop_source.run_token``: first-writer-wins
in the process group's store, read when the ``Step`` or the windows are built), and ``count``
the number of saves this process made in that run, which is the same on every rank because
every rank saves at the same points (a save reached by only some ranks fails the next
boundary). Files of two runs, or of two saves of one run, never share it.

``load`` is all or nothing, on every rank. Under a sync it agrees twice through
[`Comm`][gradaccum.sync.Comm] (one tiny all-reduce each, bounded by the sync's timeout): once
on entry, so every rank's earlier saves are complete before any file is read; and once after
each rank has read its files and checked everything against its step and data, carrying a
failure flag and the save's identity. A refusal on any rank (a missing, damaged, older or
foreign file, files of two saves, a model, optimizer, scheduler or data that does not fit) is
then a refusal on every rank, and nothing changed on any rank: the model, optimizer, scheduler,
window, data position and random states are applied only once every rank has accepted.
Without a sync nothing is communicated.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .._coupled._replay import load_states, saved_states
from .._errors import GradAccumError, describe
from ._data import Windows
from ._plan import Agreement, data_axes
from ._source import rng_states, run_token, set_rng_states
from ._state import FORMAT as STEP_FORMAT
from ._state import prepare
from ._step import Step

__all__ = ["load", "save"]

FORMAT = "gradaccum.loop.checkpoint/2"
OLDER = {"gradaccum.loop.checkpoint/1": "before checkpoints carried a save identity"}
_counts: dict[int, int] = {}  # this process's saves, per run token


def _where(verb: str) -> str:
    return f"gradaccum.loop.{verb}(path, step, data=...)"


def _folder(where: str, path: Any) -> Path:
    """The checkpoint directory ``path`` names, refused when it names none."""
    if not isinstance(path, (str, os.PathLike)) or isinstance(os.fspath(path), bytes):
        raise TypeError(
            f"{where}: path must be a directory's path (a str or os.PathLike), got "
            f"{describe(path)}; pass e.g. 'checkpoints/run1'."
        )
    text = os.fspath(path)
    if not text:
        raise ValueError(
            f"{where}: path is '', which names no directory; pass the checkpoint's "
            f"directory, e.g. 'checkpoints/run1' ('.' for the current one)."
        )
    folder = Path(text)
    if folder.exists() and not folder.is_dir():
        raise ValueError(
            f"{where}: path {text!r} is a file, but a checkpoint is a directory (of "
            f"rank{{r}}.pt and shared.pt); pass a directory's path."
        )
    return folder


def _check(where: str, step: Any, data: Any) -> Any:
    """Validate ``step`` and ``data``; return the data (the step's when not given)."""
    if step is not None and not isinstance(step, Step):
        raise TypeError(
            f"{where}: step must be a gradaccum.loop.Step, got {describe(step)}; pass the "
            f"Step that trains the model (gradaccum.loop.Step(model, loss, optimizer))."
        )
    own = getattr(step, "data", None)
    if data is None:
        data = own
    elif own is not None and data is not own:
        raise ValueError(
            f"{where}: data= is not the step's data (the windows given to Step(..., data=)); "
            f"leave data= out to use the step's."
        )
    if step is None and data is None:
        raise ValueError(f"{where}: step and data are both None; pass a step, data= or both.")
    if data is not None and not isinstance(data, Windows):
        raise TypeError(
            f"{where}: data must be what gradaccum.loop.windows() returned, got {describe(data)}; "
            f"pass data=gradaccum.loop.windows(loader, n)."
        )
    return data


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def check_rng_state(where: str, saved: Any) -> None:
    """Refuse random states that ``set_rng_states`` could not restore here (damaged, or CUDA)."""
    if not isinstance(saved, dict) or not isinstance(saved.get("torch"), torch.Tensor):
        raise GradAccumError(
            f"{where}: the checkpoint's random states are damaged (got {describe(saved)}); "
            f"resume from a checkpoint that gradaccum.loop.save() wrote."
        )
    cuda = saved.get("cuda")
    if cuda is not None and torch.cuda.device_count() != len(cuda):
        raise GradAccumError(
            f"{where}: the checkpoint holds the CUDA random states of {len(cuda)} device(s), "
            f"but this process sees {torch.cuda.device_count()}; resume on the same devices."
        )


def _data_position(where: str, step: Step, data: Windows[Any]) -> dict[str, Any]:
    """The data position to save, lined up with the step's window."""
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
    feed = getattr(step, "_feed", None)
    if feed is not None:
        raise ValueError(
            f"{where}: the step's loss is coupled ({feed.loss!r}): it takes a window whole "
            f"(step.add_window), and the data is at window {dw} with {taken} micro-batch(es) "
            f"taken while the step has {sm} added; a save here would lose them. Save before "
            f"the window's first micro-batch is taken, after step.add_window(window), or after "
            f"step.apply()."
        )
    raise ValueError(
        f"{where}: the step is at window {sw} with {sm} micro-batch(es) added, but the data at "
        f"window {dw} with {taken} taken; save between step.add(batch) calls, or after "
        f"step.apply(), with the step fed by this data (step.add each micro-batch taken)."
    )


def save(path: str | os.PathLike[str], step: Step | None = None, *, data: Any = None) -> None:
    """Save the whole training state to the directory ``path``, mid-window included.

    With ``step``: the model (parameters and buffers), the optimizer, the scheduler and the
    window in progress (its running sums and statistics). With ``data`` (by default the step's,
    ``Step(..., data=)``): the data position (epoch, micro-batch, the random states of the
    epoch's iterator). Always: this process's random states (torch CPU and CUDA, Python's
    ``random``, NumPy's if imported), and those of the explicit generators of a
    [`Coupled`][gradaccum.loop.Coupled] or [`WindowStats`][gradaccum.loop.WindowStats] loss
    (its ``generators=``). [`load()`][gradaccum.loop.load] resumes bit-identically:
    the same updates, on every rank.

    Every rank calls it at the same point of the loop: decide from the window index alone
    (``if window.index == save_at:`` after the window's ``for`` loop, before ``step.apply()``),
    which every rank reaches in every window, even when the ranks hold different numbers of
    micro-batches. Under the step's sync, rank 0 writes the parameters, optimizer and scheduler
    once (``shared.pt``), each rank its own part (``rank{r}.pt``). Nothing is communicated:
    ``save`` returns once this rank's files are written, and a save that only some ranks reach
    makes every rank raise ``GradAccumError`` at the next ``step.apply()``. Every file carries
    the save's identity, so that [`load()`][gradaccum.loop.load] refuses files of two saves.
    For sharded parameters (a [`reduce_scatter()`][gradaccum.reduce_scatter] sync, FSDP2),
    save them, their optimizer and the accumulator with
    [`dcp_save()`][gradaccum.checkpoint.dcp_save], and the data position and random states here
    (``save(path, data=data)``).

    Args:
        path: A directory (created if missing); the files in it are replaced.
        step: The [`Step`][gradaccum.loop.Step] to save, or ``None``.
        data: The [`Windows`][gradaccum.loop.Windows] feeding it; by default the step's.

    Raises:
        TypeError: ``path``, ``step`` or ``data`` is of the wrong kind.
        ValueError: ``path`` is ``''`` or a file; neither a step nor data is given; ``data``
            is not the step's; or the step and the data are at different windows (a
            micro-batch taken but not added). Nothing is written then.

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
        ...         load(resume, step, data=data)
        ...     for window in data:
        ...         for batch in window:
        ...             step.add(batch)
        ...             if (window.index, step.micro_step) == stop:  # mid-window
        ...                 save(path, step, data=data)
        ...                 return None
        ...         step.apply()
        ...     return model.weight.detach().clone()
        >>> path = tempfile.mkdtemp()
        >>> run(stop=(1, 1)), torch.equal(run(), run(resume=path))
        (None, True)
    """
    where = _where("save")
    folder = _folder(where, path)
    data = _check(where, step, data)
    sync = step.sync if step is not None else getattr(data, "sync", None)
    if sync is not None and sync.defer:  # a deferred sync: the last window's checks first
        sync.verify()
    rank, world = _rank_world()
    own: dict[str, Any] = {"format": FORMAT, "rank": rank, "world": world}
    shared: dict[str, Any] | None = None
    if data is not None:
        own["data"] = data.state_dict() if step is None else _data_position(where, step, data)
    if step is not None:
        sd = step.state_dict()
        params = {k for k, v in step.model.state_dict(keep_vars=True).items() if v.requires_grad}
        model = sd.pop("model")
        own["at"] = [step.window, step.micro_step]
        own["buffers"] = {k: v for k, v in model.items() if k not in params}
        part = {**sd, "params": {k: v for k, v in model.items() if k in params}}
        own["shared"] = step.sync is not None
        if step.sync is None:
            own["step"] = part
        else:
            own["step"] = {"accumulator": part.pop("accumulator")}
            shared = {"format": FORMAT, "world": world, "step": part}
    own["rng"] = rng_states()
    if step is not None:  # the loss's explicit generators (loop.Coupled, loop.WindowStats)
        own["generators"] = saved_states(_generators(step))
    run = run_token()
    _counts[run] = count = _counts.get(run, 0) + 1
    own["save"] = [run, count]
    folder.mkdir(parents=True, exist_ok=True)
    if shared is not None and rank == 0:
        _write(folder / "shared.pt", {**shared, "save": [run, count]}, run)
    _write(folder / f"rank{rank}.pt", own, run)
    if step is not None:  # carried into the boundary: a save some ranks missed fails it
        setattr(step, "_saves", getattr(step, "_saves", 0) + 1)  # noqa: B010 - api.md's Step._saves


def _generators(step: Step) -> tuple[Any, ...]:
    """The explicit random generators of the step's loss (``generators=``), if any."""
    return tuple(getattr(getattr(getattr(step, "_feed", None), "loss", None), "generators", ()))


def _write(file: Path, obj: Any, run: int) -> None:
    tmp = file.with_name(f"{file.name}.{run:x}.tmp")
    torch.save(obj, tmp)
    os.replace(tmp, file)


def _read(where: str, file: Path, keys: tuple[str, ...]) -> dict[str, Any]:
    """A checkpoint file of this format, with ``keys``; refused with the reason otherwise."""
    if not file.exists():
        raise FileNotFoundError(
            f"{where}: {file} does not exist; pass the directory gradaccum.loop.save() wrote "
            f"(on as many ranks as saved it)."
        )
    try:
        got = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as err:
        raise GradAccumError(
            f"{where}: {file} cannot be read by torch.load ({type(err).__name__}): it was cut "
            f"short (a copy or a save that did not finish) or is not a checkpoint; resume from "
            f"a complete checkpoint."
        ) from err
    fmt = got.get("format") if isinstance(got, dict) else None
    if fmt in OLDER:
        raise GradAccumError(
            f"{where}: {file} was written by an older gradaccum (format {fmt!r}, "
            f"{OLDER[fmt]}); this version reads {FORMAT!r}. Resume it with the gradaccum "
            f"version that wrote it, or start a new run from its weights: they are under "
            f"['step']['params'] of shared.pt (of rank0.pt when saved without a sync)."
        )
    if isinstance(fmt, str) and fmt.startswith("gradaccum.loop.checkpoint/") and fmt != FORMAT:
        raise GradAccumError(
            f"{where}: {file} was written by a newer gradaccum (format {fmt!r}); this version "
            f"reads {FORMAT!r}: upgrade gradaccum to resume it."
        )
    if fmt != FORMAT:
        raise GradAccumError(f"{where}: {file} is not a gradaccum.loop checkpoint ({FORMAT}).")
    ident = got.get("save")
    missing = [k for k in keys if k not in got]
    if (
        missing
        or not isinstance(ident, list)
        or len(ident) != 2
        or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in ident)
    ):
        raise GradAccumError(
            f"{where}: {file} is damaged (it lacks {missing or ['save']}); resume from a "
            f"complete checkpoint."
        )
    return dict(got)


def _agreement(where: str, step: Step | None, data: Any) -> Agreement | None:
    """The ranks' agreement in ``load``: over the step's sync (else the data's); or none."""
    sync = step.sync if step is not None else getattr(data, "sync", None)
    found = data_axes(where, sync, None)
    if found is None or sync is None:
        return None
    return Agreement(where, found, sync.timeout, "gradaccum.loop.load")


def _prepare(
    where: str, folder: Path, step: Step | None, data: Any
) -> tuple[Callable[[], None], Callable[[], None], list[int]]:
    """Read and check everything; trial-load the data. Returns ``(apply, undo, identity)``.

    Nothing of the step or the random states changes here; the data position is loaded (its
    own load is all or nothing) and ``undo`` puts it back.
    """
    rank, world = _rank_world()
    name = f"rank{rank}.pt"
    own = _read(where, folder / name, ("rank", "world", "rng"))
    if own["world"] != world or own["rank"] != rank:
        raise GradAccumError(
            f"{where}: {name} was saved by rank {own['rank']} of {own['world']} process(es), "
            f"but this is rank {rank} of {world}; each rank's window and data position are "
            f"its own: resume on {own['world']}."
        )
    for label, given, key in (("a step", step, "step"), ("a data position", data, "data")):
        if given is not None and key not in own:
            raise ValueError(
                f"{where}: {label} is to be loaded but the checkpoint holds none; load only what "
                f"was saved (save(path, step) saves the step's data too)."
            )
        if given is None and key in own:
            what = "pass the step" if key == "step" else "pass data= (or Step(..., data=))"
            raise ValueError(
                f"{where}: the checkpoint holds {label} but none is given; {what} to resume "
                f"where the saved run was."
            )
    ident: list[int] = own["save"]
    apply_step: Callable[[], None] = lambda: None  # noqa: E731
    if step is not None:
        part = dict(own["step"])
        if own.get("shared"):
            shared = _read(where, folder / "shared.pt", ("world", "step"))
            if shared["save"] != ident:
                raise GradAccumError(
                    f"{where}: shared.pt and {name} are from different saves (a save was cut "
                    f"short, or two runs saved into {folder}); resume from a checkpoint that "
                    f"every rank saved at once."
                )
            part = {**shared["step"], **part}
        if part.get("format") != STEP_FORMAT or "params" not in part or "buffers" not in own:
            raise GradAccumError(
                f"{where}: {name} is damaged (its step is incomplete); resume from a complete "
                f"checkpoint."
            )
        model = {**part.pop("params"), **own["buffers"]}
        apply_step = prepare(where, step, {**part, "model": model})
    check_rng_state(where, own["rng"])
    gens = _generators(step) if step is not None else ()
    if step is not None:  # checked now (nothing changes on a refusal), set in apply()
        load_states(where, gens, own.get("generators", []), apply=False)
    undo: Callable[[], None] = lambda: None  # noqa: E731
    if data is not None:
        before = data.state_dict()
        data.load_state_dict(own["data"])

        def undo() -> None:
            data.load_state_dict(before)

    def apply() -> None:
        try:
            apply_step()
        except BaseException:
            undo()
            raise
        set_rng_states(own["rng"])
        if gens:
            load_states(where, gens, own.get("generators", []))

    return apply, undo, ident


def load(path: str | os.PathLike[str], step: Step | None = None, *, data: Any = None) -> None:
    """Load what [`save()`][gradaccum.loop.save] wrote into ``step`` and ``data``; resume.

    Call it on every rank after building the model, optimizer, scheduler,
    [`Step`][gradaccum.loop.Step] and [`windows()`][gradaccum.loop.windows] as for a fresh
    run, before the loop: the loop then goes on exactly where the saved run was (the
    micro-batches already taken are skipped), with this process's random states restored.

    All or nothing: every file is read and everything checked against the step and the data
    before any of it is applied. Under a sync the ranks agree first (so every rank's save is
    complete) and again before applying: a refusal on one rank is a ``GradAccumError`` on every
    other, and nothing changed on any rank.

    Args:
        path: The directory ``save`` wrote.
        step: The [`Step`][gradaccum.loop.Step] to restore (if it was saved).
        data: The [`Windows`][gradaccum.loop.Windows] to restore (if it was saved); by
            default the step's.

    Raises:
        TypeError: ``path``, ``step`` or ``data`` is of the wrong kind.
        FileNotFoundError: This rank's file (or the shared one) is missing.
        ValueError: ``path`` is ``''`` or a file; a step or data is given but was not saved,
            or the other way round; the checkpoint's model, optimizer, scheduler or reduction
            is not the step's (the message names the difference).
        GradAccumError: Another rank refused the checkpoint; the files are from different
            saves or runs (a save cut short); a file is damaged, cut short or of another
            format version (the message names the version); the checkpoint was saved on
            another number of processes; or its data position does not fit ``data``.

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
    folder = _folder(where, path)
    data = _check(where, step, data)
    agreement = _agreement(where, step, data)
    if agreement is not None:  # every rank is in load: the saves before it are written
        agreement.max([0], "checkpoint load")
    apply = undo = None
    ident, error = [0, 0], None
    try:
        apply, undo, ident = _prepare(where, folder, step, data)
    except Exception as err:  # reported to the other ranks, then raised here
        error = err
    if agreement is not None:
        rank, world = _rank_world()
        failed = error is not None
        try:
            got = agreement.max(
                [int(failed), world - rank if failed else 0, *ident, -ident[0], -ident[1]],
                "checkpoint verdict",
            )
        except BaseException:  # the agreement failed (a rank died, a timeout): nothing loads
            if undo is not None:
                undo()
            raise
        refusal = None
        if got[0] and not failed:
            refusal = (
                f"{where}: rank {world - got[1]} refused the checkpoint in {folder} (its error "
                f"says why), so no rank loads it; nothing was changed on this rank. Fix what "
                f"rank {world - got[1]}'s error names, or resume from another checkpoint."
            )
        elif not failed and got[2] != -got[4]:
            refusal = (
                f"{where}: the ranks' files in {folder} are from different runs (two runs "
                f"saved into it, and a save was cut short); nothing was loaded on any rank: "
                f"resume from a checkpoint that every rank of one run saved."
            )
        elif not failed and got[3] != -got[5]:
            refusal = (
                f"{where}: the ranks' files in {folder} are from different saves of one run "
                f"(saves {-got[5]} and {got[3]}): a save was cut short, or not every rank "
                f"saved; nothing was loaded on any rank: resume from a checkpoint that every "
                f"rank saved at once."
            )
        if refusal is not None:
            assert undo is not None
            undo()
            raise GradAccumError(refusal)
    if error is not None:
        raise error
    assert apply is not None
    apply()
