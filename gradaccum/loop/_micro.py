"""A ``loop.Step``'s micro-steps: its trainable parameters and each backward into the window.

``MicroSteps`` keeps the parameters the window trains (those with ``requires_grad`` when it
started, followed between windows, refused in the middle of one) and runs each micro-batch's
backward into the window's running sums.

The fast path (every sum in its parameter's dtype): ``Step.add`` runs ``backward()`` into the
window that ``Accumulator._live`` opened at the window's first micro-batch (``open``). The
parameters' ``.grad`` point at the window's zeroed storage when its sync makes it up front (the
flat buckets under ``all_reduce()``), and every backward adds in place; otherwise the first
backward's gradients become the sums (``Window.adopt``, from a hook as each is produced) and the
later ones add in place. Every trainable parameter has a hook until a backward of the window
first reaches it: that is the ``used`` metric (``backward`` returns its mask). Other sums
(another dtype) take the generic path (``generic``): ``torch.autograd.grad``, then the
window's ``add``.

The window's metrics (``shapes``), summed over the micro-batches and the ranks in the boundary
collective that already carries the window's weight: ``used`` (per trainable parameter, a
count that is 0 exactly when no micro-batch reached it), ``saves`` (``loop._boundary``),
``loss`` and ``micro_batches`` (``StepStats``).
"""

from __future__ import annotations

import functools
import operator
from typing import Any, cast

import torch

from .. import _hooks, _metrics, _tree
from .._autograd import backward, plain_tensors
from .._core.accumulator import Accumulator
from .._core.protocol import Window
from .._core.state import AccumState
from .._layout import check_grads

__all__ = ["MicroSteps"]

_MASKS = 256  # the used-patterns kept on the device (each one is copied there once)


def _tensor(x: Any) -> bool:
    return isinstance(x, torch.Tensor)


class MicroSteps:
    """The trainable parameters of a ``Step`` and the backward of each micro-batch.

    Args:
        acc: The step's accumulator (its windows are opened here).
        model: The module: its parameters as built, each followed through ``requires_grad``.
    """

    def __init__(self, acc: Accumulator, model: torch.nn.Module) -> None:
        self.acc = acc
        self.names: list[str] = []
        self.params: list[torch.nn.Parameter] = []
        self._inputs: tuple[torch.nn.Parameter, ...] = ()
        self._plain = False
        # Every parameter of the model (as built) and its requires_grad when the window started:
        # read at each add, without walking the modules.
        self._every = list(model.named_parameters())
        self._flags = [p.requires_grad for _, p in self._every]
        self._zeros: list[torch.Tensor | None] = []
        self._masks: dict[Any, torch.Tensor] = {}
        self._device = torch.device("cpu")
        # The fast path (every sum in its parameter's dtype): the backwards run straight into the
        # window's sums, which the trainable parameters' .grad point at.
        self.fast = False
        self._slot: list[int] = []  # each trainable parameter's leaf in the window's layout
        self.win: Window | None = None  # the window in progress, once a micro-batch opened it
        self._first: list[Any] = []  # per parameter: its hook's remover until a backward of the
        # window reaches it
        self._hit: dict[int, torch.Tensor] = {}  # the parameters those hooks saw in this backward
        self._adopting = False  # the window's first backward: its gradients become the sums
        self._seeds: dict[tuple[float, torch.dtype, torch.device], torch.Tensor] = {}

    # -- the trainable parameters ----------------------------------------------------------------

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """The window's metrics: see the module notes."""
        return {"loss": (), "micro_batches": (), "saves": (3,), "used": (len(self.names),)}

    def train(self, where: str, old: AccumState[Any] | None) -> AccumState[Any]:
        """Make the parameters with ``requires_grad`` now those of the window that starts.

        Returns:
            The state of the new window: at ``old``'s window and epoch, or fresh (``None``).
        """
        named = [(k, p) for (k, p), on in zip(self._every, self._flags) if on]
        if not named:
            raise ValueError(
                f"{where}: the model has no trainable parameters (none with requires_grad); "
                f"unfreeze what you mean to train."
            )
        if old is not None and old.reduce_state is not None:
            raise ValueError(
                f"{where}: the trainable parameters (requires_grad) changed since the last "
                f"window, but the sync keeps a state between windows shaped like the old ones "
                f"(its custom reduction's, e.g. error feedback), which would not fit; keep "
                f"requires_grad fixed with this sync, or build a new sync and Step after "
                f"changing it. Nothing was changed."
            )
        self.drop()
        self.names = [k for k, _ in named]
        self.params = [p for _, p in named]
        self._inputs = tuple(self.params)  # the backward's inputs
        self._plain = plain_tensors(self.params)
        self._zeros = [None] * len(named)
        self._masks = {}
        state = self.acc.init({k: p.detach() for k, p in named}, metrics=self.shapes())
        state = state if old is None else state._replace(window=old.window, epoch=old.epoch)
        self._device = _metrics.device_of(state.layout)
        self.fast = state.layout.same_dtypes
        order = _tree.flatten({k: i for i, k in enumerate(self.names)})[0]  # the layout's order
        self._slot = [0] * len(named)
        for leaf, i in enumerate(order):
            self._slot[i] = leaf
        return state

    def follow(self, where: str, state: AccumState[Any]) -> AccumState[Any]:
        """Before a micro-batch (or an empty window's boundary): follow ``requires_grad``.

        At a window's start the window trains the parameters trainable now; in the middle of
        one, a change is refused, naming the parameter.

        Returns:
            ``state``, or the state of a window that trains the parameters trainable now.
        """
        flags = [p.requires_grad for _, p in self._every]
        if flags == self._flags:
            return state
        if state.micro_step == 0:
            before = self._flags
            self._flags = flags
            try:
                return self.train(where, state)
            except BaseException:
                self._flags = before
                raise
        k, now = next(
            (k, now) for (k, _), now, was in zip(self._every, flags, self._flags) if now != was
        )
        raise ValueError(
            f"{where}: the parameter {k!r} was {'unfrozen' if now else 'frozen'} "
            f"(requires_grad={now}) in the middle of window {state.window}, after "
            f"{state.micro_step} micro-batch(es); change requires_grad between windows (after "
            f"step.apply()), where the step follows it as a plain loop would. This micro-batch "
            f"was not added."
        )

    def on_device(self, key: Any, values: tuple[float, ...]) -> torch.Tensor:
        """``values`` as a tensor on the sums' device, copied there once per ``key``.

        The copy is from pinned memory on CUDA, so it does not wait for the device either.
        """
        t = self._masks.get(key)
        if t is None:
            if len(self._masks) >= _MASKS:
                self._masks.clear()
            dtype = torch.float32 if self._device.type == "mps" else torch.float64
            host = torch.tensor(values, dtype=dtype)
            if self._device.type == "cuda":
                host = host.pin_memory()
            t = self._masks[key] = host.to(self._device, non_blocking=True)
        return t

    # -- the fast path: the backward into the window's sums --------------------------------------

    def open(self, where: str, state: AccumState[Any]) -> Window:
        """The window in progress, opened at its first micro-batch (or after a resume).

        A new window's backwards run into zeroed storage, when its sync makes it up front
        (``Window.prepare``: the flat buckets under ``all_reduce()``): the parameters' ``.grad``
        point at it from the start, as at a restored window (a checkpoint's sums). Otherwise
        the first backward's gradients become the sums (``Window.adopt``, from a hook as each is
        produced, as ``accumulate`` does). Either way every trainable parameter gets a hook that
        tells, once per window, that a backward reached it (the ``used`` metric): a C callable
        (``operator.setitem`` into ``_hit``), registered and removed in C (``_hooks``), unless it
        adopts.
        """
        window = self.win
        if window is not None:
            return window
        params = self.params
        if state.sums is None:
            for p in params:  # (what the user left there would be added into the sums)
                p.grad = None
        window = self.acc._live(where, state)
        hit = self._hit
        if state.sums is not None:  # restored sums
            sums = state.sums
            for k, p in zip(self.names, params):
                p.grad = sums[k]
        elif window.prepare(zero=False):  # zeroed storage: every backward adds into it
            storage = window.sums
            assert storage is not None
            for p, leaf in zip(params, self._slot):
                p.grad = storage[leaf]
        else:
            self._adopting = True
        if self._adopting:
            marks = [functools.partial(self._on_first, i) for i in range(len(params))]
        else:
            marks = [functools.partial(operator.setitem, hit, i) for i in range(len(params))]
        self.win = window
        hit.clear()
        self._first = _hooks.register(params, marks)
        return window

    def _on_first(self, i: int, p: torch.Tensor) -> None:
        """A backward reached parameter ``i``, for the first time in the window (adopting)."""
        if self._adopting:  # its first gradient: moved into the window's storage
            p.grad = self.win.adopt(self._slot[i], p.grad)  # type: ignore[union-attr]
        self._hit[i] = p

    def _seed(self, value: torch.Tensor, scale: Any) -> torch.Tensor:
        """``scale`` (a number, or a ``Mean``'s tensor ``n``) as the seed of ``value``'s backward.

        In ``value``'s dtype and on its device; a number's seed is made once (no copy per
        micro-batch), a tensor's is converted on the device (no host sync).
        """
        if _tensor(scale):
            return cast(torch.Tensor, scale).to(device=value.device, dtype=value.dtype)
        key = (scale, value.dtype, value.device)
        seed = self._seeds.get(key)
        if seed is None:
            if len(self._seeds) >= _MASKS:
                self._seeds.clear()
            seed = self._seeds[key] = torch.full((), scale, dtype=value.dtype, device=value.device)
        return seed

    def backward(self, window: Window, value: torch.Tensor, scale: Any) -> torch.Tensor:
        """Backward of ``value``, scaled by ``scale``, into the sums; the ``used`` metric's mask.

        The mask has a 1 for each parameter that this backward reached first in the window, so
        its sum over the window is 1 for a parameter that any micro-batch reached (0 else).
        """
        seed = self._seed(value, scale)
        params = self.params
        window.begin(1)
        backward(value, seed, self._inputs, self._plain)
        if self._adopting:  # the parameters this first backward did not reach: a zero sum
            self._adopting = False
            for i, p in enumerate(params):
                if p.grad is None:
                    p.grad = window.adopt(self._slot[i], None)
        window.step()
        hit = self._hit
        if not hit:
            return self.on_device("no new use", (0.0,) * len(params))
        first = self._first
        for i in hit:
            first[i]()
            first[i] = None
        reached = tuple(sorted(hit))
        hit.clear()
        mask = [0.0] * len(params)
        for i in reached:
            mask[i] = 1.0
        return self.on_device(("used", reached), tuple(mask))

    def drop(self) -> None:
        """Let the window in progress go (closed, aborted or replaced): its hooks too.

        The parameters' ``.grad``, its running sums, are set to ``None``: ``apply()`` sets them
        from the boundary's result, and a window that failed leaves nothing there.
        """
        if self.win is not None:
            for p in self.params:
                p.grad = None
        _hooks.remove(self._first)
        self._first = []
        self._hit.clear()
        self.win = None
        self._adopting = False

    # -- the generic path: each gradient taken, then added ---------------------------------------

    def _zero(self, i: int) -> torch.Tensor:
        """Parameter ``i``'s gradient where the loss did not reach it (no memory of its own)."""
        z = self._zeros[i]
        if z is None:
            p = self.params[i]
            z = self._zeros[i] = torch.zeros((), dtype=p.dtype, device=p.device).expand(p.shape)
        return z

    def generic(
        self, where: str, state: AccumState[Any], value: torch.Tensor, scale: Any
    ) -> tuple[Window, torch.Tensor]:
        """``value``'s gradient, scaled by ``scale``, taken and added into the window's sums.

        Returns:
            The window, and the ``used`` metric's mask: the parameters the gradient reached.
        """
        # A number scales the sums in their dtype (alpha), a tensor n the backward (its seed).
        seed, alpha = (self._seed(value, scale), 1) if _tensor(scale) else (None, scale)
        grads = torch.autograd.grad(value, self.params, seed, allow_unused=True)
        used = tuple(g is not None for g in grads)
        tree = {
            k: g if g is not None else self._zero(i)
            for i, (k, g) in enumerate(zip(self.names, grads))
        }
        # zeros: apply() puts this rank's count there (the same width: the buckets of the
        # window's sums hold the tail the boundary sends)
        mask = self.on_device(used, used)
        window = self.acc._live(where, state)
        window.begin(1)
        window.add(check_grads(where, state.layout, tree), alpha)
        window.step()
        return window, mask
