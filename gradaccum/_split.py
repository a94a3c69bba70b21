"""Split a batch pytree into micro-batches along dim 0.

An even split uses einops (``(n b) ... -> n b ...``) and yields views, no copies. When ``n`` does
not divide the batch, the first ``B % n`` micro-batches get one extra row (as
``numpy.array_split``, docs/concepts.md, "Uneven splits"); the reductions weight every
micro-batch by its real size, so the result is still exact. Tensor leaves are split; every other
leaf (an int, a string, a flag) is passed unchanged to every micro-batch. A mapping that optree
keeps as a leaf (``collections.UserDict``, transformers' ``BatchEncoding``) is split by its
values and rebuilt with its own type.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Generic, TypeVar

import einops
import torch

from . import _tree
from ._errors import describe

__all__ = ["MicroBatches", "split"]

B = TypeVar("B")


class MicroBatches(Generic[B]):
    """Micro-batches already split by the caller, of any sizes.

    Pass it where [`accumulate()`][gradaccum.accumulate] expects the batch to choose the split
    yourself, for example micro-batches of different lengths from a bucketing sampler. The
    accumulated function then runs one micro-batch per element, whatever its ``n``; the ``mean``
    reduction weights each micro-batch by its number of rows, so the result is the gradient of the
    mean loss over all the rows.

    Args:
        batches: A sequence of batch pytrees of one structure (the same dict keys,
            tuple lengths and nesting), each with at least one tensor leaf and all tensor
            leaves of one micro-batch sharing their size along dim 0.

    Raises:
        TypeError: ``batches`` is not a list or tuple.
        ValueError: A micro-batch's tree differs from micro-batch 0's (the message names the
            micro-batch and the key path of the first difference). When the accumulated
            function runs: a micro-batch has no tensor leaf or 0 rows, or ``batches`` is empty
            without a sync (with one, an empty window joins the boundary with zero weight).

    Examples:
        >>> import torch, gradaccum
        >>> mbs = gradaccum.MicroBatches([torch.ones(3, 2), torch.ones(5, 2)])
        >>> len(mbs), [mb.shape[0] for mb in mbs]
        (2, [3, 5])
    """

    __slots__ = ("_batches",)

    def __init__(self, batches: Sequence[B]) -> None:
        if isinstance(batches, (str, bytes)) or not isinstance(batches, Sequence):
            raise TypeError(
                f"MicroBatches(batches): expected a list or tuple of micro-batch pytrees, got "
                f"{describe(batches)}; wrap your micro-batches in a list: "
                f"MicroBatches([mb0, mb1, ...])."
            )
        if len(batches) == 0:
            self._batches: tuple[B, ...] = ()  # an empty window: only under a sync (split)
            return
        first = _tree.flatten(batches[0])[1]
        for i in range(1, len(batches)):
            spec = _tree.flatten(batches[i])[1]
            _check_structure("MicroBatches(batches)", batches, i, first, spec)
        self._batches = tuple(batches)

    def __len__(self) -> int:
        return len(self._batches)

    def __iter__(self) -> Iterator[B]:
        return iter(self._batches)

    def __getitem__(self, i: int) -> B:
        return self._batches[i]

    def __repr__(self) -> str:
        return f"MicroBatches(<{len(self._batches)} micro-batches>)"


def _check_structure(where: str, batches: Sequence[Any], i: int, first: Any, spec: Any) -> None:
    """Refuse micro-batch ``i`` when its structure ``spec`` is not micro-batch 0's, ``first``."""
    if spec != first:
        raise ValueError(
            f"{where}: micro-batch {i} of the MicroBatches differs in structure from "
            f"micro-batch 0 {_tree.first_difference(batches[0], batches[i])}; give every "
            f"micro-batch the structure of micro-batch 0 (the same dict keys, tuple "
            f"lengths and nesting), e.g. put an optional entry in every micro-batch or "
            f"in none."
        )


def _rows(where: str, batch: Any) -> tuple[list[str], list[Any], Any, int]:
    """Flatten and validate ``batch``: (paths, leaves, spec, rows along dim 0)."""
    paths, leaves, spec = _tree.flatten_with_paths(batch)
    rows: int | None = None
    first_path = ""
    for path, leaf in zip(paths, leaves):
        if not isinstance(leaf, torch.Tensor):
            if hasattr(leaf, "__array__") or hasattr(leaf, "shape"):
                raise TypeError(
                    f"{where}: batch leaf {path} is {describe(leaf)}, which gradaccum does not "
                    f"split (only torch tensors are split; other leaves go whole to every "
                    f"micro-batch); convert it with torch.as_tensor, or pass it through another "
                    f"argument of step_fn."
                )
            continue
        if leaf.dim() == 0:
            raise ValueError(
                f"{where}: batch leaf {path} is a 0-dim tensor, which has no dim 0 to split "
                f"along; give it a leading batch dimension (x.unsqueeze(0)) or pass it through "
                f"another argument of step_fn."
            )
        if rows is None:
            rows, first_path = leaf.shape[0], path
        elif leaf.shape[0] != rows:
            raise ValueError(
                f"{where}: batch leaves disagree on their size along dim 0: {first_path} has "
                f"{rows} rows but {path} has {leaf.shape[0]}; every tensor in a batch must "
                f"have the same number of rows. Give every tensor leaf of the batch the same "
                f"number of rows, or pass tensors that are not split by row through another "
                f"argument of step_fn."
            )
    if rows is None:
        got = describe(batch) if not leaves else "leaves " + ", ".join(map(describe, leaves))
        raise ValueError(
            f"{where}: expected a batch pytree with at least one tensor leaf, got {got}"
            f"; pass the batch tensors (e.g. (x, y) or {{'x': x, 'y': y}}) as this argument."
        )
    return paths, leaves, spec, rows


def _open(tree: Any) -> Any:
    """``tree`` with the mappings optree keeps as leaves (``UserDict``) as dicts, or ``tree``."""
    for x in _tree.flatten(tree)[0]:  # a loop, not any(...): tensors need no ABC check
        if not isinstance(x, torch.Tensor) and isinstance(x, Mapping):
            break
    else:
        return tree
    return _tree.map_(lambda x: _open(dict(x)) if isinstance(x, Mapping) else x, tree)


def _close(where: str, like: Any, tree: Any) -> Any:
    """``tree`` (opened like ``like`` by ``_open``) with ``like``'s mapping types put back."""

    def back(x: Any, part: Any) -> Any:
        if not isinstance(x, Mapping):
            return part
        try:
            return type(x)(_close(where, dict(x), part))  # type: ignore[call-arg]
        except Exception as err:
            raise TypeError(
                f"{where}: the batch holds a mapping of type {type(x).__name__}, which gradaccum "
                f"splits by its values and rebuilds with {type(x).__name__}(dict); that raised "
                f"{type(err).__name__}: {err}. Pass its contents as a dict (dict(batch))."
            ) from err

    return _tree.map_(back, like, tree)


def _check_not_samples(where: str, batch: Any) -> None:
    """Refuse a Python list of per-sample containers, which would be split along each sample.

    A DataLoader with ``collate_fn=lambda x: x`` gives one: its samples are the list's elements,
    but a batch is split along dim 0 of its tensors, which is each sample's own (its tokens).
    """
    if type(batch) is not list or len(batch) < 2:
        return
    kinds = (Mapping, tuple, list)
    if not isinstance(batch[0], kinds):
        return
    spec = _tree.flatten(batch[0])[1]
    if all(isinstance(b, Mapping) for b in batch):  # dicts are samples, whatever their keys
        same = all(_tree.flatten(b)[1] == spec for b in batch)
        shape = " of one structure" if same else " (their keys differ)"
    elif any(not isinstance(b, kinds) or _tree.flatten(b)[1] != spec for b in batch[1:]):
        return
    else:
        shape = " of one structure"
    raise ValueError(
        f"{where}: the batch is a Python list of {len(batch)} {type(batch[0]).__name__}s{shape}, "
        f"per-sample containers as a DataLoader with collate_fn=lambda x: x gives; "
        f"gradaccum would split each of them along dim 0 of its own tensors (a sample's "
        f"tokens), not the list's samples. Collate the samples into one batch (tensors with "
        f"a leading batch dim: torch.utils.data.default_collate, or pad them), or pass "
        f"gradaccum.MicroBatches([...]) with the micro-batches you chose; if the elements are "
        f"not samples (two towers), pass them as a tuple."
    )


def split(where: str, batch: Any, n: int, *, short_ok: bool = False) -> list[tuple[Any, int]]:
    """``[(micro_batch, rows), ...]`` of ``batch`` (a ``MicroBatches`` is validated, used as given).

    With ``short_ok`` (a data-parallel rank's short last batch), fewer than ``n`` rows give one
    micro-batch per row, and 0 rows none.
    """
    _check_not_samples(where, batch)
    opened = _open(batch) if not isinstance(batch, MicroBatches) else batch
    if opened is not batch:
        micro = split(where, opened, n, short_ok=short_ok)
        return [(_close(where, batch, mb), rows) for mb, rows in micro]
    if isinstance(batch, MicroBatches):
        if not len(batch) and not short_ok:
            raise ValueError(
                f"{where}: the MicroBatches is empty; without a sync there is nothing to "
                f"accumulate: pass MicroBatches([mb0, ...]) with one or more micro-batches (with "
                f"sync=, an empty MicroBatches joins the boundary with zero weight)."
            )
        out = []
        first: Any = None
        for i, mb in enumerate(batch):
            _, _, mb_spec, rows = _rows(f"{where} micro-batch {i}", _open(mb))
            if rows == 0:
                raise ValueError(
                    f"{where}: micro-batch {i} of the MicroBatches has 0 rows; a micro-batch "
                    f"needs at least one row. Drop empty micro-batches before passing them."
                )
            if i == 0:
                first = mb_spec
            else:  # checked at construction too; a dict may have changed since
                _check_structure(where, batch._batches, i, first, mb_spec)
            out.append((mb, rows))
        return out

    _, leaves, spec, rows = _rows(where, batch)
    if short_ok:
        n = min(n, rows)
        if n == 0:
            return []
    if rows == 0:
        raise ValueError(
            f"{where}: the batch has 0 rows along dim 0, so there is nothing to accumulate; pass "
            f"a batch with at least n={n} rows."
        )
    if n > rows:
        raise ValueError(
            f"{where}: n={n} micro-batches is more than the {rows} rows of the batch, so some "
            f"micro-batches would be empty; pass n <= {rows}, or a larger batch."
        )
    if n == 1:  # the batch is its one micro-batch, as given
        return [(batch, rows)]
    if rows % n == 0:
        parts = [
            einops.rearrange(x, "(n b) ... -> n b ...", n=n).unbind(0)
            if isinstance(x, torch.Tensor)
            else None
            for x in leaves
        ]
        sizes = [rows // n] * n
    else:
        small, extra = rows // n, rows % n  # not divmod: Dynamo rejects it on symbolic sizes
        sizes = [small + 1] * extra + [small] * (n - extra)
        parts = [torch.split(x, sizes) if isinstance(x, torch.Tensor) else None for x in leaves]
    return [
        (
            _tree.unflatten(spec, [p[i] if p is not None else x for p, x in zip(parts, leaves)]),
            sizes[i],
        )
        for i in range(n)
    ]
