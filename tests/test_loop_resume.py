"""Resuming ``gradaccum.loop.windows`` is bit-identical, or refused when the position is saved.

A run takes the micro-batches of 2 epochs in windows of 3, drawing from the global RNG between
them (a model's dropout, say). It is cut at a point (a micro-batch taken, a window just yielded,
a window whose loop ended), saved there (``Windows.state_dict()`` and the process's random
states, as ``loop.save`` does) and resumed in a "fresh process" (other random states, new data
objects). The resumed run must give exactly the micro-batches the uninterrupted run gave after
the cut, each window the same ``len`` and (prefetched) ``batches``, and leave the global RNG
where the uninterrupted run left it; or, where a replay cannot be exact (a dataset that draws
random numbers, read in this process), ``state_dict()`` must refuse at the cut.

The data varies over: a plain ``DataLoader`` or torchdata's ``StatefulDataLoader``; worker
processes (none, 2, 2 persistent); a map-style dataset with or without random augmentation (torch,
``random`` and NumPy draws in ``__getitem__``) or an ``IterableDataset``; shuffling by
``shuffle=True`` or a ``DistributedSampler``; ``prefetch``; a factory ``epoch -> DataLoader``;
1 process or 2 gloo ranks with loaders of different lengths. Every cut point is run on one
configuration; the others run a few cuts each, chosen so that every pair of values of two
factors appears in some configuration; the full matrix runs under the ``slow`` marker.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass, replace
from typing import Any

import dist
import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset
from torchdata.stateful_dataloader import StatefulDataLoader

import gradaccum
from gradaccum.loop import windows
from gradaccum.loop._source import rng_states, set_rng_states

N, EPOCHS = 3, 2


class Plain(Dataset):
    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([float(i), 2.0 * i], dtype=torch.float64)


class Augmented(Plain):
    """Random augmentation in ``__getitem__``: torch, Python's random and NumPy draws."""

    def __getitem__(self, i: int) -> torch.Tensor:
        noise = torch.rand(2, dtype=torch.float64) + random.random() + float(np.random.rand())
        return super().__getitem__(i) + noise


class Stream(IterableDataset):
    def __init__(self, size: int) -> None:
        self.size = size

    def __iter__(self):
        for i in range(self.size):
            yield torch.tensor([float(i), -float(i)], dtype=torch.float64)


@dataclass(frozen=True)
class Config:
    stateful: bool = False
    workers: int = 0
    persistent: bool = False
    dataset: str = "plain"  # plain, augmented, stream
    sampler: str = "shuffle"  # shuffle, distributed, none
    prefetch: bool = False
    factory: bool = False

    def __str__(self) -> str:
        parts = ["stateful" if self.stateful else "plain-loader", f"w{self.workers}"]
        parts += ["persistent"] * self.persistent + [self.dataset, self.sampler]
        parts += ["prefetch"] * self.prefetch + ["factory"] * self.factory
        return "-".join(parts)


def loader(cfg: Config, rank: int, world: int) -> Any:
    size = 21 if rank == 0 else 19  # 11 and 10 micro-batches of 2: uneven over 2 ranks
    if world == 1:
        size = 21
    dataset = {"plain": Plain, "augmented": Augmented, "stream": Stream}[cfg.dataset](size)
    sampler = None
    if cfg.sampler == "distributed" and cfg.dataset != "stream":
        sampler = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=5)
    shuffle = cfg.sampler == "shuffle" and cfg.dataset != "stream"
    kind = StatefulDataLoader if cfg.stateful else DataLoader
    options: dict[str, Any] = {"batch_size": 2, "shuffle": shuffle, "sampler": sampler}
    if cfg.workers:
        options |= {"num_workers": cfg.workers, "persistent_workers": cfg.persistent}
    if cfg.dataset == "stream" and cfg.workers:
        options |= {"num_workers": 0, "persistent_workers": False}  # a stream is not sharded
    if cfg.factory:
        return lambda epoch: kind(dataset, **options)
    return kind(dataset, **options)


def run(cfg: Config, rank: int, world: int, cut: Any = None, resume: Any = None) -> dict:
    """The run's events; with ``cut``, stop there and return the saved position instead."""
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    source = loader(cfg, rank, world)
    sync = gradaccum.all_reduce() if world > 1 else None
    data = windows(source, N, epochs=EPOCHS, prefetch=cfg.prefetch, sync=sync)
    if resume is not None:
        torch.manual_seed(123 + rank)  # a fresh process: other random states
        random.seed(123)
        np.random.seed(123)
        data.load_state_dict(resume[0])
        set_rng_states(resume[1])
    taken: list[torch.Tensor] = []
    shape: dict[int, tuple[int | None, int, list[torch.Tensor] | None]] = {}
    counts: dict[int, int] = {}  # micro-batches each window gave
    for window in data:
        got = None if window.batches is None else [b.clone() for b in window.batches]
        length = window._len  # None: data without len(), not prefetched
        shape[window.index] = (length, window.taken, got)
        if cut == ("yielded", window.index):
            return {"saved": (data.state_dict(), rng_states())}
        counts[window.index] = 0
        for batch in window:
            counts[window.index] += 1
            taken.append(batch.clone())
            torch.rand(2)  # the model draws between micro-batches
            if cut == len(taken):
                return {"saved": (data.state_dict(), rng_states())}
        if cut == ("closed", window.index):
            return {"saved": (data.state_dict(), rng_states())}
    return {"taken": taken, "shape": shape, "counts": counts, "after": torch.rand(3)}


def refused(cfg: Config, cut: Any, whole: dict) -> bool:
    """Whether ``state_dict()`` must refuse at ``cut`` (a resume that could not be exact)."""
    if cfg.dataset != "augmented":
        return False
    epoch, inside = _where(cut, whole)
    if cfg.workers and cfg.persistent and epoch > 0:
        return True  # the saved run's workers went on from epoch to epoch; new ones would not
    if not inside:
        return False
    return cfg.workers > 0 if cfg.stateful else cfg.workers == 0


def _where(cut: Any, whole: dict) -> tuple[int, bool]:
    """The epoch a resume at ``cut`` goes on in, and whether it goes on inside it (not at its
    start, where its iterator is made afresh as in the uninterrupted run)."""
    lengths = [whole["counts"][i] for i in sorted(whole["counts"])]
    per_epoch = len(lengths) // EPOCHS
    if isinstance(cut, int):
        ends = list(itertools.accumulate(lengths))
        return next(i for i, end in enumerate(ends) if end >= cut) // per_epoch, True
    kind, index = cut
    if kind == "closed" and (index + 1) % per_epoch == 0:
        return (index + 1) // per_epoch, False
    first = index % per_epoch == 0
    return index // per_epoch, not (kind == "yielded" and first and lengths[index] == 0)


def cuts_of(whole: dict) -> list[Any]:
    """Every cut point: each micro-batch taken, each window yielded and closed."""
    out: list[Any] = list(range(1, len(whole["taken"]) + 1))
    for index in sorted(whole["shape"]):
        out += [("yielded", index), ("closed", index)]
    return out


def check(cfg: Config, rank: int, world: int, cuts: Any) -> list[str]:
    """Resume at each cut; the differences from the uninterrupted run (none when exact)."""
    whole = run(cfg, rank, world)
    chosen = cuts_of(whole) if cuts == "all" else cuts
    problems = []
    for cut in chosen:
        expect_refusal = refused(cfg, cut, whole)
        try:
            saved = run(cfg, rank, world, cut=cut)["saved"]
        except ValueError as err:
            if not expect_refusal or "draws random numbers" not in str(err):
                problems.append(f"{cfg} cut {cut}: refused unexpectedly: {err}")
            continue
        if expect_refusal:
            problems.append(f"{cfg} cut {cut}: saved, but a resume cannot be exact")
            continue
        again = run(cfg, rank, world, resume=saved)
        done = cut if isinstance(cut, int) else None
        if done is None:
            kind, index = cut
            ends = list(itertools.accumulate(whole["counts"][i] for i in sorted(whole["counts"])))
            done = ends[index] if kind == "closed" else (ends[index - 1] if index else 0)
        rest = whole["taken"][done:]
        if len(again["taken"]) != len(rest) or any(
            not torch.equal(a, b) for a, b in zip(again["taken"], rest)
        ):
            problems.append(f"{cfg} cut {cut}: other micro-batches after the resume")
        for index, (length, taken, batches) in again["shape"].items():
            want = whole["shape"][index]
            if length != want[0] or (batches is not None and len(batches) != len(want[2])):
                problems.append(f"{cfg} cut {cut}: window {index} has another length")
            elif batches is not None and any(
                not torch.equal(a, b) for a, b in zip(batches, want[2])
            ):
                problems.append(f"{cfg} cut {cut}: window {index} prefetched other batches")
            if index != min(again["shape"]) and taken:
                problems.append(f"{cfg} cut {cut}: window {index} says {taken} taken")
        if not torch.equal(again["after"], whole["after"]):
            problems.append(f"{cfg} cut {cut}: the global RNG is elsewhere after the run")
    return problems


SOME_CUTS = [2, ("yielded", 4), ("closed", 3), 17]

# Every pair of values of two factors appears in at least one of these (checked below).
PAIRWISE = [
    Config(),
    Config(workers=2, dataset="augmented", sampler="distributed", prefetch=True),
    Config(workers=2, persistent=True, dataset="plain", sampler="shuffle", factory=True),
    Config(stateful=True, dataset="augmented", sampler="shuffle", prefetch=True),
    Config(stateful=True, workers=2, dataset="plain", sampler="distributed"),
    Config(stateful=True, workers=2, persistent=True, dataset="augmented", sampler="none"),
    Config(dataset="stream", sampler="none", prefetch=True, factory=True),
    Config(stateful=True, dataset="stream", sampler="none"),
    Config(workers=2, persistent=True, dataset="augmented", sampler="distributed"),
    Config(dataset="augmented", sampler="none", factory=True),
    Config(stateful=True, workers=2, persistent=True, dataset="plain", prefetch=True),
    Config(workers=2, dataset="plain", sampler="none", factory=True),
    Config(stateful=True, dataset="plain", sampler="distributed", factory=True, prefetch=True),
    Config(workers=2, dataset="augmented", sampler="shuffle", factory=True),
]


def _factors(cfg: Config) -> dict[str, Any]:
    workers = "p" if cfg.persistent else cfg.workers
    return {
        "stateful": cfg.stateful,
        "workers": workers,
        "dataset": cfg.dataset,
        "sampler": cfg.sampler if cfg.dataset != "stream" else "none",
        "prefetch": cfg.prefetch,
        "factory": cfg.factory,
    }


def test_the_configurations_cover_every_pair() -> None:
    values = {
        "stateful": [False, True],
        "workers": [0, 2, "p"],
        "dataset": ["plain", "augmented", "stream"],
        "sampler": ["shuffle", "distributed", "none"],
        "prefetch": [False, True],
        "factory": [False, True],
    }
    seen = {
        (a, x, b, y)
        for cfg in PAIRWISE
        for (a, x), (b, y) in itertools.combinations(_factors(cfg).items(), 2)
    }
    missing = [
        (a, x, b, y)
        for a, b in itertools.combinations(values, 2)
        for x in values[a]
        for y in values[b]
        if (a, x, b, y) not in seen
        and not (a == "workers" and x != 0 and b == "dataset" and y == "stream")
        and not (a == "dataset" and x == "stream" and b == "sampler" and y != "none")
    ]
    assert not missing, missing


def test_every_cut_point_of_one_configuration() -> None:
    cfg = Config(sampler="shuffle", prefetch=True)
    assert check(cfg, 0, 1, "all") == []


def test_every_cut_point_of_a_stateful_loader() -> None:
    cfg = Config(stateful=True, sampler="shuffle", prefetch=False)
    assert check(cfg, 0, 1, "all") == []


def test_every_cut_point_of_augmented_data_in_this_process() -> None:
    """Refused wherever something is to be read again (and only there); stateful: exact."""
    assert check(Config(dataset="augmented"), 0, 1, "all") == []
    assert check(Config(dataset="augmented", stateful=True), 0, 1, "all") == []


# DataLoader worker processes: their start and shutdown cost seconds (on a loaded machine 10 s
# and more, a worker shut down when its loader is collected), so the configurations with workers
# run in the slow tier; those without keep every other factor in the fast one.
@pytest.mark.parametrize(
    "cfg",
    [pytest.param(c, marks=pytest.mark.slow) if c.workers else c for c in PAIRWISE],
    ids=str,
)
def test_pairwise(cfg: Config) -> None:
    assert check(cfg, 0, 1, SOME_CUTS) == []


def _on_two_ranks(rank: int, world: int, cfg: Config, cuts: Any) -> list[str]:
    return check(cfg, rank, world, cuts)


@pytest.mark.distributed
@pytest.mark.parametrize(
    "cfg",
    [Config(prefetch=True), Config(stateful=True, sampler="distributed", dataset="augmented")],
    ids=str,
)
def test_two_ranks(cfg: Config) -> None:
    """Loaders of 11 and 10 micro-batches: the last window of each epoch is empty on rank 1."""
    # Cuts every rank reaches at the same place (the ranks' micro-batch counts part in the
    # uneven last window of each epoch).
    cuts = [2, ("yielded", 3), ("closed", 3), ("yielded", 5), ("closed", 6)]
    r0, r1 = dist.values(dist.run(_on_two_ranks, cfg, cuts, timeout=240))
    assert r0 == []
    assert r1 == []


# Every combination of the factors the resume depends on (a factory only changes where the
# loader comes from: the pairwise configurations cover it).
FULL = [
    Config(stateful=s, workers=w, persistent=p, dataset=d, sampler=m, prefetch=f)
    for s, (w, p), d, m, f in itertools.product(
        (False, True),
        ((0, False), (2, False), (2, True)),
        ("plain", "augmented", "stream"),
        ("shuffle", "distributed", "none"),
        (False, True),
    )
    if not (d == "stream" and (m != "none" or w))
]


FEWER_CUTS = [("closed", 3), 17]  # an epoch's end, and inside the next epoch


@pytest.mark.slow
@pytest.mark.parametrize("cfg", FULL, ids=str)
def test_full_matrix(cfg: Config) -> None:
    assert check(cfg, 0, 1, FEWER_CUTS) == []


@pytest.mark.slow
@pytest.mark.distributed
def test_full_matrix_on_two_ranks() -> None:
    configs = [replace(cfg, workers=0, persistent=False) for cfg in FULL if not cfg.workers]
    r0, r1 = dist.values(dist.run(_all_on_two_ranks, configs, timeout=600))
    assert r0 == []
    assert r1 == []


def _all_on_two_ranks(rank: int, world: int, configs: list[Config]) -> list[str]:
    cuts = [2, ("closed", 3), ("yielded", 5)]  # the same place on every rank
    return [p for cfg in configs for p in check(cfg, rank, world, cuts)]
