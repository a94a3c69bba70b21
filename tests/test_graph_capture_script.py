"""Smoke test of ``benchmarks/graph_capture.py --cpu``: its variants' eager windows train alike.

On CPU the script runs each variant's windows eagerly (no capture): the hand loop, the deferred
non-finite flag (``optimizer.found_inf``), ``accumulate`` over ``all_reduce()`` and ``loop.Step``
must leave the same parameters, or the device run would compare unlike things.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "graph_capture.py"
VARIANTS = [
    "hand",
    "hand+found_inf",
    "accumulate-all_reduce",
    "accumulator-none",
    "step-all_reduce",
]


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_graph_capture_variants_train_alike_on_cpu() -> None:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--cpu", "--only", *VARIANTS],
        capture_output=True,
        text=True,
        timeout=170,
        check=False,
    )
    out = f"--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-4000:]}"
    assert proc.returncode == 0, out
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [r["variant"] for r in rows] == VARIANTS, out
    for r in rows:
        assert "error" not in r, out
        assert r["max_abs_diff"] == 0.0, out  # two eager instances of one variant: the same
        assert r["moved"] > 0, out  # training moved the parameters
    sums = {r["variant"]: r["checksum"] for r in rows}
    assert max(sums.values()) - min(sums.values()) <= 1e-6 * abs(sums["hand"]), sums
