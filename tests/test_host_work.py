"""Issue 36's host-work bound: ``benchmarks/calls.py --lm`` at two model sizes.

Python calls are counted (``sys.setprofile``), not timed: the count does not depend on the
machine's load. Per micro-batch, ``accumulate`` and ``loop.Step`` make at most 50 Python calls
more than a hand-written ``loss.backward()`` loop, at 4 and at 8 transformer blocks alike (the
backward's inputs used to cost 2 calls per parameter per micro-batch: 150 / 246 calls).
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "calls.py"


@pytest.mark.slow
@pytest.mark.distributed  # a subprocess (a gloo group of one)
@pytest.mark.timeout(400)
def test_calls_per_micro_batch_are_few_and_flat_in_the_model_size(tmp_path: Path) -> None:
    out = tmp_path / "calls.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--lm", "--paths", "accumulate", "loop.Step"]
        + ["--json", str(out)],
        capture_output=True,
        text=True,
        timeout=380,
        check=False,
        cwd=SCRIPT.parent,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())
    per_mb = {(r["path"], r["blocks"]): r["calls_per_micro_batch"] for r in rows}
    assert set(per_mb) == {(p, b) for p in ("accumulate", "loop.Step") for b in (4, 8)}, rows
    for (path, blocks), calls in per_mb.items():
        assert calls <= 50, f"{path}, {blocks} blocks: {calls} extra calls per micro-batch"
    for path in ("accumulate", "loop.Step"):
        assert abs(per_mb[path, 8] - per_mb[path, 4]) <= 2, rows  # flat in the parameters
