"""The first five minutes: the README's code, and what a newcomer runs or reads next.

- Every ```python block of README.md either runs or is a fragment of a file the tests run
  (tests/test_docs.py's convention, ``<!-- fragment: examples/NAME.py -->``, whose lines
  test_docs checks). The blocks that run here run in order, in one namespace, in a temporary
  directory, and their asserts check what the text around them claims.
- The README leads with the loop: a plain ``loss.backward()`` accumulation loop, then the same
  with ``gradaccum.loop`` (both fragments of examples/before_after.py, which checks that they
  end with the same parameters), then the functional form; the docs' home page shows the same
  blocks.
- Installing: no page asks pip for a ``gradaccum`` package (none is published), and every
  ``pip install -e ".[extra]"`` names extras that pyproject.toml defines.
- CHANGELOG.md records every name that left the top level (tests/public.py's MOVED).
- No checkpoint file is tracked, and .gitignore ignores them.
- docs/lightning.md: Lightning's sampler shuffles the training data with seed 0 (or
  ``L.seed_everything``'s) plus the epoch; examples/lightning_sampler.py checks it.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from public import MOVED
from test_docs import python_blocks
from test_examples import run_example, run_torchrun

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
BEFORE_AFTER = "examples/before_after.py"


def test_readme_code_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    blocks = python_blocks(README)
    runs = [block for block in blocks if block.fragment is None]
    assert runs, "README.md has no python block that runs"
    namespace = {"__name__": "readme"}
    for block in runs:
        # Pad with blank lines so that tracebacks give the README's line numbers.
        exec(compile("\n" * (block.line - 1) + block.source, str(README), "exec"), namespace)
    # The functional form's claim: the whole batch's gradient, within 1e-6 in float32.
    grads, whole = namespace["grads"], namespace["whole_grads"]
    assert all(grads[k].dtype == torch.float32 for k in grads)
    assert max((grads[k] - whole[k]).abs().max().item() for k in grads) <= 1e-6


def test_readme_leads_with_the_loop() -> None:
    blocks = python_blocks(README)
    before, after, functional = blocks[:3]
    assert before.fragment == after.fragment == BEFORE_AFTER
    assert ".backward()" in before.source
    assert "optimizer.step()" in before.source
    assert "loop.windows(loader, n)" in after.source
    assert "loop.Step(model, loss_fn, optimizer, data=data)" in after.source
    assert functional.fragment is None
    assert "gradaccum.accumulate(gradaccum.grad_and_value(loss_fn), n=8)" in functional.source
    home = [block.source for block in python_blocks(DOCS / "index.md")]
    assert home[:3] == [before.source, after.source, functional.source]


@pytest.mark.distributed
@pytest.mark.parametrize("rows", [96, 84])
def test_before_after(rows: int) -> None:
    stdout = run_example("before_after.py", "--rows", str(rows))
    exact = re.search(r"^gradaccum\.loop vs one backward per whole window: (\S+) ", stdout, re.M)
    assert exact, stdout
    assert float(exact.group(1)) <= 1e-12
    plain = re.search(r"^plain loop vs gradaccum\.loop: (\S+) \(same: (\w+)\)$", stdout, re.M)
    assert plain, stdout
    if rows == 96:  # 3 whole windows of 4 micro-batches of 8 rows: the plain loop is right
        assert float(plain.group(1)) <= 1e-12
    else:  # a last window of 3 micro-batches, the last of 4 rows: the plain loop never steps it
        assert float(plain.group(1)) > 1e-3
    assert stdout.rstrip().endswith("OK")


def _pages() -> list[Path]:
    """What a newcomer reads: the README, CONTRIBUTING.md, the docs and the examples."""
    return [README, ROOT / "CONTRIBUTING.md", *sorted(DOCS.rglob("*.md"))] + sorted(
        (ROOT / "examples").rglob("*.py")
    )


def _extras() -> set[str]:
    text = (ROOT / "pyproject.toml").read_text()
    section = text.split("[project.optional-dependencies]", 1)[1].split("\n[", 1)[0]
    return set(re.findall(r"^([\w-]+) = \[", section, re.M))


def test_install_commands_work_from_a_checkout() -> None:
    extras = _extras()
    assert {"hf", "lightning", "test", "examples"} <= extras
    unpublished, unknown = [], []
    for page in _pages():
        text = page.read_text()
        name = page.relative_to(ROOT).as_posix()
        for command in re.findall(r"pip install[^`\n]*", text):
            if re.search(r"\bgradaccum\b", command):
                unpublished.append(f"{name}: {command}")
            for group in re.findall(r"""-e\s+["']?\.\[([\w,-]+)\]""", command):
                unknown += [f"{name}: {command}" for x in group.split(",") if x not in extras]
    assert not unpublished, (
        f"pip install of a gradaccum package, which is not published: {unpublished}; install "
        f'from the checkout (pip install -e ".[extra]")'
    )
    assert not unknown, f"extras that pyproject.toml does not define: {unknown}"


def test_the_changelog_records_the_moved_names() -> None:
    text = (ROOT / "CHANGELOG.md").read_text()
    assert "## [Unreleased]" in text
    assert "## [0.1.0]" in text
    rows = re.findall(r"^\s*\| `(gradaccum\.[\w.]+)` \| `(gradaccum\.[\w.]+)` \|$", text, re.M)
    moves = dict(reversed(rows))  # old path -> new path, the oldest entry last so the newest wins
    missing = []
    for module, names in MOVED.items():
        for name in names:  # a chain of moves from the top level to where the name is now
            path, seen = f"gradaccum.{name}", set()
            while path in moves and path not in seen:
                seen.add(path)
                path = moves[path]
            if path != f"gradaccum.{module}.{name}":
                missing.append(f"gradaccum.{name} -> gradaccum.{module}.{name} (ends at {path})")
    assert not missing, f"moved names missing from CHANGELOG.md: {missing}"


def test_no_checkpoint_is_tracked() -> None:
    assert "*.pt" in (ROOT / ".gitignore").read_text().splitlines()
    git = shutil.which("git")
    if git is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    tracked = subprocess.run(
        [git, "ls-files", "--", "*.pt", "*.pth"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    ).stdout.split()
    assert not tracked, f"checkpoint files in the repository: {tracked}"


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("ranks", [1, 2], ids=["1-process", "2-ranks"])
def test_lightning_sampler_shuffles(ranks: int) -> None:
    pytest.importorskip("lightning", reason="needs the [lightning] extra")
    stdout = (run_example if ranks == 1 else run_torchrun)("lightning_sampler.py")
    assert stdout.rstrip().endswith("OK"), stdout
    lines = stdout.splitlines()
    assert lines[0].startswith(f"{ranks} process(es), DDPStrategy;")
    for seed in (0, 7):
        assert f".manual_seed({seed} + e))[rank::{ranks}]: [True, True]" in stdout
    assert "0..11, in every epoch: True" in stdout
    if ranks == 2:  # docs/lightning.md quotes this run
        page = (DOCS / "lightning.md").read_text()
        missing = [line for line in lines if line not in page]
        assert not missing, f"docs/lightning.md does not quote these lines of the run: {missing}"
