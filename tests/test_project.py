"""The project's promises about itself: README commands, CI, public API."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import gradaccum

ROOT = Path(__file__).resolve().parents[1]


def _readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", text, flags=re.S)
    return [line for b in blocks for line in b.splitlines() if line and not line.startswith("#")]


def test_readme_opens_with_two_commands_example_and_tests() -> None:
    cmds = _readme_commands()[:2]
    assert "examples/quickstart.py" in cmds[0]
    assert "pytest" in cmds[1]
    assert (ROOT / "examples" / "quickstart.py").exists()


def test_ci_runs_the_readme_test_command_verbatim() -> None:
    test_cmd = _readme_commands()[1]
    assert test_cmd in (ROOT / ".ci" / "run").read_text().splitlines()


def test_public_names_are_documented_and_typed() -> None:
    for name in gradaccum.__all__:
        obj = getattr(gradaccum, name)
        assert inspect.getdoc(obj), f"{name} has no docstring"
        assert ">>> " in (inspect.getdoc(obj) or ""), f"{name} has no runnable example"
    assert (ROOT / "gradaccum" / "py.typed").exists()
