"""What a second forward over the same micro-batch must see again, and must not change twice.

A two-pass transform runs each micro-batch's forward twice: once without a graph (pass 1) and
once with one (pass 2). For the gradient of pass 2 to be the gradient of what pass 1 computed,
pass 2 replays pass 1's random numbers (``RandomStates``, captured before each micro-batch of
pass 1 and set again before the same micro-batch of pass 2, as GradCache does): torch's CPU and
CUDA generators, Python's ``random``, NumPy's global generator (if NumPy is imported), and the
generators handed in (``generators=``). ``ReplayCheck`` compares what pass 2 recomputed with
what pass 1 cached, so that randomness from anywhere else (or state that changed between the
passes) is an error, not another gradient. And the window's state must end as after one forward
per micro-batch: ``KeptBuffers`` puts back every module buffer that pass 2 changed (BatchNorm's
running statistics, its batch counter) to what pass 1 left.
"""

from __future__ import annotations

import functools
import math
import random
import sys
from collections.abc import Sequence
from typing import Any

import torch

from .._errors import GradAccumError, describe

__all__ = [
    "KeptBuffers",
    "RandomStates",
    "ReplayCheck",
    "check_generators",
    "load_states",
    "reraise",
    "saved_states",
]

GENERATORS = (
    "torch.Generator, random.Random, numpy.random.Generator or numpy.random.RandomState objects"
)


def _numpy_kinds() -> tuple[type, ...]:
    """NumPy's ``Generator`` and ``RandomState`` (none when NumPy was never imported)."""
    np = sys.modules.get("numpy")
    return (np.random.Generator, np.random.RandomState) if np is not None else ()


def check_generators(where: str, generators: Any) -> tuple[Any, ...]:
    """``generators=`` checked: a sequence of random generators whose states can be replayed."""
    if isinstance(generators, (torch.Generator, random.Random, str, bytes)) or not isinstance(
        generators, Sequence
    ):
        fix = (
            "wrap a single one in a list: generators=[g]"
            if isinstance(generators, (torch.Generator, random.Random, *_numpy_kinds()))
            else "pass a list or tuple of them: generators=[g1, g2]"
        )
        raise TypeError(
            f"{where}: generators must be a list of {GENERATORS}, got {describe(generators)}; "
            f"{fix}."
        )
    np = sys.modules.get("numpy")
    for k, g in enumerate(generators):
        if g is random or (np is not None and g is np.random) or g is torch.random:
            raise TypeError(
                f"{where}: generators[{k}] is the module {g.__name__}: Python's global random, "
                f"NumPy's global generator and torch's are replayed already; pass only explicit "
                f"generator objects in generators= (leave the modules out)."
            )
        if isinstance(g, random.SystemRandom):
            raise TypeError(
                f"{where}: generators[{k}] is a random.SystemRandom, which draws from the "
                f"operating system and has no state to replay; use a seeded random.Random."
            )
        if not isinstance(g, (torch.Generator, random.Random, *_numpy_kinds())):
            raise TypeError(
                f"{where}: generators[{k}] must be one of {GENERATORS}, got {describe(g)}; "
                f"pass the generator objects the functions draw from."
            )
    return tuple(generators)


def _get(g: Any) -> Any:
    if isinstance(g, torch.Generator):
        return g.get_state()
    if isinstance(g, random.Random):
        return g.getstate()
    if hasattr(g, "bit_generator"):  # numpy.random.Generator
        return g.bit_generator.state
    return g.get_state()  # numpy.random.RandomState


def _put(g: Any, state: Any) -> None:
    if isinstance(g, torch.Generator):
        g.set_state(state)
    elif isinstance(g, random.Random):
        g.setstate(state)
    elif hasattr(g, "bit_generator"):
        g.bit_generator.state = state
    else:
        g.set_state(state)


def _plain(x: Any) -> Any:
    """A generator's state in what ``torch.load(weights_only=True)`` reads back (``_unplain``)."""
    if isinstance(x, torch.Tensor):
        return x.clone()
    if isinstance(x, dict):
        return {"dict": {k: _plain(v) for k, v in x.items()}}
    if isinstance(x, (list, tuple)):
        return {"tuple" if isinstance(x, tuple) else "list": [_plain(v) for v in x]}
    if hasattr(x, "dtype") and hasattr(x, "shape"):  # a NumPy array (MT19937's key)
        return {"ndarray": torch.from_numpy(x.astype("int64")), "dtype": str(x.dtype)}
    if hasattr(x, "item") and not isinstance(x, (bool, int, float, str)):  # a NumPy scalar
        return x.item()
    return x


def _unplain(x: Any) -> Any:
    if isinstance(x, dict):
        if "ndarray" in x:
            return x["ndarray"].numpy().astype(x["dtype"])
        if "dict" in x:
            return {k: _unplain(v) for k, v in x["dict"].items()}
        if "tuple" in x:
            return tuple(_unplain(v) for v in x["tuple"])
        return [_unplain(v) for v in x["list"]]
    return x


def _kind(g: Any) -> str:
    """A generator's kind, as far as its state fits only its own kind."""
    if isinstance(g, torch.Generator):
        return f"torch.Generator(device={g.device.type!r})"
    if hasattr(g, "bit_generator"):
        return f"numpy.random.Generator({type(g.bit_generator).__name__})"
    return f"{type(g).__module__}.{type(g).__qualname__}"


def saved_states(generators: tuple[Any, ...]) -> list[Any]:
    """The explicit generators' states, for a checkpoint (read back by ``load_states``)."""
    return [{"kind": _kind(g), "state": _plain(_get(g))} for g in generators]


def load_states(where: str, generators: tuple[Any, ...], saved: Any, apply: bool = True) -> None:
    """Set the explicit generators to the states of a checkpoint, refused if they differ.

    ``apply=False``: only the check (nothing is set).
    """
    kinds = [_kind(g) for g in generators]
    got = [s.get("kind") for s in saved] if isinstance(saved, list) else None
    if got != kinds:
        raise ValueError(
            f"{where}: the checkpoint holds the states of the generators {got} (the loss's "
            f"generators= when it was saved), this step's loss has {kinds}; build the loss with "
            f"the same generators=, in the same order."
        )
    for g, s in zip(generators, saved):
        if apply:
            _put(g, _unplain(s["state"]))


def _same(a: Any, b: Any) -> bool:
    """Whether two captured states are equal (tensors, NumPy arrays, nested containers)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    try:
        equal = a == b
        if isinstance(equal, bool):
            return equal
    except (ValueError, RuntimeError):  # containers of arrays or tensors: element by element
        pass
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return (
            isinstance(b, (list, tuple))
            and len(a) == len(b)
            and all(_same(x, y) for x, y in zip(a, b))
        )
    np = sys.modules.get("numpy")
    return bool(np is not None and np.array_equal(a, b))


def _set_cuda(state: Any) -> None:
    torch.cuda.set_rng_state_all(state)


def _set_numpy(state: Any) -> None:
    sys.modules["numpy"].random.set_state(state)


class RandomStates:
    """The random states a forward may draw from, captured and replayed.

    The sources: torch's CPU generator, every initialised CUDA device's, Python's global
    ``random``, NumPy's global generator (when NumPy is imported), and ``generators``: explicit
    ones, which nothing could find otherwise. A state is a list with one entry per source
    (``None`` where a source was absent).

    ``coupled`` runs the same ``embed`` in both passes: pass 2 sets every source to where pass 1
    started each micro-batch (``replay``), and ``restore`` leaves them as pass 1 left them.
    ``window_stats`` runs ``stats`` in pass 1 and ``loss`` in pass 2, which may draw other
    numbers: ``replay_drawn`` sets only the sources micro-batch ``j``'s ``stats`` drew from (its
    router's dropout, say), and ``check_drawn`` then requires ``loss`` to have left each of them
    where ``stats`` did, else ``loss``'s extra numbers would repeat those of the next
    micro-batch. A source ``stats`` did not draw from is left to run on through pass 2 (a
    dropout in ``loss`` after a count in ``stats``: fresh masks per micro-batch, as a plain
    loop draws them).
    """

    NAMES = (
        "torch's CPU generator",
        "torch's CUDA generators",
        "Python's random",
        "NumPy's global generator",
    )

    def __init__(self, generators: tuple[Any, ...] = ()) -> None:
        self.generators = generators
        self.states: list[list[Any]] = []
        self.after: list[Any] | None = None
        self._drawn: list[int] = []
        self._held: list[Any] = []
        self._j = 0

    def _now(self) -> list[Any]:
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None  # type: ignore[no-untyped-call]
        np = sys.modules.get("numpy")
        legacy = np.random.get_state() if np is not None else None
        own = [_get(g) for g in self.generators]
        return [torch.get_rng_state(), cuda, random.getstate(), legacy, *own]

    def _set(self, state: list[Any], which: Sequence[int] | None = None) -> None:
        setters: list[Any] = [torch.set_rng_state, _set_cuda, random.setstate, _set_numpy]
        setters += [functools.partial(_put, g) for g in self.generators]
        for k, (put, value) in enumerate(zip(setters, state)):
            if value is not None and (which is None or k in which):
                put(value)

    def _name(self, k: int) -> str:
        return self.NAMES[k] if k < len(self.NAMES) else f"generators[{k - len(self.NAMES)}]"

    def capture(self) -> None:
        """Keep the random state as it is now: before the next micro-batch of pass 1."""
        self.states.append(self._now())

    def end_of_pass(self) -> None:
        """Keep the state pass 1 ended with: the one the window leaves behind."""
        self.after = self._now()

    def replay(self, j: int) -> None:
        """Set the state micro-batch ``j`` of pass 1 started with."""
        self._set(self.states[j])

    def restore(self) -> None:
        """Leave the random state as pass 1 left it (as one forward per micro-batch would)."""
        if self.after is not None:
            self._set(self.after)

    def _post(self, j: int) -> list[Any]:
        """The state micro-batch ``j`` of pass 1 ended with."""
        after = self.states[j + 1] if j + 1 < len(self.states) else self.after
        assert after is not None
        return after

    def replay_drawn(self, j: int) -> None:
        """``window_stats``'s pass 2: set the sources ``stats`` drew from to where it started.

        Their pass-2 states (where earlier losses left them) are kept, and put back by
        ``check_drawn``: a loss that draws afresh from a source continues from there.
        """
        before, after = self.states[j], self._post(j)
        self._drawn = [k for k, (a, b) in enumerate(zip(before, after)) if not _same(a, b)]
        self._j = j
        if self._drawn:
            self._held = self._now()
            self._set(before, self._drawn)

    def check_drawn(self, call: str) -> None:
        """After micro-batch ``j``'s loss: each source ``stats`` drew from is where it left it.

        Then those sources go back to their pass-2 states (``replay_drawn``).
        """
        if not self._drawn:
            return
        now, after = self._now(), self._post(self._j)
        off = [self._name(k) for k in self._drawn if not _same(now[k], after[k])]
        self._set(self._held, self._drawn)
        if off:
            raise GradAccumError(
                f"{call}: the loss of micro-batch {self._j} drew other random numbers than "
                f"stats did from {', '.join(off)} (stats drew some, the loss more or fewer), so "
                f"its extra numbers would repeat those of another micro-batch; compute in stats "
                f"the same forward that draws them (up to what it counts), or draw none in "
                f"stats: a source stats does not draw from runs on through the loss."
            )


# The relative difference (per row, see ReplayCheck) below which pass 2's representations are
# taken for pass 1's: rounding from nondeterministic kernels, or from another kernel for the
# same op (pass 1 runs without a graph), stays far below it; another dropout mask, another
# augmentation, another routing is far above (about sqrt(p) for a mask dropping p).
TOLERANCE = {torch.float64: 1e-6, torch.float32: 1e-3, torch.float16: 1e-2, torch.bfloat16: 6.25e-2}


def tolerance(dtype: torch.dtype) -> float:
    return TOLERANCE.get(dtype, 8 * torch.finfo(dtype).eps)


class ReplayCheck:
    """Pass 2's representations against pass 1's: an error when they differ beyond rounding.

    Per micro-batch and floating leaf, on the device, in float64: the largest over the rows of
    ``|pass 2 - pass 1| / (|pass 1| + floor)`` (norms over each row), over the leaf's tolerance
    (``TOLERANCE``). ``floor`` keeps rows near zero from dividing by zero: the rounding of the
    leaf's dtype at the scale of its mean row norm (``2 * eps / tolerance`` times it), or of the
    largest row norm of any leaf of the micro-batch where the leaf is all zeros in pass 1
    (rounding in a leaf that is zero is relative to the magnitudes around it). Non-finite
    elements must be the same in both passes (else the row differs); they are left out of the
    norms, so a NaN in one row does not hide a difference in another. The host reads the scores
    once, at the last micro-batch, and raises there: inside the window, so that under a sync
    the rank joins the boundary flagged as failed and every other rank raises too, and nothing
    is applied anywhere.
    """

    def __init__(
        self, call: str, paths: Sequence[str], cached: list[tuple[torch.Tensor, ...]]
    ) -> None:
        self.call = call
        self.paths = paths
        self.cached = cached  # per micro-batch: pass 1's floating leaves, this rank's rows
        self.scores: list[torch.Tensor] = []

    def compare(self, j: int, leaves: Sequence[torch.Tensor]) -> None:
        """Micro-batch ``j``'s pass-2 floating leaves; at the last, raise if any differed."""
        if j == 0:
            self.scores = []
        f64 = torch.float64
        with torch.no_grad():
            pairs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None] = []
            big = torch.zeros((), dtype=f64, device=self.cached[j][0].device)
            for now, then in zip(leaves, self.cached[j]):
                if now.shape != then.shape:  # another shape: another representation
                    pairs.append(None)
                    continue
                rows, width = then.shape[0], math.prod(then.shape[1:])
                a = now.detach().reshape(rows, width).to(f64)
                b = then.reshape(rows, width).to(f64)
                fa, fb = a.isfinite(), b.isfinite()
                # Non-finite where the other is not, or another non-finite value: the row differs.
                odd = (fa != fb) | (~fa & ~((a == b) | (a.isnan() & b.isnan())))
                a, b = torch.where(fa, a, 0.0), torch.where(fb, b, 0.0)
                ref = b.norm(dim=1)
                if rows:
                    big = torch.maximum(big, ref.max())
                pairs.append((a, b, ref, odd.any(dim=1)))
            for pair, then in zip(pairs, self.cached[j]):
                tol = tolerance(then.dtype)
                noise = 2 * torch.finfo(then.dtype).eps / tol  # rounding, in units of the bound
                if pair is None:
                    self.scores.append(torch.full((), float("inf"), dtype=f64, device=big.device))
                    continue
                a, b, ref, odd = pair
                if a.shape[0] == 0:
                    continue
                # Rounding at the scale of the leaf's rows (of the micro-batch's largest row
                # where the leaf is all zeros in pass 1): below it, no row counts as differing.
                mean = ref.mean()
                floor = noise * torch.where(mean > 0, mean, big) + torch.finfo(f64).tiny
                worst = ((a - b).norm(dim=1) / (ref + floor)).masked_fill(odd, float("inf"))
                self.scores.append(worst.max() / tol)  # on the device: no read here
        if j == len(self.cached) - 1 and self.scores:
            self._check(torch.stack(self.scores).tolist())

    def _check(self, scores: list[float]) -> None:
        width = len(self.paths)
        bad = [(s, k) for k, s in enumerate(scores) if s > 1.0]
        if not bad:
            return
        score, k = max(bad)
        j, i = divmod(k, width)
        dtype = self.cached[j][i].dtype
        how = (
            "differs in shape or in where it is not finite"
            if score == float("inf")
            else f"differs by {score * tolerance(dtype):.3g} (relative, per row; "
            f"{tolerance(dtype):.0e} is the most rounding explains in {dtype})"
        )
        raise GradAccumError(
            f"{self.call}: pass 2 did not reproduce pass 1's representations: {self.paths[i]} of "
            f"micro-batch {j} {how}, so the gradient would be that of other representations. "
            f"embed draws random numbers that were not replayed (an explicit torch.Generator, "
            f"numpy.random.Generator or random.Random: pass it as generators=[...]), or depends "
            f"on state that changed between the passes. Nothing was applied; if the difference "
            f"is expected, pass check_replay=False (the same on every rank)."
        )


class KeptBuffers:
    """Inside ``with``: the buffers of every module called are put back on exit.

    A global forward pre-hook copies a module's own buffers the first time it is called inside
    the block; on exit each is copied back in place, so pass 2's forwards leave BatchNorm's
    running statistics as pass 1 left them. Buffers a function changes outside any module call
    are not seen.
    """

    def __init__(self) -> None:
        self.saved: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self.handle: Any = None

    def _pre(self, module: torch.nn.Module, _args: Any) -> None:
        if id(module) in self.saved:
            return
        kept = []
        for buf in module._buffers.values():
            if isinstance(buf, torch.Tensor):
                kept.append((buf, buf.detach().clone()))
        self.saved[id(module)] = kept

    def __enter__(self) -> KeptBuffers:
        self.handle = torch.nn.modules.module.register_module_forward_pre_hook(self._pre)
        return self

    def __exit__(self, *exc: object) -> None:
        self.handle.remove()
        with torch.no_grad():
            for kept in self.saved.values():
                for buf, copy in kept:
                    buf.copy_(copy)
        self.saved.clear()


def reraise(err: BaseException, *_args: Any) -> Any:
    """Raise ``err`` again: a micro-batch's forward that stands for a failure before pass 1."""
    raise err
