"""Smoke test of the benchmark suite: ``benchmarks/suite.py --quick`` runs and agrees."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

SUITE = Path(__file__).resolve().parent.parent / "benchmarks" / "suite.py"
TWO_PROC = [
    "ddp-naive",
    "ddp-no_sync",
    "hand",
    "gradaccum-func",
    "gradaccum",
    "gradaccum-no-overlap",
]
ONE_PROC = ["hand", "gradaccum", "gradaccum-func"]
NS = ["1", "2"]


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_suite_quick(tmp_path: Path) -> None:
    # Everything but accelerate, a benchmark-only dependency that CI does not install.
    proc = subprocess.run(
        [
            sys.executable,
            str(SUITE),
            "--quick",
            "--ns",
            *NS,
            "--out",
            str(tmp_path),
            "--strategies",
            *TWO_PROC,
        ],
        capture_output=True,
        text=True,
        timeout=110,
        check=False,
    )
    assert proc.returncode == 0, (
        f"suite.py exited with {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}\n"
        f"--- stderr\n{proc.stderr[-4000:]}"
    )
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["params_agree"] is True
    assert set(results["models"]) == {"mlp", "lm"}
    for model, res in results["models"].items():
        for section, names in (("two_process", TWO_PROC), ("one_process", ONE_PROC)):
            strategies = res[section]["strategies"]
            assert set(strategies) == set(names), (model, section)
            for name in names:
                assert sorted(strategies[name]) == NS, (model, section, name)
                for cell in strategies[name].values():
                    assert cell["params_agree"] is True, (model, section, name)
                    assert cell["median_ms"] > 0
                    if section == "two_process":
                        assert cell["collectives"] >= 1, (model, name)
            assert set(res["memory"][section]) == set(names), (model, section)
            for name in names:
                assert sorted(res["memory"][section][name]) == NS, (model, section, name)
    assert (
        results["models"]["mlp"]["two_process"]["strategies"]["ddp-naive"]["2"]["collectives"]
        == 2
        * results["models"]["mlp"]["two_process"]["strategies"]["ddp-no_sync"]["2"]["collectives"]
    )
