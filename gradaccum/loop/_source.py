"""The data behind ``gradaccum.loop.windows``: each epoch's iterable, what it is, how it resumes.

A source is an iterable of micro-batches (a ``DataLoader``, a list, a generator) or a factory
``epoch -> iterable`` called once per epoch. This module knows what can be said about one
without reading it:

- its identity (``identity``): its kind, length, batch size, its dataset's length, its
  sampler's kind and seed, saved with a checkpoint and compared at resume, so that a changed
  dataset or batch size is refused instead of silently giving other windows;
- whether it keeps its own position (``stateful``: ``state_dict`` / ``load_state_dict``, as
  torchdata's ``StatefulDataLoader``), which a checkpoint then holds instead of a replay;
- whether reading it draws from the process's random generators (``draws_randomness``: a
  ``Dataset.__getitem__`` with random augmentation), which a replay cannot reproduce;
- the random states of the process (``rng_states`` / ``set_rng_states``): torch's CPU and CUDA
  generators, Python's ``random``, NumPy's global one if NumPy is imported.
"""

from __future__ import annotations

import contextlib
import os
import random
import secrets
import sys
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from .._errors import describe

__all__ = [
    "Source",
    "draws_randomness",
    "identity",
    "is_factory",
    "length_of",
    "rng_states",
    "run_token",
    "set_rng_states",
    "stateful",
    "under_rng",
    "workers_of",
]


def is_factory(data: Any) -> bool:
    """Whether ``data`` is a factory ``epoch -> iterable`` rather than an iterable."""
    return callable(data) and not hasattr(data, "__iter__")


def length_of(data: Any) -> int | None:
    """``len(data)``, or ``None`` for data without a length (a generator, an IterableDataset)."""
    try:
        return len(data)
    except TypeError:
        return None


def stateful(data: Any) -> bool:
    """Whether ``data`` saves and restores its own position (``state_dict``/``load_state_dict``)."""
    return callable(getattr(data, "state_dict", None)) and callable(
        getattr(data, "load_state_dict", None)
    )


def workers_of(data: Any) -> int:
    """A ``DataLoader``'s worker processes (0: it reads in this process, as any other iterable)."""
    workers = getattr(data, "num_workers", 0)
    return workers if isinstance(workers, int) and not isinstance(workers, bool) else 0


def identity(data: Any) -> dict[str, Any]:
    """What a checkpoint records of the data, to recognise it at resume (numbers and strings).

    The kind of the iterable, its length, and for a ``DataLoader`` its batch size, its
    dataset's length and its sampler's kind, seed and shuffling where the sampler has them
    (``DistributedSampler``: ``seed``, ``shuffle``, ``num_replicas``, ``rank``).
    """
    out: dict[str, Any] = {"kind": type(data).__qualname__}
    length = length_of(data)
    if length is not None:
        out["length"] = length
    batch_size = getattr(data, "batch_size", None)
    if isinstance(batch_size, int):
        out["batch_size"] = batch_size
    dataset = getattr(data, "dataset", None)
    if dataset is not None:
        out["dataset"] = type(dataset).__qualname__
        size = length_of(dataset)
        if size is not None:
            out["dataset_length"] = size
    sampler = getattr(data, "sampler", None)
    if sampler is not None:
        out["sampler"] = type(sampler).__qualname__
        for key in ("seed", "shuffle", "num_replicas", "rank", "drop_last"):
            value = getattr(sampler, key, None)
            if isinstance(value, (bool, int)):
                out[f"sampler.{key}"] = value
    return out


def rng_states() -> dict[str, Any]:
    """The random states of this process: torch (CPU, CUDA), Python, NumPy if imported.

    Safe for ``torch.load(..., weights_only=True)`` (tensors, numbers, strings, lists).
    """
    out: dict[str, Any] = {"torch": torch.get_rng_state(), "python": list(random.getstate())}
    out["python"][1] = list(out["python"][1])
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        out["cuda"] = torch.cuda.get_rng_state_all()
    np = sys.modules.get("numpy")
    if np is not None:
        name, keys, pos, has_gauss, cached = np.random.get_state()
        out["numpy"] = [name, torch.from_numpy(keys.astype("int64")), pos, has_gauss, cached]
    return out


def set_rng_states(saved: dict[str, Any]) -> None:
    """Restore what ``rng_states`` returned (the CUDA states only on as many devices)."""
    torch.set_rng_state(saved["torch"])
    version, state, gauss = saved["python"]
    random.setstate((version, tuple(state), gauss))
    cuda = saved.get("cuda")
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)
    if saved.get("numpy") is not None:
        import numpy as np

        name, keys, pos, has_gauss, cached = saved["numpy"]
        np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))


@contextlib.contextmanager
def under_rng(saved: dict[str, Any] | None) -> Iterator[None]:
    """Run the block under the random states ``saved``, then restore those from before it.

    ``None``: the block runs under the current states (nothing is replayed).
    """
    if saved is None:
        yield
        return
    current = rng_states()
    set_rng_states(saved)
    try:
        yield
    finally:
        set_rng_states(current)


RUN_KEY = "gradaccum.loop.run"
_RUNS: weakref.WeakKeyDictionary[Any, dict[str, int]] = weakref.WeakKeyDictionary()
_LOCAL_RUN: list[int] = []


def run_token() -> int:
    """This run's token, the same on every rank without a collective (a checkpoint's identity).

    Under ``torch.distributed``, first-writer-wins in the process group's store
    (``compare_set`` on the default store, the key holding torchrun's restart count: no rank
    waits for another, and a new process group has a new store), read once per store and kept:
    ``Step`` and ``windows()`` under a sync read it when they are built, while every rank (and
    the store, which rank 0 may host) is certainly there. In one process it is a random number
    drawn once, from the OS (no random state is used).
    """
    if not (dist.is_available() and dist.is_initialized()):
        if not _LOCAL_RUN:
            _LOCAL_RUN.append(secrets.randbits(62) + 1)
        return _LOCAL_RUN[0]
    store = c10d._get_default_store()
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    known = _RUNS.setdefault(store, {})
    if restart not in known:
        key = f"{RUN_KEY}/{restart}"
        known[restart] = int(store.compare_set(key, "", str(secrets.randbits(62) + 1)))
    return known[restart]


def _same(a: Any, b: Any) -> bool:
    """Whether two items read from data are equal, bit for bit (tensors, arrays, containers)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return False
        if a.dtype != b.dtype or a.shape != b.shape:
            return False
        if a.is_floating_point():  # NaN where the other has NaN is the same
            return bool(
                torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())
            )
        return bool(torch.equal(a, b))
    np = sys.modules.get("numpy")
    if np is not None and (isinstance(a, np.ndarray) or isinstance(b, np.ndarray)):
        return bool(np.array_equal(a, b, equal_nan=a.dtype.kind in "fc"))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    with contextlib.suppress(Exception):
        return bool(a == b)
    return True  # not comparable: nothing to say


def draws_randomness(data: Any) -> str | None:
    """What in ``data`` draws from the process's random generators when read, or ``None``.

    The probe reads the first item of the data's dataset twice, under two different seeds of
    torch, Python's ``random`` and NumPy, and compares them bit for bit; the process's random
    states are put back afterwards. An item that changes with the seeds comes from random
    augmentation (a ``Dataset.__getitem__`` that calls ``torch.rand``, ``random.random``...),
    which replaying the data cannot reproduce unless the data seeds it per sample. Only a
    ``DataLoader`` over a map-style ``Dataset`` is probed: an ``IterableDataset`` (whose iterator
    may be a one-pass stream that reading would consume), a list or a generator is not.
    """
    dataset = getattr(data, "dataset", None)
    if dataset is None:
        return None
    # An IterableDataset is not probed: its iterator may be a one-pass stream (a socket, a
    # queue), which reading would consume.
    if isinstance(dataset, torch.utils.data.IterableDataset) or not (
        hasattr(dataset, "__getitem__") and (length_of(dataset) or 0) > 0
    ):
        return None

    def read() -> Any:
        return dataset[0]

    what = f"its dataset's __getitem__ ({type(dataset).__name__})"
    items = []
    np = sys.modules.get("numpy")
    with under_rng(rng_states()):
        for seed in (12345, 54321):
            torch.manual_seed(seed)
            random.seed(seed)
            if np is not None:
                np.random.seed(seed)
            try:
                items.append(read())
            except StopIteration:
                return None
    return None if _same(items[0], items[1]) else what


class Source:
    """The iterable of each epoch: the data itself, or what the factory made for the epoch."""

    def __init__(self, where: str, data: Iterable[Any] | Callable[[int], Iterable[Any]]) -> None:
        self.where = where
        self.data = data
        self.factory = is_factory(data)
        self._made: tuple[int, Any] | None = None  # (epoch, the factory's iterable for it)

    def of(self, epoch: int) -> Any:
        """The iterable of ``epoch`` (a factory is called once per epoch)."""
        if not self.factory:
            return self.data
        if self._made is None or self._made[0] != epoch:
            made = self.data(epoch)  # type: ignore[operator]
            if not hasattr(made, "__iter__"):
                raise TypeError(
                    f"{self.where}: the data factory returned {describe(made)} for epoch "
                    f"{epoch}, which is not iterable; return the epoch's micro-batches, e.g. "
                    f"lambda epoch: DataLoader(dataset, batch_size=8, shuffle=True)."
                )
            self._made = (epoch, made)
        return self._made[1]
