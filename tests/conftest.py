"""Fixtures shared by the test modules."""

from __future__ import annotations

import datetime
import os
from collections.abc import Iterator

import pytest
import torch.distributed as dist
from dist import free_port


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
