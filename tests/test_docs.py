"""The docs: API entries, the nav, and every ```python block of every page.

The rule for code blocks (CONTRIBUTING.md, "Docstrings and docs"): every ```python block of every
page under docs/ runs in these tests. A page's blocks run in order, in one namespace, in one
process (in a temporary directory). A block that cannot run there (it needs several processes,
or an optional package) is marked, on the line before it, as a fragment of a file that the tests
run: ``<!-- fragment: examples/ddp.py -->``. Its non-blank lines must then occur in that file, in
the same order (leading and trailing spaces aside), and the file must be run by a test (its name
appears in a tests/test_*.py other than this one). There is no other way out: ``<!-- skip -->`` is
refused.
"""

import re
import textwrap
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
from public import public_objects

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"

FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<ticks>`{3,})\s*(?P<lang>[\w+-]*)[^\n]*$")
FRAGMENT = re.compile(r"^<!--\s*fragment:\s*(?P<path>\S+)\s*-->$")
SKIP = "<!-- skip -->"
API_ENTRY = re.compile(r"^:::[ \t]+(\S+)[ \t]*$", re.MULTILINE)


class Block(NamedTuple):
    line: int  # the block's first line of code, 1-based
    source: str  # dedented
    fragment: str | None  # the file it is a fragment of, or None: it runs
    marker: str  # the non-blank line before the fence


def nav_pages():
    """The .md paths named in mkdocs.yml's top-level ``nav:`` block (no YAML parser needed)."""
    text = (ROOT / "mkdocs.yml").read_text()
    match = re.search(r"^nav:[ \t]*\n((?:[ \t]+.*\n|[ \t]*\n)*)", text, re.MULTILINE)
    assert match, "mkdocs.yml has no top-level nav:"
    return set(re.findall(r"[\w./-]+\.md\b", match[1]))


def python_blocks(page):
    """The page's ```python fences as Blocks, in order."""
    lines = page.read_text().splitlines()
    blocks = []
    i = 0
    while i < len(lines):
        match = FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        indent, ticks, lang = match["indent"], match["ticks"], match["lang"]
        start = i + 1
        end = start
        closing = re.compile(rf"^{re.escape(indent)}{ticks}`*\s*$")
        while end < len(lines) and not closing.match(lines[end]):
            end += 1
        assert end < len(lines), f"{page.name}:{i + 1}: unclosed code fence"
        previous = next((line.strip() for line in reversed(lines[:i]) if line.strip()), "")
        if lang == "python":
            source = textwrap.dedent("\n".join(lines[start:end]))
            fragment = FRAGMENT.match(previous)
            blocks.append(Block(start + 1, source, fragment and fragment["path"], previous))
        i = end + 1
    return blocks


def pages():
    return sorted(page.relative_to(DOCS).as_posix() for page in DOCS.rglob("*.md"))


def pages_with(kind):
    """The pages with blocks that run (kind "run") or with fragments (kind "fragment")."""
    out = []
    for name in pages():
        blocks = python_blocks(DOCS / name)
        if any((b.fragment is None) == (kind == "run") for b in blocks):
            out.append(name)
    return out


def test_every_public_name_has_an_api_entry():
    documented = set()
    for page in (DOCS / "api").glob("*.md"):
        documented.update(API_ENTRY.findall(page.read_text()))
    missing = [name for name in public_objects() if name not in documented]
    assert not missing, f"no '::: NAME' entry in docs/api/*.md for: {', '.join(missing)}"


def test_every_api_entry_is_public():
    public = public_objects()
    unknown = [
        f"{page.name}: {entry}"
        for page in sorted((DOCS / "api").glob("*.md"))
        for entry in API_ENTRY.findall(page.read_text())
        if entry not in public
    ]
    assert not unknown, f"'::: NAME' entries for names in no public __all__: {unknown}"


def test_every_page_is_in_the_nav():
    nav = nav_pages()
    pages = {page.relative_to(DOCS).as_posix() for page in DOCS.rglob("*.md")}
    assert not pages - nav, f"pages missing from the mkdocs.yml nav: {sorted(pages - nav)}"
    assert not nav - pages, f"nav entries without a page: {sorted(nav - pages)}"


def test_blocks_and_fragment_markers_are_read(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "```python\nx = 1\n```\n\n<!-- fragment: examples/ddp.py -->\n"
        '=== "tab"\n\n    ```python\n    if x:\n        y = 2\n    ```\n'
    )
    assert python_blocks(page) == [
        Block(2, "x = 1", None, ""),
        Block(9, "if x:\n    y = 2", None, '=== "tab"'),
    ]
    page.write_text("<!-- fragment: examples/ddp.py -->\n\n```python\nx = 1\n```\n")
    assert python_blocks(page) == [
        Block(4, "x = 1", "examples/ddp.py", "<!-- fragment: examples/ddp.py -->")
    ]


def test_no_block_is_skipped():
    skipped = [
        f"{name}:{block.line}"
        for name in pages()
        for block in python_blocks(DOCS / name)
        if block.marker == SKIP
    ]
    assert not skipped, (
        f"python blocks marked {SKIP}, which the doc tests no longer honour: {skipped}; make the "
        f"block run with the page, or mark it <!-- fragment: examples/NAME.py --> (its lines in "
        f"a file the tests run)"
    )


def fenced(text, lang):
    return re.findall(rf"^```{lang}\n(.*?)^```", text, re.MULTILINE | re.DOTALL)


def test_install_commands_match_the_readme():
    readme = fenced((ROOT / "README.md").read_text(), "bash")
    page = fenced((DOCS / "getting-started.md").read_text(), "bash")
    assert readme, "README.md has no bash blocks"
    stale = [block for block in readme if block not in page]
    assert not stale, f"README install commands not in docs/getting-started.md: {stale}"


def test_home_page_example_matches_the_readme():
    readme = fenced((ROOT / "README.md").read_text(), "python")
    assert readme, "README.md has no python block"
    assert readme[0] in fenced((DOCS / "index.md").read_text(), "python")


# concepts.md compiles its step (7 s): it runs in the slow tier; the other pages in the fast one.
SLOW_PAGES = {"concepts.md"}


@pytest.mark.parametrize(
    "name",
    [pytest.param(n, marks=pytest.mark.slow) if n in SLOW_PAGES else n for n in pages_with("run")],
)
def test_page_code_runs(name, tmp_path, monkeypatch):
    page = DOCS / name
    monkeypatch.chdir(tmp_path)  # snippets may write files (checkpoints)
    torch.manual_seed(0)
    namespace = {"__name__": f"docs_{page.stem.replace('-', '_')}"}
    for block in python_blocks(page):
        if block.fragment is None:
            # Pad with blank lines so that tracebacks give the line numbers of the page.
            code = compile("\n" * (block.line - 1) + block.source, str(page), "exec")
            exec(code, namespace)


def _tested_files():
    """The text of the test modules that run files (all but this one)."""
    return "\n".join(
        p.read_text()
        for p in sorted((ROOT / "tests").glob("test_*.py"))
        if p.name != "test_docs.py"
    )


@pytest.mark.parametrize("name", pages_with("fragment"))
def test_fragments_are_in_files_the_tests_run(name):
    check_fragments(DOCS / name)


def test_readme_fragments_are_in_files_the_tests_run():
    """README.md's first python block is the home page's (above); marked ones are checked."""
    assert any(b.fragment for b in python_blocks(ROOT / "README.md"))
    check_fragments(ROOT / "README.md")


def check_fragments(page):
    tests = _tested_files()
    for block in python_blocks(page):
        if block.fragment is None:
            continue
        shown = page.relative_to(ROOT).as_posix() if page.is_relative_to(ROOT) else page.name
        where = f"{shown}:{block.line}: fragment of {block.fragment}"
        path = ROOT / block.fragment
        assert path.is_file(), f"{where}: no such file in the repository"
        names = {path.name, path.relative_to(ROOT).as_posix()}
        if path.is_relative_to(ROOT / "examples"):
            names.add(path.relative_to(ROOT / "examples").as_posix())
        assert any(f'"{name}"' in tests for name in names), (
            f"{where}: no tests/test_*.py runs it (names it, in quotes, as one of {sorted(names)})"
        )
        found = [line.strip() for line in path.read_text().splitlines()]
        at = 0
        for offset, line in enumerate(block.source.splitlines()):
            if not line.strip():
                continue
            try:
                at = found.index(line.strip(), at) + 1
            except ValueError:
                raise AssertionError(
                    f"{where}: line {block.line + offset} ({line.strip()!r}) is not in "
                    f"{block.fragment} after its line {at}; copy the code from the file, or "
                    f"change both"
                ) from None


def test_fragment_check_catches_a_missing_line(tmp_path, monkeypatch):
    page = tmp_path / "page.md"
    page.write_text("<!-- fragment: examples/ddp.py -->\n```python\nnot_in_ddp = 42\n```\n")
    monkeypatch.setattr("test_docs.DOCS", tmp_path)
    with pytest.raises(AssertionError, match=r"line 3 \('not_in_ddp = 42'\) is not in"):
        test_fragments_are_in_files_the_tests_run("page.md")
