"""Smoke test of ``benchmarks/step.py --quick``: it runs, and every contender's parameters agree."""

import subprocess
import sys
from pathlib import Path

import pytest

STEP = Path(__file__).resolve().parent.parent / "benchmarks" / "step.py"


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_step_benchmark_quick() -> None:
    proc = subprocess.run(
        [sys.executable, str(STEP), "--quick", "--ns", "1", "2"],
        capture_output=True,
        text=True,
        timeout=110,
        check=False,
    )
    out = f"--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-4000:]}"
    # Exit code 1: a contender's parameters differed from the reference's (printed per round).
    assert proc.returncode == 0, f"step.py exited with {proc.returncode}\n{out}"
    table = proc.stdout.split("paired ratio to ddp-no_sync", 1)[1].splitlines()
    names = [line.split()[0] for line in table[2:] if line.strip()]
    assert names == ["ddp-no_sync", "ddp-twin", "gradaccum", "step", "step-data"], out
