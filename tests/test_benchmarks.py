"""Smoke tests of the benchmarks: ``suite.py --quick`` and ``sharded.py --quick`` run and agree."""

import hashlib
import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
from png import check as png_check

SUITE = Path(__file__).resolve().parent.parent / "benchmarks" / "suite.py"
TWO_PROC = [
    "ddp-naive",
    "ddp-no_sync",
    "ddp-twin",
    "hand",
    "gradaccum-func",
    "gradaccum-tree",
    "gradaccum",
    "gradaccum-no-overlap",
]
ONE_PROC = ["hand", "gradaccum", "gradaccum-func", "gradaccum-tree"]
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
    mlp = results["models"]["mlp"]["two_process"]["strategies"]
    assert mlp["ddp-naive"]["2"]["collectives"] == 2 * mlp["ddp-no_sync"]["2"]["collectives"]
    # The control runs the reference's code: the same collectives, the same parameters.
    for model in ("mlp", "lm"):
        two = results["models"][model]["two_process"]["strategies"]
        for n in NS:
            assert two["ddp-twin"][n]["collectives"] == two["ddp-no_sync"][n]["collectives"]
            assert two["ddp-twin"][n]["param_max_abs_diff"] == 0.0, (model, n)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_suite_rounds_keep_every_rounds_paired_ratio(tmp_path: Path) -> None:
    # One process only (fast): each round is a fresh process; the summary is over all rounds.
    proc = subprocess.run(
        [
            sys.executable,
            str(SUITE),
            "--quick",
            "--no-memory",
            "--rounds",
            "3",
            "--models",
            "mlp",
            "--ns",
            "1",
            "2",
            "--strategies",
            "hand",
            "gradaccum",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=110,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "median [min-max] of 3 rounds" in proc.stdout
    sec = json.loads((tmp_path / "results.json").read_text())["models"]["mlp"]["one_process"]
    assert len(sec["rounds"]) == 3
    for name in ("hand", "gradaccum"):
        for n in ("1", "2"):
            ratios = [rd[name][n] for rd in sec["rounds"]]
            summary = sec["round_ratio"][name][n]
            assert summary["min"] == min(ratios)
            assert summary["max"] == max(ratios)
            assert summary["median"] == statistics.median(ratios)
            if name == "hand":  # the reference against itself
                assert ratios == [1.0, 1.0, 1.0]
    assert sec["strategies"]["gradaccum"]["1"]["paired_ratio"] == sec["rounds"][0]["gradaccum"]["1"]


SHARDED = Path(__file__).resolve().parent.parent / "benchmarks" / "sharded.py"


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_sharded_quick(tmp_path: Path) -> None:
    out = tmp_path / "sharded.json"
    proc = subprocess.run(
        [sys.executable, str(SHARDED), "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=110,
        check=False,
    )
    assert proc.returncode == 0, (
        f"sharded.py exited with {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}\n"
        f"--- stderr\n{proc.stderr[-4000:]}"
    )
    header = "| strategy | n | peak MiB | vs all_reduce | collectives/step | MiB on the wire/step |"
    assert header in proc.stdout
    strategies = ["all_reduce", "boundary", "every", "every-micro_batch"]
    for name in strategies:
        for n in (1, 4):
            assert f"| {name} | {n} | " in proc.stdout, (name, n)
    results = json.loads(out.read_text())
    assert results["agree"] is True
    assert set(results["results"]) == set(strategies)
    cells = results["results"]
    for name in strategies:
        for cell in cells[name].values():
            assert cell["peak_mib"] > 0
            assert cell["param_max_abs_diff"] <= 1e-5
    # What goes on the wire is deterministic: boundary reduce-scatters once per window, every
    # once per micro-batch, every-micro_batch also all-gathers once per micro-batch.
    by_kind = {name: cells[name]["4"]["by_kind"] for name in strategies}
    assert by_kind["all_reduce"]["reduce_scatter"]["count"] == 0
    assert (
        by_kind["every"]["reduce_scatter"]["count"]
        == 4 * (by_kind["boundary"]["reduce_scatter"]["count"])
    )
    assert (
        by_kind["every-micro_batch"]["all_gather"]["count"]
        == 4 * (by_kind["every"]["all_gather"]["count"])
    )


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_ab_overhead_runs_two_copies_side_by_side() -> None:
    package = Path(__file__).resolve().parent.parent / "gradaccum"
    proc = subprocess.run(
        [
            sys.executable,
            str(SUITE.parent / "ab_overhead.py"),
            str(package),
            str(package),
            "--rounds",
            "1",
            "--calls",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert proc.returncode == 0, proc.stderr
    rows = [line for line in proc.stdout.splitlines() if "second/first" in line]
    assert len(rows) == 6, proc.stdout


SCALE = Path(__file__).resolve().parent.parent / "benchmarks" / "scale.py"


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(150)
def test_scale_quick() -> None:
    # 4 gloo processes on a 2x2 mesh: gradaccum's hybrid policies against FSDP2's knobs.
    proc = subprocess.run(
        [sys.executable, str(SCALE), "--quick"],
        capture_output=True,
        text=True,
        timeout=140,
        check=False,
    )
    assert proc.returncode == 0, (
        f"scale.py exited with {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}\n"
        f"--- stderr\n{proc.stderr[-4000:]}"
    )
    out = proc.stdout
    assert "| strategy | intra grads | intra params | inter grads | all 4 ranks |" in out
    for name in (
        "ga-every",
        "ga-boundary",
        "ga-mixed",
        "fsdp2-no-grad-sync",
        "fsdp2-no-all-reduce",
        "ddp-no_sync",
    ):
        assert f"| {name} | " in out, name
    assert out.count(": OK\n") == 3, out  # gradaccum's bytes per tier equal the formula
    assert "formula check: OK; params agree (<= 1e-05): yes" in out


COMPRESSION = Path(__file__).resolve().parent.parent / "benchmarks" / "compression.py"


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_compression_quick_writes_a_figure_stamped_with_its_data(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="the figure needs the [plot] extra")
    proc = subprocess.run(
        [sys.executable, str(COMPRESSION), "--quick", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=110,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    data = json.loads((tmp_path / "compression.json").read_text())
    assert data["names"][0] == "exact"
    assert set(data["results"]) == set(data["names"]) == set(data["sums"])
    meta = png_check(tmp_path / "compression.png", min_size=(800, 300))
    assert meta["Source"] == "compression.json"
    digest = hashlib.sha256((tmp_path / "compression.json").read_bytes()).hexdigest()
    assert meta["Source-SHA256"] == digest


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_window_budget_quick_prints_every_part_and_their_sum() -> None:
    proc = subprocess.run(
        [sys.executable, str(SUITE.parent / "window_budget.py"), "--quick"],
        capture_output=True,
        text=True,
        timeout=100,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = {}
    for line in proc.stdout.splitlines():
        if line.startswith("  ") and line.endswith(" us"):
            name, value = line.strip().removesuffix(" us").rsplit(maxsplit=1)
            rows[name.strip()] = float(value)
    total = rows.pop("sum")
    assert len(rows) == 6, proc.stdout
    assert any("fingerprint" in name for name in rows), proc.stdout
    assert all(us > 0 for us in rows.values()), proc.stdout
    assert total == pytest.approx(sum(rows.values()), abs=0.5), proc.stdout
    assert "the sum as a share of a one-micro-batch step: " in proc.stdout


COUPLED = Path(__file__).resolve().parent.parent / "benchmarks" / "coupled.py"


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_coupled_quick_is_exact_and_prints_every_table(tmp_path: Path) -> None:
    out = tmp_path / "coupled.json"
    proc = subprocess.run(
        [sys.executable, str(COUPLED), "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=110,
        check=False,
    )
    assert proc.returncode == 0, (
        f"coupled.py exited with {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}\n"
        f"--- stderr\n{proc.stderr[-4000:]}"
    )
    for title in ("1. exactness", "2a. peak memory", "2b. peak memory", "3. time", "4. two"):
        assert title in proc.stdout, title
    res = json.loads(out.read_text())
    ns = [int(n) for n in res["time"]["median_ms"]["coupled"]]
    assert ns == [1, 2, 4]
    for row in res["exactness"]:
        assert row["coupled_grad_rel_err"] <= 1e-12, row
        if row["n"] > 1:  # each micro-batch's own negatives: another objective
            assert row["naive_grad_rel_err"] > 0.01, row
            assert row["naive_loss"] < row["true_loss"], row
    window = res["memory"]["window"]
    assert window["coupled"]["4"] < window["whole"]["1"]
    ranks = res["two_ranks"]
    assert all(err <= 1e-12 for err in ranks["coupled"].values()), ranks["coupled"]
    assert ranks["dropped"] > 0.01
    # Per window after the first: coupled's three, then the sync's fingerprint and one bucket.
    later = [(c["kind"], c["purpose"]) for c in ranks["collectives"]["2"][1]]
    assert later == [
        ("all_gather", "coupled rows"),
        ("all_gather", "coupled representations"),
        ("reduce_scatter", "coupled gradient"),
        ("all_reduce", "fingerprint"),
        ("all_reduce", "gradients"),
    ]
