"""Lightning: the recipe of examples/lightning_recipe.py (manual optimization, gradaccum's
accumulated step per window) on 1 and 2 gloo processes against a whole-window float64 loop, its
collectives, and the measurements of ``Trainer(accumulate_grad_batches=...)`` that
docs/lightning.md quotes; and the page's own code.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from test_docs import python_blocks
from test_examples import run_example, run_torchrun

PAGE = Path(__file__).resolve().parents[1] / "docs" / "lightning.md"

pytestmark = pytest.mark.timeout(240)


def _lightning() -> None:
    pytest.importorskip("lightning", reason="needs the [lightning] extra")


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("ranks", [1, 2], ids=["1-process", "2-ranks"])
def test_lightning_recipe(ranks: int) -> None:
    _lightning()
    run = run_example if ranks == 1 else run_torchrun
    stdout = run("lightning_recipe.py", "--check")
    assert stdout.rstrip().endswith("OK"), stdout
    lines = stdout.splitlines()
    assert lines[0].startswith(f"{ranks} process(es), DDPStrategy on the script's gloo group")
    assert "(reused: True)" in lines[0]
    # Exact against one process on each whole global window, the short last one included.
    diff = re.search(r"^max parameter difference: (\S+) \(tolerance 1e-10\) OK$", stdout, re.M)
    assert diff, stdout
    assert float(diff.group(1)) <= 1e-10
    # gradaccum's two collectives per window and nothing else: no DDP all-reduce on top.
    assert (
        "recipe: collectives per window: all_reduce (fingerprint), all_reduce (gradients); all "
        "the profiler saw: True; gradients autograd wrote into the module's parameters: 0"
    ) in lines
    assert "recipe: 6 optimizer steps for 6 windows, scheduler at step 6" in lines
    # Lightning's own accumulation: its fixed variant is exact, the plain one is not.
    fixed = re.search(r"counted in advance\): gradient error up to (\S+)$", stdout, re.M)
    assert fixed, stdout
    assert float(fixed.group(1)) <= 1e-10
    error = re.search(r"full windows up to (\S+)%, short last windows up to (\S+)%", stdout)
    assert error, stdout
    assert float(error.group(1)) > 5
    assert float(error.group(2)) > 5
    # The page quotes this run's lines (2 processes) or numbers (1 process): they must agree,
    # all but the differences at rounding level (their last digits vary with the CPU).
    page = _rounding(PAGE.read_text())
    if ranks == 2:
        missing = [line for line in lines if _rounding(line) not in page]
        assert not missing, f"docs/lightning.md does not quote these lines of the run: {missing}"
    else:
        ratios = re.search(r"norm: (\S+), (\S+)$", stdout, re.M)
        assert ratios, stdout
        one = (
            f"the errors are up to {error.group(1)}% (full\nwindows) and {error.group(2)}% "
            f"(short ones), with norm ratios {ratios.group(1)} and {ratios.group(2)}"
        )
        assert one in page, one


def _rounding(text: str) -> str:
    """``text`` with numbers below 1e-12 (differences at rounding level) as ``<tiny>``."""
    return re.sub(r"\b\d\.\d+e-(1[3-9]|[2-9]\d)\b", "<tiny>", text)


def test_the_page_code_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _lightning()
    monkeypatch.chdir(tmp_path)  # Lightning may write logs
    torch.manual_seed(0)
    namespace = {"__name__": "docs_lightning"}
    blocks = python_blocks(PAGE)
    assert len(blocks) == 2
    for block in blocks:
        exec(compile("\n" * (block.line - 1) + block.source, str(PAGE), "exec"), namespace)
    assert namespace["trainer"].global_step == 3
