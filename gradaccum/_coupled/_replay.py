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
    "check_flag",
    "check_generators",
    "reraise",
]

GENERATORS = (
    "torch.Generator, random.Random, numpy.random.Generator or numpy.random.RandomState objects"
)


def check_generators(where: str, generators: Any) -> tuple[Any, ...]:
    """``generators=`` checked: a sequence of random generators whose states can be replayed."""
    if isinstance(generators, (torch.Generator, random.Random)) or not isinstance(
        generators, Sequence
    ):
        raise TypeError(
            f"{where}: generators must be a list of {GENERATORS}, got {describe(generators)}; "
            f"wrap a single one in a list: generators=[g]."
        )
    for k, g in enumerate(generators):
        if not (
            isinstance(g, (torch.Generator, random.Random))
            or hasattr(g, "bit_generator")
            or (hasattr(g, "get_state") and hasattr(g, "set_state"))
        ):
            hint = (
                " (Python's global random, NumPy's global generator and torch's are replayed "
                "already: leave them out)"
                if g is random or g is getattr(sys.modules.get("numpy"), "random", None)
                else ""
            )
            raise TypeError(
                f"{where}: generators[{k}] must be one of {GENERATORS}, got {describe(g)}{hint}."
            )
    return tuple(generators)


def check_flag(where: str, name: str, value: Any) -> None:
    """A ``True``/``False`` keyword, checked."""
    if not isinstance(value, bool):
        raise TypeError(f"{where}: {name} must be True or False, got {describe(value)}.")


def _get(g: Any) -> Any:
    if isinstance(g, torch.Generator):
        return g.get_state()
    if isinstance(g, random.Random):
        return g.getstate()
    if hasattr(g, "bit_generator"):  # numpy.random.Generator
        return g.bit_generator.state
    return g.get_state()  # numpy.random.RandomState


def _set(g: Any, state: Any) -> None:
    if isinstance(g, torch.Generator):
        g.set_state(state)
    elif isinstance(g, random.Random):
        g.setstate(state)
    elif hasattr(g, "bit_generator"):
        g.bit_generator.state = state
    else:
        g.set_state(state)


class RandomStates:
    """The random states a forward may draw from, captured and replayed.

    torch's CPU generator and every initialised CUDA device's, Python's global ``random``,
    NumPy's global generator (when NumPy is imported), and ``generators``: explicit ones,
    which nothing could find otherwise.
    """

    def __init__(self, generators: tuple[Any, ...] = ()) -> None:
        self.generators = generators
        self.states: list[tuple[Any, ...]] = []
        self.after: tuple[Any, ...] | None = None

    def _now(self) -> tuple[Any, ...]:
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else []  # type: ignore[no-untyped-call]
        np = sys.modules.get("numpy")
        legacy = np.random.get_state() if np is not None else None
        own = tuple(_get(g) for g in self.generators)
        return torch.get_rng_state(), cuda, random.getstate(), legacy, own

    def _set(self, state: tuple[Any, ...]) -> None:
        cpu, cuda, python, legacy, own = state
        torch.set_rng_state(cpu)
        if cuda:
            torch.cuda.set_rng_state_all(cuda)
        random.setstate(python)
        if legacy is not None:
            sys.modules["numpy"].random.set_state(legacy)
        for g, s in zip(self.generators, own):
            _set(g, s)

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


# The relative difference (per row, see ReplayCheck) below which pass 2's representations are
# taken for pass 1's: rounding from nondeterministic kernels, or from another kernel for the
# same op (pass 1 runs without a graph), stays far below it; another dropout mask, another
# augmentation, another routing is far above (about sqrt(p) for a mask dropping p).
TOLERANCE = {torch.float64: 1e-6, torch.float32: 1e-3, torch.float16: 1e-2, torch.bfloat16: 6.25e-2}


def tolerance(dtype: torch.dtype) -> float:
    return TOLERANCE.get(dtype, 8 * torch.finfo(dtype).eps)


class ReplayCheck:
    """Pass 2's representations against pass 1's: an error when they differ beyond rounding.

    Per micro-batch and floating leaf, on the device: the largest over the rows of
    ``|pass 2 - pass 1| / (|pass 1| + 1e-3 * rms)`` (norms over each row; ``rms``, the leaf's
    mean row norm, keeps near-zero rows from dividing by zero), over the leaf's tolerance
    (``TOLERANCE``). The host reads them once, at the last micro-batch, and raises there: inside
    the window, so that under a sync the rank joins the boundary flagged as failed and every
    other rank raises too, and nothing is applied anywhere.
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
        with torch.no_grad():
            for now, then in zip(leaves, self.cached[j]):
                rows = then.shape[0]
                if now.shape != then.shape:  # another shape: another representation
                    self.scores.append(torch.tensor(float("inf")))
                    continue
                if rows == 0:
                    continue
                wide = torch.float64 if then.dtype == torch.float64 else torch.float32
                a = now.detach().reshape(rows, -1).to(wide)
                b = then.reshape(rows, -1).to(wide)
                ref = b.norm(dim=1)
                floor = 1e-3 * ref.mean() + torch.finfo(wide).tiny
                worst = ((a - b).norm(dim=1) / (ref + floor)).max()
                self.scores.append(worst / tolerance(then.dtype))
        if j == len(self.cached) - 1 and self.scores:
            self._check(torch.stack([t.cpu() for t in self.scores]).tolist())

    def _check(self, scores: list[float]) -> None:
        width = len(self.paths)
        bad = [(s, k) for k, s in enumerate(scores) if s > 1.0]  # NaN is not a replay error
        if not bad:
            return
        score, k = max(bad)
        j, i = divmod(k, width)
        dtype = self.cached[j][i].dtype
        raise GradAccumError(
            f"{self.call}: pass 2 did not reproduce pass 1's representations: {self.paths[i]} of "
            f"micro-batch {j} differs by {score * tolerance(dtype):.3g} (relative, per row; "
            f"{tolerance(dtype):.0e} is the most rounding explains in {dtype}), so the gradient "
            f"would be that of other representations. embed draws random numbers that were not "
            f"replayed (an explicit torch.Generator, numpy.random.Generator or random.Random: "
            f"pass it as generators=[...]), or depends on state that changed between the passes. "
            f"Nothing was applied; if the difference is expected, pass check_replay=False."
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
