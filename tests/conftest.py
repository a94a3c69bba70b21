"""Fixtures shared by the test modules."""

from __future__ import annotations

import datetime
import multiprocessing
import multiprocessing.process
import os
import sys
from collections.abc import Generator, Iterator
from typing import Any

import pytest
import torch.distributed as dist
from dist import free_port

# A user's script, run by tests/test_exit.py as 2 ranks: its state is in module globals, as in a
# script written top to bottom, so importing it (--doctest-modules would) starts a process group.
collect_ignore = ["exit_shapes.py"]


@pytest.fixture
def world_of_one() -> Iterator[None]:
    """A gloo process group of one rank on 127.0.0.1, destroyed afterwards."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{free_port()}",
        rank=0,
        world_size=1,
        timeout=datetime.timedelta(seconds=30),
    )
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture
def world() -> Iterator[None]:
    """A gloo process group of one rank on a ``HashStore`` (no network), destroyed afterwards.

    No process is started, so the tests that use it run in the fast tier.
    """
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Under CI, a test skipped for a missing optional package fails the run.

    The ``test`` extra installs every package the tests import with ``pytest.importorskip``, so
    such a skip in CI means an install step is missing, and the tests it skips prove nothing.
    """
    if not os.environ.get("CI"):
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    skipped = reporter.stats.get("skipped", []) if reporter is not None else []
    missing = [
        report.nodeid
        for report in skipped
        if "could not import" in str(report.longrepr) or "extra" in str(report.longrepr)
    ]
    if missing:
        print(f"\nCI: skipped for a missing optional package (install .[test]): {missing}")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


# A test that starts a Python interpreter carries the `distributed` marker, so that the fast tier
# (`pytest -m "not slow and not distributed"`) never waits for one to start. The hooks below
# watch every test's setup, call and teardown, and fail the phase of a test without the marker
# that started one:
# - a multiprocessing process started by spawn or forkserver (tests/dist.py's run(), the
#   launchers of test_faults and the benchmarks);
# - python or torchrun started through subprocess (an example or a benchmark run as a script;
#   the audit event "subprocess.Popen").
# A forked process (a DataLoader worker under Linux's default start method) starts no
# interpreter and passes, as do other programs started through subprocess (git, ruff).
_watched: list[pytest.Item] = []
_started: list[str] = []


def _is_python(program: object) -> bool:
    name = os.path.basename(os.fsdecode(program)) if isinstance(program, (str, bytes)) else ""
    return name.startswith(("python", "torchrun")) or program == sys.executable


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if not _watched or event != "subprocess.Popen":
        return
    executable, argv = args[0], args[1]
    command = [argv] if isinstance(argv, (str, bytes)) else list(argv)
    if "compile_worker" in " ".join(map(str, command)):
        return  # torch.compile's inductor workers: torch's choice, not the test's
    if _is_python(executable) or (command and _is_python(command[0])):
        _started.append(f"subprocess {' '.join(map(str, command))[:200]}")


sys.addaudithook(_audit)
_process_start = multiprocessing.process.BaseProcess.start


def _start(self: multiprocessing.process.BaseProcess) -> None:
    method = getattr(self, "_start_method", None) or multiprocessing.get_start_method(True)
    if _watched and method in ("spawn", "forkserver"):
        target = getattr(self, "_target", None)
        _started.append(f"multiprocessing {method} {self.name} (target {target})")
    _process_start(self)


multiprocessing.process.BaseProcess.start = _start  # type: ignore[method-assign]


def _watch(item: pytest.Item, phase: str) -> Generator[None, object, object]:
    _watched.append(item)
    _started.clear()
    try:
        result = yield
    finally:
        _watched.pop()
    started = list(_started)
    _started.clear()
    if started and item.get_closest_marker("distributed") is None:
        pytest.fail(
            f"{item.nodeid} started a Python process in its {phase} but is not marked distributed: "
            f"{'; '.join(started[:3])}; add @pytest.mark.distributed (the fast tier, "
            '-m "not slow and not distributed", starts no interpreter).',
            pytrace=False,
        )
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Generator[None, object, object]:
    return (yield from _watch(item, "setup"))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, object, object]:
    return (yield from _watch(item, "call"))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Generator[None, object, object]:
    return (yield from _watch(item, "teardown"))
