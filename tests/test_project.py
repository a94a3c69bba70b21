"""The project's promises about itself: README commands, CI, public API."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

from public import MOVED, SUBMODULES, TOP_LEVEL, modules, public_objects

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
    for name, obj in public_objects().items():
        assert inspect.getdoc(obj), f"{name} has no docstring"
        assert ">>> " in (inspect.getdoc(obj) or ""), f"{name} has no runnable example"
    assert (ROOT / "gradaccum" / "py.typed").exists()


def test_top_level_is_the_verbs_only() -> None:
    assert sorted(gradaccum.__all__) == sorted(TOP_LEVEL)
    for module, names in MOVED.items():
        submodule = getattr(gradaccum, module)
        for name in names:
            assert not hasattr(gradaccum, name), f"gradaccum.{name} is still at the top level"
            assert name in submodule.__all__, f"{name} is not in gradaccum.{module}.__all__"
            assert hasattr(submodule, name), f"gradaccum.{module}.{name} is missing"


def test_every_public_module_is_covered() -> None:
    """A module object in a public __all__ is checked through its own __all__: one of SUBMODULES."""
    for module in modules():
        for name in module.__all__:
            obj = getattr(module, name)
            if inspect.ismodule(obj):
                assert obj.__name__ in {f"gradaccum.{m}" for m in SUBMODULES}, obj.__name__
    for name in SUBMODULES:
        assert getattr(gradaccum, name).__name__ == f"gradaccum.{name}"
