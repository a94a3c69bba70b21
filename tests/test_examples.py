import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"

pytestmark = pytest.mark.slow


def run_example(name: str, *args: str) -> str:
    """Run ``examples/<name>`` in a fresh interpreter (warnings as errors); return its stdout."""
    proc = subprocess.run(
        [sys.executable, "-W", "error", str(EXAMPLES / name), *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, (
        f"{name} {' '.join(args)} exited with {proc.returncode}\n"
        f"--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr[-4000:]}"
    )
    return proc.stdout


def max_difference(stdout: str) -> float:
    match = re.search(r"^max parameter difference: (\S+) \(tolerance \S+\) OK$", stdout, re.M)
    assert match, stdout
    return float(match.group(1))


@pytest.mark.parametrize(
    ("args", "tol"),
    [
        (("--steps", "20"), 1e-9),
        (("--steps", "20", "--n", "3", "--batch-size", "50", "--dtype", "float32"), 1e-4),
    ],
    ids=["float64", "float32-ragged"],
)
def test_quickstart(args: tuple[str, ...], tol: float) -> None:
    pytest.importorskip("tqdm", reason="examples/quickstart.py needs the [examples] extra")
    stdout = run_example("quickstart.py", *args, "--seed", "1")
    assert "test accuracy" in stdout
    assert max_difference(stdout) <= tol


def test_streaming() -> None:
    stdout = run_example("streaming.py", "--epochs", "2", "--micro-batch-size", "30")
    assert "windows of [2, 2, 2, 2, 4, 4, 4, 4, 8" in stdout
    assert "resumed: window" in stdout
    assert "bit-identical to the uninterrupted run: True" in stdout
    assert "num_batches_tracked == micro-batches seen: True" in stdout
    assert stdout.rstrip().endswith("OK")
