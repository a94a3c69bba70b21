"""What a second forward over the same micro-batch must see again, and must not change twice.

A two-pass transform runs each micro-batch's forward twice: once without a graph (pass 1) and
once with one (pass 2). For the gradient of pass 2 to be the gradient of what pass 1 computed,
pass 2 replays pass 1's random numbers (dropout masks: ``RandomStates``, captured before each
micro-batch of pass 1 and set again before the same micro-batch of pass 2, as GradCache does).
And the window's state must end as after one forward per micro-batch: ``KeptBuffers`` puts back
every module buffer that pass 2 changed (BatchNorm's running statistics, its batch counter) to
what pass 1 left.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["KeptBuffers", "RandomStates", "reraise"]


class RandomStates:
    """The random states of the CPU and of every initialised CUDA device, captured and replayed."""

    def __init__(self) -> None:
        self.states: list[tuple[torch.Tensor, list[torch.Tensor]]] = []
        self.after: tuple[torch.Tensor, list[torch.Tensor]] | None = None

    @staticmethod
    def _now() -> tuple[torch.Tensor, list[torch.Tensor]]:
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else []  # type: ignore[no-untyped-call]
        return torch.get_rng_state(), cuda

    @staticmethod
    def _set(state: tuple[torch.Tensor, list[torch.Tensor]]) -> None:
        cpu, cuda = state
        torch.set_rng_state(cpu)
        if cuda:
            torch.cuda.set_rng_state_all(cuda)

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
