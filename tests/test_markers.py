"""The marker check of tests/conftest.py: what it counts as starting a Python process.

The check itself runs around every test; here its pieces are fed what a test would do, without
starting anything.
"""

from __future__ import annotations

import multiprocessing
import sys
from collections.abc import Callable

import conftest
import pytest


def recorded(action: Callable[[], object]) -> list[str]:
    """What the check records while ``action`` runs, taken away so that this test passes."""
    before = list(conftest._started)
    try:
        action()
        return conftest._started[len(before) :]
    finally:
        conftest._started[:] = before


def popen(*argv: str) -> Callable[[], object]:
    """What subprocess.Popen tells the audit hooks before it starts ``argv``."""
    return lambda: conftest._audit("subprocess.Popen", (None, list(argv), None, None))


@pytest.mark.parametrize(
    "argv",
    [
        [sys.executable, "-c", "pass"],
        ["python3", "examples/ddp.py", "--check"],
        ["torchrun", "--standalone", "--nproc_per_node", "2", "examples/ddp.py"],
        [sys.executable, "-m", "torch.distributed.run", "examples/ddp.py"],
    ],
)
def test_a_python_or_torchrun_subprocess_is_recorded(argv: list[str]) -> None:
    assert recorded(popen(*argv)) == [f"subprocess {' '.join(argv)}"]


@pytest.mark.parametrize(
    "argv",
    [
        ["git", "ls-files"],
        ["ruff", "format", "--check", "examples"],
        [sys.executable, "-m", "torch._inductor.compile_worker", "--workers=2"],
    ],
)
def test_other_programs_are_not(argv: list[str]) -> None:
    assert recorded(popen(*argv)) == []


def test_a_spawned_or_forkserver_process_is_recorded(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check wraps BaseProcess.start; a fork starts no interpreter and passes."""
    monkeypatch.setattr(conftest, "_process_start", lambda self: None)  # record, start nothing
    for method in ("spawn", "forkserver", "fork"):
        process = multiprocessing.get_context(method).Process(target=print)
        got = recorded(process.start)
        assert [entry.split()[:2] for entry in got] == (
            [] if method == "fork" else [["multiprocessing", method]]
        )
