"""gradaccum.loop.windows: partitioning, agreement over ranks, resuming, errors."""

from __future__ import annotations

import itertools

import dist
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader

import gradaccum
from gradaccum.loop import windows


def taken(data) -> list[list]:
    return [list(w) for w in data]


def test_short_last_window_and_epochs() -> None:
    data = windows(range(10), 4, epochs=2)
    assert len(data) == 6
    got = [(w.epoch, w.index, w.start, list(w)) for w in data]
    assert got == [
        (0, 0, 0, [0, 1, 2, 3]),
        (0, 1, 4, [4, 5, 6, 7]),
        (0, 2, 8, [8, 9]),
        (1, 3, 0, [0, 1, 2, 3]),
        (1, 4, 4, [4, 5, 6, 7]),
        (1, 5, 8, [8, 9]),
    ]
    assert (data.epoch, data.window, data.micro_batch) == (2, 6, 0)


def test_schedule_counts_windows_over_epochs() -> None:
    # The schedule's index counts every epoch's windows: 1, 2, 4, 4, ... micro-batches.
    data = windows(range(6), lambda i: min(4, 2**i), epochs=2)
    assert len(data) == 5
    assert [len(w) for w in data] == [1, 2, 3, 4, 2]


def hidden_length(values):
    """A generator: data without len()."""
    yield from values


def test_data_without_len() -> None:
    data = windows(hidden_length(range(7)), 3)
    with pytest.raises(TypeError, match=r"the data has no len\(\)"):
        len(data)
    out = []
    for w in data:
        with pytest.raises(TypeError, match=r"prefetch=True"):
            len(w)
        out.append(list(w))
    assert out == [[0, 1, 2], [3, 4, 5], [6]]
    pre = windows(hidden_length(range(7)), 3, prefetch=True)
    assert [(len(w), w.batches, list(w)) for w in pre][-1] == (1, [6], [6])


def test_prefetch_reads_the_window_first() -> None:
    reads = []

    class Loud:
        def __len__(self) -> int:
            return 5

        def __iter__(self):
            for i in range(5):
                reads.append(i)
                yield i

    for w in windows(Loud(), 2, prefetch=True):
        assert reads[-1] == w.start + len(w) - 1  # all of it read before the first is taken
        assert list(w) == w.batches


def test_endless_epochs() -> None:
    data = windows(range(3), 2, epochs=None)
    with pytest.raises(TypeError, match=r"endless"):
        len(data)
    got = [(w.epoch, list(w)) for w in itertools.islice(data, 5)]
    assert got == [(0, [0, 1]), (0, [2]), (1, [0, 1]), (1, [2]), (2, [0, 1])]


def test_a_new_loop_continues_where_the_last_stopped() -> None:
    data = windows(range(8), 3)
    for w in data:
        first = next(iter(w))
        break
    assert first == 0
    assert taken(data) == [[1, 2], [3, 4, 5], [6, 7]]
    with pytest.raises(ValueError, match=r"all 1 epoch\(s\) are done"):
        iter(data)


def test_untouched_window_is_skipped_part_way_is_refused() -> None:
    assert [len(w) for w in windows(range(5), 2)] == [2, 2, 1]
    data = windows(range(5), 2)
    loop = iter(data)
    w = next(loop)
    next(iter(w))
    with pytest.raises(ValueError, match=r"window 0 was left part-way"):
        next(loop)


def test_a_window_is_iterable_while_current_only() -> None:
    data = windows(range(6), 2)
    loop = iter(data)
    w0 = next(loop)
    assert list(next(loop)) == [2, 3]  # window 0 untouched: skipped
    with pytest.raises(ValueError, match=r"window 0 is over"):
        list(w0)


def test_one_loop_at_a_time() -> None:
    data = windows(range(6), 2)
    loop = iter(data)
    next(loop)
    with pytest.raises(RuntimeError, match=r"already being iterated"):
        next(iter(data))
    with pytest.raises(RuntimeError, match=r"load the position before the loop"):
        data.load_state_dict(data.state_dict())


def test_data_longer_than_its_len_is_refused() -> None:
    class Liar:
        def __len__(self) -> int:
            return 3

        def __iter__(self):
            return iter(range(5))

    with pytest.raises(ValueError, match=r"more micro-batches than len\(data\) = 3"):
        taken(windows(Liar(), 2))


def test_set_epoch_is_called() -> None:
    seen = []

    class Sampler:
        def set_epoch(self, epoch: int) -> None:
            seen.append(epoch)

        def __iter__(self):
            return iter(range(4))

        def __len__(self) -> int:
            return 4

    loader = DataLoader(list(range(4)), sampler=Sampler(), batch_size=1)
    taken(windows(loader, 3, epochs=3))
    assert seen == [0, 1, 2]


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"data": 3}, TypeError, r"data must be an iterable of micro-batches"),
        ({"n": 0}, ValueError, r"n must be a positive int"),
        ({"n": 2.0}, TypeError, r"n must be a positive int"),
        ({"epochs": 0}, ValueError, r"epochs must be a positive int or None"),
        ({"data": iter([1]), "epochs": 2}, TypeError, r"data is an iterator \(list_iterator\)"),
        ({"prefetch": 1}, TypeError, r"prefetch must be a bool"),
        ({"timeout": -1}, ValueError, r"timeout must be None or a positive"),
        ({"group": "world"}, TypeError, r"group must be None"),
    ],
)
def test_arguments_are_checked(kwargs, error, message) -> None:
    args = {"data": range(3), "n": 2, **kwargs}
    with pytest.raises(error, match=message):
        windows(args.pop("data"), args.pop("n"), **args)


def test_a_bad_schedule_value_is_named() -> None:
    with pytest.raises(ValueError, match=r"the schedule n's value for window 1"):
        taken(windows(range(5), lambda i: 2 - 2 * i))


# -- the partition law --------------------------------------------------------------------------


class Agreed:
    """Stands for the all-reduce of the lengths over ranks that hold ``lengths``."""

    def __init__(self, lengths: list[int]) -> None:
        self.lengths = lengths

    def max(self, values: list[int], purpose: str) -> list[int]:
        """This rank's values, with the lengths of every rank (the rest agree by construction)."""
        assert purpose == "data lengths"
        return [*values[:-2], max(self.lengths), -min(self.lengths)]


schedules = st.one_of(
    st.integers(1, 5),
    st.lists(st.integers(1, 5), min_size=1, max_size=4).map(lambda s: lambda i: s[i % len(s)]),
)


@settings(max_examples=150, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 23), min_size=1, max_size=4),
    n=schedules,
    epochs=st.integers(1, 3),
)
def test_partition_law(lengths: list[int], n, epochs: int) -> None:
    """Every rank yields the same windows (count, indices, epochs); each rank's windows, in
    order, are its data once per epoch; a window holds at most n(index) micro-batches, only the
    last window of an epoch is short, and an empty window comes only after a rank's data ran out.
    """
    per_rank = []
    for length in lengths:
        data = windows(list(range(length)), n, epochs=epochs)
        data._agreement = Agreed(lengths)  # as the all-reduce would give
        per_rank.append((len(data), [(w.epoch, w.index, list(w)) for w in data]))
    totals = {total for total, _ in per_rank}
    assert len(totals) == 1
    heads = {tuple((e, i) for e, i, _ in got) for _, got in per_rank}
    assert len(heads) == 1
    (head,) = heads
    assert len(head) == totals.pop()
    assert [i for _, i in head] == list(range(len(head)))
    longest = max(lengths)
    size = n if callable(n) else (lambda i, n=n: n)
    for epoch in range(epochs):
        planned = [size(i) for e, i in head if e == epoch]  # the epoch covers the longest
        assert sum(planned) >= longest
        assert not planned or sum(planned[:-1]) < longest
    for length, (_, got) in zip(lengths, per_rank):
        for epoch in range(epochs):
            mine = [(i, mb) for e, i, mb in got if e == epoch]
            assert [x for _, mb in mine for x in mb] == list(range(length))
            for j, (i, mb) in enumerate(mine):
                assert len(mb) <= size(i)
                if any(m for _, m in mine[j + 1 :]):
                    assert len(mb) == size(i)  # only the epoch's last windows are short


# -- resuming -----------------------------------------------------------------------------------


def _shuffled(generator: bool) -> DataLoader:
    g = torch.Generator().manual_seed(7) if generator else None
    return DataLoader(list(range(17)), batch_size=2, shuffle=True, generator=g)


def _run(loader, cut=None, resume=None, n=3, epochs=3):
    """The micro-batches a loop takes (training draws from the global RNG as it goes)."""
    data = windows(loader, n, epochs=epochs)
    if resume is not None:
        data.load_state_dict(resume[0])
        torch.set_rng_state(resume[1])
    out, saved = [], None
    for w in data:
        for mb in w:
            out.append(mb.tolist())
            torch.rand(2)  # a training step's dropout, say
            if len(out) == cut:
                saved = (data.state_dict(), torch.get_rng_state())
        if len(out) == cut:  # between windows: the loop over the window has ended
            saved = (data.state_dict(), torch.get_rng_state())
    return out, saved


@pytest.mark.parametrize("generator", [False, True], ids=["global-rng", "own-generator"])
def test_resume_is_identical_at_every_position(generator: bool) -> None:
    torch.manual_seed(0)
    whole, _ = _run(_shuffled(generator))
    for cut in range(1, len(whole) + 1):
        torch.manual_seed(0)
        head, saved = _run(_shuffled(generator), cut=cut)
        assert head == whole
        torch.manual_seed(123)  # a fresh process: other random states, other generator states
        loader = _shuffled(generator)
        if generator:
            loader.generator.manual_seed(99)
        rest, _ = _run(loader, resume=saved)
        assert rest == whole[cut:], cut


def test_resume_without_len_and_with_prefetch() -> None:
    def gen():
        yield from range(11)

    for prefetch in (False, True):
        data = windows(gen(), 3, prefetch=prefetch)
        loop = iter(data)
        w = next(loop)
        list(w)
        w = next(loop)
        next(iter(w))
        sd = data.state_dict()
        again = windows(gen(), 3, prefetch=prefetch)
        again.load_state_dict(sd)
        assert taken(again) == [[4, 5], [6, 7, 8], [9, 10]]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"format": "x"}, r"expected a dict with format 'gradaccum.loop.Windows/2'"),
        ({"format": "gradaccum.loop.Windows/1"}, r"written by an older gradaccum \(0.1\)"),
        ({"skip": 3}, r"skip at most reread"),
        ({"sizes": [0]}, r"sizes must be a list of positive ints"),
        ({"epoch": -1}, r"epoch must be an int >= 0, got int -1"),
        ({"closed": 1}, r"started and closed must be bools"),
        ({"generators": None}, r"generators must be a list of tensors"),
    ],
)
def test_a_malformed_position_is_refused(change, message) -> None:
    sd = windows(range(5), 2).state_dict()
    with pytest.raises(gradaccum.GradAccumError, match=message):
        windows(range(5), 2).load_state_dict({**sd, **change})


def test_a_position_of_other_windows_is_refused() -> None:
    data = windows(range(9), 3)
    loop = iter(data)
    list(next(loop))
    next(loop)
    sd = data.state_dict()  # window 1, none of it taken: micro-batch 3 of the epoch
    other = windows(range(9), 2)  # window 1 starts at micro-batch 2 here
    with pytest.raises(gradaccum.GradAccumError) as err:
        other.load_state_dict(sd)
    assert str(err.value) == (
        "windows(data, n=2).load_state_dict(state_dict): the checkpoint was saved with windows "
        "of n=3 (window sizes [3, 3, 3, 3, 3, 3, 3, 3] from window 0 on), but these windows have "
        "[2, 2, 2, 2, 2, 2, 2, 2]; resume with the n of the run that saved (another n would "
        "move every window boundary and optimizer step)."
    )
    assert taken(other) == [[0, 1], [2, 3], [4, 5], [6, 7], [8]]  # the refusal changed nothing
    short = windows(range(2), 3)
    with pytest.raises(gradaccum.GradAccumError) as err:
        short.load_state_dict(sd)
    assert str(err.value) == (
        "windows(data, n=3).load_state_dict(state_dict): the data is not the checkpoint's: its "
        "length is 2 micro-batches, the checkpoint's 9 micro-batches; resume with the data of "
        "the run that saved (a "
        "changed dataset, batch size or sampler would give other micro-batches without any "
        "error)."
    )
    bad = windows(range(9), 3)
    bad.load_state_dict({**sd, "in_window": 2})  # window 1 does not start at micro-batch 1
    with pytest.raises(gradaccum.GradAccumError, match=r"does not fit these windows"):
        taken(bad)


# -- over ranks ---------------------------------------------------------------------------------


def _uneven(rank: int, world: int, sized: bool) -> dict:
    length = 21 if rank == 0 else 20  # rank 1's last window of each epoch is empty
    source = list(range(length)) if sized else None
    sync = gradaccum.all_reduce()
    with gradaccum.sync.record_collectives() as log:
        if sized:
            data = windows(source, 4, sync=sync, epochs=2)
            total = len(data)
        else:
            data = windows(hidden_length(range(length)), 4, sync=sync)
            total = None
        got = [(w.epoch, w.index, list(w)) for w in data]
    return {
        "total": total,
        "got": got,
        "log": [(c.kind, c.purpose, c.nbytes) for c in log],
    }


@pytest.mark.distributed
@pytest.mark.parametrize("sized", [True, False], ids=["sized", "without-len"])
def test_ranks_agree_on_the_windows(sized: bool) -> None:
    r0, r1 = dist.values(dist.run(_uneven, sized, timeout=120))
    assert [(e, i) for e, i, _ in r0["got"]] == [(e, i) for e, i, _ in r1["got"]]
    if sized:
        assert r0["total"] == r1["total"] == 12
        assert [len(mb) for *_, mb in r1["got"]] == [4, 4, 4, 4, 4, 0] * 2
        assert [len(mb) for *_, mb in r0["got"]] == [4, 4, 4, 4, 4, 1] * 2
        # One tiny all-reduce per epoch (a failure flag, the position, the kind of data, the
        # window sizes, the epochs, the lengths: 13 int64), and nothing else.
        assert r0["log"] == [("all_reduce", "data lengths", 104)] * 2
    else:
        assert [len(mb) for *_, mb in r1["got"]] == [4, 4, 4, 4, 4, 0]
        # The epoch's agreement, then one 32-byte all-reduce per window (a failure flag, the
        # window, data left), and one that finds the data over.
        assert (
            r0["log"]
            == [("all_reduce", "data lengths", 104)] + [("all_reduce", "data left", 32)] * 7
        )


def _late_peer(rank: int, world: int) -> str:
    if rank == 1:
        return "gone"
    data = windows(range(3), 2, sync=gradaccum.all_reduce(), timeout=2)
    try:
        len(data)
    except gradaccum.GradAccumError as err:
        return str(err)
    return "no error"


@pytest.mark.distributed
def test_a_missing_peer_times_out() -> None:
    r0, r1 = dist.values(dist.run(_late_peer, timeout=120))
    assert r1 == "gone"
    assert "windows(data, n=2): the data lengths all_reduce failed on rank 0" in r0


def test_messages_in_full() -> None:
    data = windows(range(5), 2)
    loop = iter(data)
    next(iter(next(loop)))
    with pytest.raises(ValueError, match=r"left part-way") as err:
        next(loop)
    assert str(err.value) == (
        "windows(data, n=2): window 0 was left part-way, with micro-batches not taken; iterate "
        "every window you start to its end (for batch in window: ...) before asking for the "
        "next, so that no micro-batch is silently skipped."
    )
    with pytest.raises(TypeError) as err:
        windows(iter(range(3)), 2, epochs=2)
    assert str(err.value) == (
        "windows(data, n=2): data is an iterator (range_iterator), which gives its micro-batches "
        "once, but epochs=2; pass an iterable that can be iterated again (a DataLoader, a list, "
        "a class with __iter__), or epochs=1."
    )
