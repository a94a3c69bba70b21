"""examples/sign_sync.py: a sync kind written outside the package, on the public protocol only.

Run as tests/test_examples.py runs the examples: a fresh interpreter with warnings as errors,
bounded in time, no retry; on 2 ranks through torchrun, gloo on 127.0.0.1 and a free port.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from dist import free_port

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "sign_sync.py"

pytestmark = [pytest.mark.slow, pytest.mark.distributed]  # every test runs the example


def run(*args: str, ranks: int) -> subprocess.CompletedProcess[str]:
    """Run the example in one process, or under torchrun on ``ranks`` processes."""
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    env["PYTHONWARNINGS"] = "error"
    if ranks == 1:
        cmd = [sys.executable, "-W", "error", str(EXAMPLE)]
    else:
        launcher = ["--nnodes", "1", "--nproc_per_node", str(ranks), "--max_restarts", "0"]
        address = ["--master_addr", "127.0.0.1", "--master_port", str(free_port())]
        cmd = [sys.executable, "-m", "torch.distributed.run", *launcher, *address, str(EXAMPLE)]
    return subprocess.run(
        [*cmd, *args], capture_output=True, text=True, timeout=120, check=False, env=env
    )


@pytest.mark.parametrize(
    "ranks", [1, pytest.param(2, marks=pytest.mark.distributed)], ids=["1-process", "2-ranks"]
)
def test_sign_sync_check(ranks: int) -> None:
    proc = run("--check", ranks=ranks)
    out = f"--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr[-4000:]}"
    assert proc.returncode == 0, out
    assert f"{ranks} rank(s), rows per rank {[45] if ranks == 1 else [23, 22]}" in proc.stdout
    diff = re.search(r"compression off vs the whole batch: max difference (\S+) ", proc.stdout)
    assert diff, out
    assert float(diff.group(1)) <= 1e-12
    # 160 float64 params: the base class's 32-byte tail [weight, failed, h, h**2] (the
    # fingerprint rides in it), then 3 scales and 160 int8 signs per rank.
    assert (
        "collectives per window: 3: all_reduce (weight, torch.float64) 32 B, all_gather "
        f"(gradients (scales), torch.float64) {24 * ranks} B, all_gather (gradients (signs), "
        f"torch.int8) {160 * ranks} B"
    ) in proc.stdout, out
    assert "halved: True" in proc.stdout, out
    assert proc.stdout.rstrip().endswith("OK"), out


def test_sign_sync_check_fails_with_exit_status_1() -> None:
    proc = run("--check", "--no-compress", "--steps", "1", ranks=1)
    assert proc.returncode == 1, proc.stdout  # one step does not halve the loss
    assert "all_reduce (gradients, torch.float64) 1280 B" in proc.stdout
    assert proc.stdout.rstrip().endswith("FAILED")
