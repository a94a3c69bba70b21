import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from png import check as png_check

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"

pytestmark = [pytest.mark.slow, pytest.mark.distributed]  # every test runs a script


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


def run_torchrun(name: str, *args: str, nproc: int = 2, cwd: Path | None = None) -> str:
    """Run ``torchrun --standalone --nproc_per_node <nproc> examples/<name>``; return its stdout.

    Every process treats warnings as errors; gloo stays on the loopback interface.
    """
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    env["PYTHONWARNINGS"] = "error"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    proc = subprocess.run(
        [*cmd, "--nproc_per_node", str(nproc), str(EXAMPLES / name), *args],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
        env=env,
        cwd=cwd,
    )
    assert proc.returncode == 0, (
        f"torchrun {name} {' '.join(args)} exited with {proc.returncode}\n"
        f"--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr[-4000:]}"
    )
    return proc.stdout


def max_difference(stdout: str, what: str = "max parameter difference:") -> float:
    pattern = rf"^{re.escape(what)} (\S+) \(tolerance \S+\) OK$"
    match = re.search(pattern, stdout, re.M)
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
def test_quickstart(args: tuple[str, ...], tol: float, tmp_path: Path) -> None:
    pytest.importorskip("tqdm", reason="examples/quickstart.py needs the [examples] extra")
    pytest.importorskip("matplotlib", reason="--plot needs the [plot] extra")
    png = tmp_path / "loss.png"
    stdout = run_example("quickstart.py", *args, "--seed", "1", "--plot", str(png))
    assert "test accuracy" in stdout
    assert max_difference(stdout) <= tol
    assert f"wrote {png}" in stdout
    assert len(png_check(png)["Data-SHA256"]) == 64  # the curves it was drawn from


@pytest.mark.parametrize(
    ("ranks", "args", "tol"),
    [
        (1, ("--dtype", "float32"), 1e-4),
        (2, ("--dtype", "float64", "--batch", "45", "-n", "3"), 1e-9),  # 23 and 22 rows
    ],
    ids=["1-process-float32", "2-ranks-float64-unequal"],
)
def test_ddp(ranks: int, args: tuple[str, ...], tol: float, tmp_path: Path) -> None:
    pytest.importorskip("tqdm", reason="examples/ddp.py needs the [examples] extra")
    pytest.importorskip("matplotlib", reason="--plot needs the [plot] extra")
    png = tmp_path / "loss.png"
    args = ("--check", "--steps", "10", "--device", "cpu", "--plot", str(png), *args)
    stdout = run_example("ddp.py", *args) if ranks == 1 else run_torchrun("ddp.py", *args)
    assert stdout.count(f"wrote {png}") == 1  # rank 0 only
    assert len(png_check(png)["Data-SHA256"]) == 64
    assert f"{ranks} rank(s), gloo on cpu" in stdout
    if ranks == 2:
        assert "global batch 45 rows = [23, 22] per rank" in stdout
    assert "collectives per step after that: 2: all_reduce of 16 bytes (fingerprint" in stdout
    assert "gradient collectives while micro-batches ran: 0 " in stdout
    assert "the fingerprint and one all_reduce per bucket per step: True OK" in stdout
    assert max_difference(stdout) <= tol


@pytest.mark.parametrize("ranks", [1, 2], ids=["1-process", "2-ranks"])
def test_causal_lm_tokens(ranks: int, tmp_path: Path) -> None:
    pytest.importorskip("tqdm", reason="examples/causal_lm_tokens.py needs the [examples] extra")
    pytest.importorskip("matplotlib", reason="--plot needs the [plot] extra")
    png = tmp_path / "loss.png"
    args = ("--steps", "3", "--batch", "20", "-n", "3", "--plot", str(png))
    run = run_example if ranks == 1 else run_torchrun
    stdout = run("causal_lm_tokens.py", *args)
    assert stdout.count(f"wrote {png}") == 1  # rank 0 only
    assert len(png_check(png)["Data-SHA256"]) == 64  # the curves it was drawn from
    assert f"{ranks} process(es)" in stdout
    if ranks == 2:
        assert "per rank: [10, 10] sequences" in stdout
    matches = "token-mean gradient matches the whole batch: max difference"
    assert max_difference(stdout, matches) <= 1e-10
    shortcut = re.search(r"the shortcut\) is another gradient: max difference (\S+)", stdout)
    assert shortcut, stdout
    assert float(shortcut.group(1)) > 1e-4  # the mean of micro-batch means is not the token mean
    assert max_difference(stdout) <= 1e-9
    assert stdout.rstrip().endswith("OK")


@pytest.mark.parametrize(
    ("policy", "args", "tol", "per_step"),
    [
        # 3 buckets (bucket_mb 0.01): one all_gather and one reduce_scatter of each per step.
        (
            "boundary",
            ("--dtype", "float32"),
            1e-4,
            "3 all_gather (params) of 22032 bytes, 3 reduce_scatter (gradients) of 22032 bytes",
        ),
        # Unequal rows (23 and 22), every bucket gathered and reduce-scattered per micro-batch.
        (
            "every",
            ("--dtype", "float64", "--batch", "45", "-n", "3", "--gather", "micro_batch"),
            1e-9,
            "9 all_gather (params) of 132192 bytes, "
            "9 reduce_scatter (gradients (every)) of 132192 bytes",
        ),
    ],
    ids=["boundary-float32", "every-float64-unequal-micro_batch"],
)
def test_fsdp(
    policy: str, args: tuple[str, ...], tol: float, per_step: str, tmp_path: Path
) -> None:
    pytest.importorskip("tqdm", reason="examples/fsdp.py needs the [examples] extra")
    common = ("--check", "--steps", "10", "--device", "cpu", "--checkpoint", str(tmp_path))
    stdout = run_torchrun("fsdp.py", *common, "--policy", policy, *args)
    assert "2 rank(s), gloo on cpu; 10 steps" in stdout
    assert f"policy {policy}" in stdout
    if "--batch" in args:
        assert "global batch 45 rows = [23, 22] per rank" in stdout
    after = re.search(r"^collectives per step after that: (.*)$", stdout, re.M)
    assert after, stdout
    assert per_step in after.group(1)
    assert "1 all_reduce (weight) of 16 bytes" in after.group(1)
    assert "1 all_reduce (norm) of" in after.group(1)
    assert "collectives as the plan predicts, in every step on every rank: True" in stdout
    assert "bit-identical to the uninterrupted run: True" in stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0.pt", "rank1.pt"]
    assert max_difference(stdout) <= tol


# On a 2x2 (replicate, shard) mesh: 5,508 params in 3 buckets of [4352, 1024, 132] elements,
# each rank's shard half of each. Reduce-scatters (and gathers) within the shard dim, as the
# policy says; one all_reduce of each shard across the replicate dim per step, whatever n; the
# fingerprint and the weight over both dims; the clipping norm over the shard dim.
MESH_COMMON = (
    "1 all_reduce (fingerprint) over shard of 16 bytes, "
    "1 all_reduce (fingerprint) over replicate of 16 bytes, "
)
MESH_TAIL = (
    "1 all_reduce (weight) over shard of 16 bytes, "
    "1 all_reduce (weight) over replicate of 16 bytes, "
)


@pytest.mark.parametrize(
    ("policy", "args", "tol", "per_step"),
    [
        # float32, n=4: the weights (4352 + 1024) every micro-batch, the biases (132) once.
        (
            "mixed",
            ("--dtype", "float32"),
            1e-4,
            "20 collectives, 119660 bytes: "
            + MESH_COMMON
            + "3 all_gather (params) over shard of 22032 bytes, "
            "8 reduce_scatter (gradients (every)) over shard of 86016 bytes, "
            "3 all_reduce (gradients) over replicate of 11016 bytes, "
            "1 reduce_scatter (gradients) over shard of 528 bytes, "
            + MESH_TAIL
            + "1 all_reduce (norm) over shard of 4 bytes",
        ),
        # float64, n=3, 45 rows (12, 11, 11, 11), params gathered per micro-batch.
        (
            "every",
            ("--dtype", "float64", "--batch", "45", "-n", "3", "--gather", "micro_batch"),
            1e-9,
            "26 collectives, 286488 bytes: "
            + MESH_COMMON
            + "9 all_gather (params) over shard of 132192 bytes, "
            "9 reduce_scatter (gradients (every)) over shard of 132192 bytes, "
            "3 all_reduce (gradients) over replicate of 22032 bytes, "
            + MESH_TAIL
            + "1 all_reduce (norm) over shard of 8 bytes",
        ),
    ],
    ids=["mixed-float32", "every-float64-unequal-micro_batch"],
)
def test_fsdp_mesh(
    policy: str, args: tuple[str, ...], tol: float, per_step: str, tmp_path: Path
) -> None:
    pytest.importorskip("tqdm", reason="examples/fsdp.py needs the [examples] extra")
    common = ("--mesh", "2x2", "--check", "--steps", "10", "--device", "cpu")
    common += ("--checkpoint", str(tmp_path), "--policy", policy)
    stdout = run_torchrun("fsdp.py", *common, *args, nproc=4)
    assert "4 rank(s) as a 2x2 (replicate, shard) mesh, gloo on cpu; 10 steps" in stdout
    assert "(padded to a multiple of 2); rank 0 holds 2754 of them" in stdout
    if "--batch" in args:
        assert "global batch 45 rows = [12, 11, 11, 11] per rank" in stdout
    after = re.search(r"^collectives per step after that: (.*)$", stdout, re.M)
    assert after, stdout
    assert after.group(1) == per_step
    assert "collectives as the plan predicts, in every step on every rank: True" in stdout
    assert "bit-identical to the uninterrupted run: True" in stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"rank{r}.pt" for r in range(4)]
    assert max_difference(stdout) <= tol


def test_fsdp_mesh_must_cover_the_world() -> None:
    proc = subprocess.run(
        [sys.executable, "-W", "error", str(EXAMPLES / "fsdp.py"), "--mesh", "2x2"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert proc.stderr.rstrip().endswith(
        "fsdp.py: error: --mesh 2x2: expected R x S to equal the number of processes, 1, but "
        "2 x 2 = 4; pass --mesh RxS with R*S = 1 (e.g. --mesh 1x1), or run 4 processes "
        "(torchrun --nproc_per_node 4)"
    ), proc.stderr


@pytest.mark.parametrize(
    ("reduce", "args", "per_step"),
    [
        # 19,204 float32 parameters: 2 bytes each in bfloat16, plus the 32-byte weight.
        ("bf16", (), ["all_reduce (gradients, bfloat16): 38,408"]),
        ("fp16", (), ["all_reduce (gradients, float16): 38,408"]),
        # k = ceil(0.1 * 19,204) = 1,921 per rank, all-gathered from 2 ranks (23 and 22 rows).
        (
            "topk",
            ("--ratio", "0.1", "-n", "3", "--batch", "45"),
            [
                "all_gather (gradients (top-k values), float32): 15,368",
                "all_gather (gradients (top-k indices), int64): 30,736",
            ],
        ),
        # Rank 4: P and Q factors of the two weight matrices, biases and the last layer exact.
        (
            "powersgd",
            (),
            [
                "all_reduce (gradients (P), float32): 4,096",
                "all_reduce (gradients (Q), float32): 2,304",
                "all_reduce (gradients, float32): 3,088",
            ],
        ),
    ],
    ids=["bf16", "fp16", "topk-unequal", "powersgd"],
)
def test_compression(reduce: str, args: tuple[str, ...], per_step: list[str]) -> None:
    pytest.importorskip("tqdm", reason="examples/compression.py needs the [examples] extra")
    common = ("--reduce", reduce, "--check", "--steps", "30", "--device", "cpu")
    stdout = run_torchrun("compression.py", *common, *args)
    assert "2 rank(s), gloo on cpu; 30 steps" in stdout
    if "--batch" in args:
        assert "global batch 45 rows = [23, 22] per rank" in stdout
    collectives = re.search(r"^bytes per optimizer step \(.*$", stdout, re.M)
    assert collectives, stdout
    for part in [*per_step, "all_reduce (weight, float64): 32"]:
        assert part in collectives.group(0)
    assert "exact all_reduce's 76,824" in stdout  # 4 * 19,204 + the 8-byte tail
    assert "parameters bit-identical on every rank: True" in stdout
    assert re.search(r"^loss vs exact: \S+ \(tolerance \S+\) OK$", stdout, re.M), stdout
    assert stdout.rstrip().endswith("OK")


@pytest.mark.parametrize("ranks", [1, 2])
def test_dp_sgd(ranks: int) -> None:
    pytest.importorskip("tqdm", reason="examples/dp_sgd.py needs the [examples] extra")
    args = ("--check", "-n", "3", "--steps", "15")
    stdout = run_example("dp_sgd.py", *args) if ranks == 1 else run_torchrun("dp_sgd.py", *args)
    assert f"{ranks} rank(s), 15 steps, n=3" in stdout
    assert "the same params on every rank: True" in stdout
    assert "all_reduce', 'weight', 32" in stdout
    diff = re.search(r"max parameter difference vs the plain loop: (\S+) OK", stdout)
    assert diff, stdout
    assert float(diff.group(1)) <= 1e-9


@pytest.mark.parametrize("ranks", [1, 2], ids=["1-process", "2-ranks"])
def test_migration(ranks: int) -> None:
    # The loops of docs/migration.md (its code blocks are fragments of this file).
    stdout = (run_example if ranks == 1 else run_torchrun)("migration.py")
    for rank in range(ranks):
        diff = re.search(
            rf"^rank {rank}: DDP \+ no_sync vs gradaccum, max parameter difference (\S+)$",
            stdout,
            re.M,
        )
        assert diff, stdout
        assert float(diff.group(1)) <= 1e-10
        assert (
            f"rank {rank}: Accumulator over a DistributedSampler, equal params on all ranks: True"
            in stdout
        )
        assert f"rank {rank}: OK" in stdout


@pytest.mark.parametrize(
    "program",
    [
        "pages/torchrun.py",
        "pages/sharded.py",
        "pages/scale.py",
        "pages/reductions.py",
        "pages/sync.py",
        "pages/checkpoints.py",  # a save every K micro-batches on uneven ranks, each resumed
    ],
)
def test_page_programs(program: str, tmp_path: Path) -> None:
    # examples/pages/<page>.py: the code of docs/<page>.md, whose blocks are its fragments.
    stdout = run_torchrun(program, cwd=tmp_path)  # pages write checkpoints
    assert "rank 1: " in stdout


def test_reliability_page_restarts_from_its_checkpoints(tmp_path: Path) -> None:
    # docs/reliability.md's loop: a run that saves every 50 micro-steps, then a restart from them.
    first = run_torchrun("pages/reliability.py", cwd=tmp_path)
    assert "rank 1: trained to micro-step 4000 from step 0" in first
    second = run_torchrun("pages/reliability.py", cwd=tmp_path)
    assert "rank 1: trained to micro-step 4000 from step 4000" in second


@pytest.mark.parametrize(
    ("ranks", "args"),
    [
        (1, ("--batch", "64", "-n", "4")),
        (2, ("--batch", "45", "-n", "3")),  # 23 and 22 pairs, ragged micro-batches
    ],
    ids=["1-process", "2-ranks-unequal"],
)
def test_contrastive(ranks: int, args: tuple[str, ...], tmp_path: Path) -> None:
    pytest.importorskip("tqdm", reason="examples/contrastive.py needs the [examples] extra")
    pytest.importorskip("matplotlib", reason="--plot needs the [plot] extra")
    png = tmp_path / "loss.png"
    args = ("--dtype", "float64", "--steps", "8", "--naive", "--plot", str(png), *args)
    run = run_example if ranks == 1 else run_torchrun
    stdout = run("contrastive.py", *args)
    assert stdout.count(f"wrote {png}") == 1  # rank 0 only
    data = png_check(png)["Data"]  # the curves it was drawn from, as JSON
    assert '"whole batch": [' in data
    assert '"plain accumulation (per-micro-batch negatives)": [' in data
    assert f"{ranks} process(es)" in stdout
    if ranks == 2:
        assert "global batch 45 pairs = [23, 22] per rank" in stdout
    assert max_difference(stdout, "max gradient difference at step 1:") <= 1e-12
    assert max_difference(stdout, "max loss-curve difference:") <= 1e-10
    assert max_difference(stdout) <= 1e-10
    naive = re.search(r"gradient at step 1 off by (\S+), loss curve by (\S+),", stdout)
    assert naive, stdout
    assert float(naive.group(1)) > 1e-3  # per-micro-batch negatives: another objective
    assert stdout.rstrip().endswith("OK")


@pytest.mark.parametrize(
    ("ranks", "args"),
    [
        (1, ("--batch", "64", "-n", "4")),
        (2, ("--batch", "45", "-n", "3")),  # 23 and 22 pairs, ragged micro-batches
    ],
    ids=["1-process", "2-ranks-unequal"],
)
def test_clip(ranks: int, args: tuple[str, ...]) -> None:
    pytest.importorskip("tqdm", reason="examples/clip.py needs the [examples] extra")
    stdout = (run_example if ranks == 1 else run_torchrun)(
        "clip.py", "--dtype", "float64", "--steps", "8", *args
    )
    assert f"{ranks} process(es)" in stdout
    if ranks == 2:
        assert "global batch 45 pairs = [23, 22] per rank" in stdout
    scale = re.search(r"gradient of logit_scale .* difference (\S+)$", stdout, re.M)
    assert scale, stdout
    assert float(scale.group(1)) <= 1e-12  # the parameter that only the loss uses
    assert max_difference(stdout, "max gradient difference vs the whole batch:") <= 1e-12
    naive = re.search(r"is another gradient: max difference (\S+)$", stdout, re.M)
    assert naive, stdout
    assert float(naive.group(1)) > 1e-3
    assert max_difference(stdout, "max loss-curve difference:") <= 1e-10
    assert max_difference(stdout) <= 1e-10
    assert stdout.rstrip().endswith("OK")
