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
