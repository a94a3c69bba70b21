"""The whole training loop (issue 17): examples/lm_loop.py and the DDP and Accelerate versions.

- The line counts: the user code of each version is the lines between ``# --- the job: begin
  ---`` and ``# --- the job: end ---`` of the ruff-formatted file (``ruff format --check`` runs in
  CI) that are neither blank nor only a comment (``lm_job.count_lines``). docs/loop.md states
  them; the test checks the page against the files, and the page's code against the files.
- Each version runs on 1 and 2 gloo processes and checks itself against a one-process float64
  reference on each whole global window (<= 1e-10), one scheduler step per window, and a
  mid-window checkpoint resumed bit-identically: 81 sequences (21 and 20 micro-batches: the
  last window of each epoch empty on rank 1), and 73 (19 and 18: short and uneven).
- gradaccum's version with ``--plot``: a valid PNG on rank 0 whose curves (read back from its
  metadata, checked against their hash) are the run's per-window global mean loss and the
  reference's, at most 1e-10 apart.
- What docs/loop.md says the anchors get wrong by default, each claim run here.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
from pathlib import Path

import dist
import pytest
import torch
from png import check as png_check

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
sys.path.insert(0, str(EXAMPLES))
import lm_job  # noqa: E402
from _plot import read_curves  # noqa: E402

VERSIONS = {
    "gradaccum": "lm_loop.py",
    "DDP + no_sync": "compare/ddp_loop.py",
    "Accelerate": "compare/accelerate_loop.py",
}


def run_version(path: str, *args: str) -> str:
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, "-W", "error", str(EXAMPLES / path), *args],
        capture_output=True,
        text=True,
        timeout=170,
        check=False,
        env=env,
    )
    assert proc.returncode == 0, f"{path} {args}\n{proc.stdout}\n{proc.stderr[-4000:]}"
    return proc.stdout


def test_line_counts() -> None:
    counts = {name: lm_job.count_lines(EXAMPLES / path) for name, path in VERSIONS.items()}
    assert counts["gradaccum"] <= 35
    assert 2 * counts["gradaccum"] <= min(counts["DDP + no_sync"], counts["Accelerate"])


def test_the_counting_rule(tmp_path) -> None:
    f = tmp_path / "x.py"
    f.write_text(
        "a = 1\n# --- the job: begin ---\n# a comment\n\nx = 1  # counted\n"
        "def f():\n    '''doc'''\n\n    return 2\n# --- the job: end ---\nb = 2\n"
    )
    assert lm_job.count_lines(f) == 4


def test_the_page_shows_the_files_and_their_counts() -> None:
    page = (ROOT / "docs" / "loop.md").read_text()
    for name, path in VERSIONS.items():
        count = lm_job.count_lines(EXAMPLES / path)
        assert re.search(rf"^\| {re.escape(name)} \| `examples/{path}` \| {count} \|", page, re.M)
        text = (EXAMPLES / path).read_text()
        code = text.split(lm_job.BEGIN + "\n", 1)[1].split(lm_job.END, 1)[0].strip()
        tab = f'=== "{name} ({count} lines)"'
        assert tab in page, tab
        shown = page.split(tab, 1)[1].split("```python\n", 1)[1].split("    ```", 1)[0]
        assert [line.removeprefix("    ") for line in shown.strip().splitlines()] == [
            line for line in code.splitlines()
        ], name


EMPTY_LAST = (2, 81, "[21, 20]", 12)  # rank 1's last window of each epoch is empty
CASES = [
    ("gradaccum", 1, 81, "[41]", 22),
    ("gradaccum", *EMPTY_LAST),
    ("gradaccum", 2, 73, "[19, 18]", 10),  # the last windows short and uneven (3 and 2)
    ("DDP + no_sync", *EMPTY_LAST),
    ("Accelerate", *EMPTY_LAST),
]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("version", "nproc", "rows", "lengths", "windows"),
    CASES,
    ids=[f"{v.split()[0]}-{p}-proc-{r}-rows" for v, p, r, *_ in CASES],
)
def test_versions_are_exact(version, nproc, rows, lengths, windows, tmp_path) -> None:
    if version == "Accelerate":
        pytest.importorskip("accelerate")
    args = ("--nproc", str(nproc), "--rows", str(rows))
    png = tmp_path / "loss.png"
    if version == "gradaccum":
        pytest.importorskip("matplotlib", reason="--plot needs the [plot] extra")
        args += ("--plot", str(png))
    out = run_version(VERSIONS[version], *args)
    assert f"micro-batches per rank {lengths}, n=4, 2 epochs: {windows} windows" in out
    assert f"scheduler steps {windows}, optimizer steps {windows}, windows {windows} OK" in out
    diff = re.search(r"whole-window reference: (\S+) \(tolerance 1e-10\) OK", out)
    assert diff, out
    assert float(diff.group(1)) <= 1e-10
    assert "after micro-batch 2: bit-identical to the uninterrupted run: True" in out
    assert out.rstrip().endswith("OK")
    if version == "gradaccum":
        assert out.count(f"wrote {png}") == 1, out  # rank 0 only
        assert re.search(r"per-window loss vs the reference: max difference \S+ OK", out), out
        check_plot(png, windows)


def check_plot(png: Path, windows: int) -> None:
    """The PNG is valid and drawn from its curves: the reference's per-window loss, and the
    accumulated run's, one per window, at most 1e-10 apart.
    """
    curves = read_curves(png_check(png))  # checked against the PNG's Data-SHA256
    assert list(curves) == ["whole-window reference", "accumulated, n=4"]
    ref, accumulated = curves.values()
    assert len(ref) == len(accumulated) == windows
    assert all(2.0 < loss < 4.0 for loss in ref)  # near log(24): a token loss, not a sum
    assert max(abs(a - b) for a, b in zip(accumulated, ref)) <= 1e-10


def test_plot_refuses_what_it_cannot_draw(tmp_path, capsys) -> None:
    job = lm_job.Job()
    png = tmp_path / "loss.png"
    assert lm_job._plot(str(png), [], [3.0, 2.9], job, 0, 1) == 1.0  # no losses returned
    assert "train() returned no per-window losses to plot FAILED" in capsys.readouterr().out
    assert lm_job._plot(str(png), [[3.0]], [3.0, 2.9], job, 0, 1) == 1.0
    assert "--plot: 1 losses for 2 windows FAILED" in capsys.readouterr().out
    assert lm_job._plot(str(png), [[3.0]], [3.0], job, 1, 2) == 0.0  # rank 1 draws nothing
    assert not png.exists()


def test_plot_draws_and_checks_the_curves(tmp_path, capsys) -> None:
    pytest.importorskip("matplotlib", reason="--plot needs the [plot] extra")
    png = tmp_path / "loss.png"
    ref, off = [3.0, 2.9, 2.8], [3.0, 2.9 + 1e-9, 2.8]
    assert lm_job._plot(str(png), [off], ref, lm_job.Job(), 0, 2) == 1.0  # 1e-9 apart: drawn
    assert "max difference 1.000e-09 FAILED" in capsys.readouterr().out
    metadata = png_check(png)
    assert read_curves(metadata) == {"whole-window reference": ref, "accumulated, n=4": off}
    metadata["Data"] = metadata["Data"].replace("2.8", "2.7")
    with pytest.raises(ValueError, match="the PNG's Data does not match its Data-SHA256"):
        read_curves(metadata)


@pytest.mark.slow
def test_lm_loop_under_torchrun(tmp_path) -> None:
    pytest.importorskip("matplotlib", reason="--plot needs the [plot] extra")
    png = tmp_path / "loss.png"
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env["PYTHONWARNINGS"] = "error"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    proc = subprocess.run(
        [*cmd, str(EXAMPLES / "lm_loop.py"), "--plot", str(png)],
        capture_output=True,
        text=True,
        timeout=170,
        check=False,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "micro-batches per rank [21, 20]" in proc.stdout
    assert proc.stdout.rstrip().endswith("OK")
    assert proc.stdout.count(f"wrote {png}") == 1, proc.stdout  # rank 0 only
    check_plot(png, 12)


# -- what the anchors get wrong by default (the claims of docs/loop.md) --------------------------


def _naive_ddp(rank: int, world: int, step_at_epoch_end: bool) -> list[tuple[int, int, int]]:
    """The usual DDP + no_sync loop on loaders of 21 and 20 micro-batches, n = 4: it returns,
    at each synchronised backward in order, this rank's (epoch, window, micro-batches in .grad).
    """
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = [torch.randn(2, 2) for _ in range(21 if rank == 0 else 20)]
    synced, held = [], 0
    for epoch in range(2):
        for i, x in enumerate(data):
            sync = (i + 1) % 4 == 0 or (step_at_epoch_end and i + 1 == len(data))
            with contextlib.nullcontext() if sync else model.no_sync():
                model(x).sum().backward()
            held += 1
            if sync:
                synced.append((epoch, i // 4, held))
                held = 0
                optimizer.step()
                optimizer.zero_grad()
    return synced


@pytest.mark.distributed
def test_naive_ddp_mixes_epochs_silently() -> None:
    r0, r1 = dist.values(dist.run(_naive_ddp, False, timeout=120))
    assert (
        [(e, w) for e, w, _ in r0]
        == [(e, w) for e, w, _ in r1]
        == [(e, w) for e in range(2) for w in range(5)]
    )
    assert [held for *_, held in r1] == [4] * 10
    # Rank 0's 21st micro-batch of epoch 0 stays in .grad: its first window of epoch 1 holds 5.
    assert [held for *_, held in r0] == [4] * 5 + [5] + [4] * 4


@pytest.mark.distributed
def test_naive_ddp_stepping_at_the_epoch_end_pairs_epochs_then_hangs() -> None:
    results = dist.run(_naive_ddp, True, timeout=120, pg_timeout=10)
    # Rank 0 waits for a 12th gradient all-reduce that never comes: it fails when rank 1
    # exits (or at the process group's timeout, if rank 1 lives on).
    assert results[0][0] == "err"
    assert re.search(r"Connection (reset|closed)|[Tt]imed out", results[0][2]), results[0][2]
    r1 = results[1][1]
    assert [(e, w) for e, w, _ in r1] == [(e, w) for e in range(2) for w in range(5)]
    # The 6th all-reduce pairs rank 0's last window of epoch 0 with rank 1's first of epoch 1.


def test_distributed_sampler_repeats_samples() -> None:
    from torch.utils.data import DistributedSampler

    seen = [list(DistributedSampler(range(81), num_replicas=2, rank=r)) for r in range(2)]
    assert [len(s) for s in seen] == [41, 41]
    assert len(seen[0] + seen[1]) - len(set(seen[0] + seen[1])) == 1  # one sample twice


def _torchrun_env(rank: int, world: int) -> None:
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT="1",  # the group exists already
        OMP_NUM_THREADS="1",
    )


def _accelerate_defaults(rank: int, world: int) -> dict:
    import accelerate

    _torchrun_env(rank, world)
    plain = accelerate.Accelerator()  # on a machine without GPUs
    out = {"plain": (str(plain.distributed_type), plain.num_processes)}
    out["plain_wraps"] = type(plain.prepare(torch.nn.Linear(2, 1))).__name__
    accelerate.state.AcceleratorState._reset_state(reset_partial_state=True)
    acc = accelerate.Accelerator(cpu=True)
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    loader = torch.utils.data.DataLoader(list(range(81)), batch_size=2)
    model, optimizer, scheduler, loader = acc.prepare(model, optimizer, scheduler, loader)
    for _ in range(3):
        acc.backward(model(torch.ones(1, 2)).sum())
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    out["cpu"] = (str(acc.distributed_type), acc.num_processes, type(model).__name__)
    out["scheduler_steps"] = scheduler.scheduler.last_epoch
    out["samples"] = [int(x) for batch in loader for x in batch]
    acc.backward(model(torch.ones(1, 2)).sum())  # a window in progress
    acc.save_state(os.environ["CKPT"])
    torch.distributed.barrier()  # every rank's files are written
    out["saved"] = sorted(os.listdir(os.environ["CKPT"]))
    return out


@pytest.mark.distributed
def test_accelerate_defaults(tmp_path) -> None:
    pytest.importorskip("accelerate")
    os.environ["CKPT"] = str(tmp_path)
    try:
        r0, r1 = dist.values(dist.run(_accelerate_defaults, timeout=150))
    finally:
        del os.environ["CKPT"]
    # Without cpu=True (or `accelerate launch --cpu`) on CPU, every process trains alone.
    assert r0["plain"] == ("DistributedType.NO", 1)
    assert r0["plain_wraps"] == "Linear"
    assert r0["cpu"] == ("DistributedType.MULTI_CPU", 2, "DistributedDataParallel")
    # A prepared scheduler steps once per process at each optimizer step: 3 steps, 6 LR steps.
    assert r0["scheduler_steps"] == r1["scheduler_steps"] == 6
    # A prepared loader of 81 samples gives 84 (even_batches=True): 3 samples twice.
    both = r0["samples"] + r1["samples"]
    assert (len(both), len(set(both))) == (84, 81)
    # save_state keeps no gradient, nor the data position: a window in progress is lost.
    assert r0["saved"] == [
        "model.safetensors",
        "optimizer.bin",
        "random_states_0.pkl",
        "random_states_1.pkl",
        "scheduler.bin",
    ]
