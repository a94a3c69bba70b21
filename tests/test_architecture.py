"""The architecture of gradaccum/, checked from its source (parsed with ``ast``, nothing imported).

Every import of a gradaccum module counts: ``from . import x``, ``from .x import y``,
``import gradaccum.x``, at module level, inside functions and under ``if TYPE_CHECKING:``.
docs/architecture.md describes the layers; CONTRIBUTING.md says how to place a new module.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "gradaccum"

# Bottom to top, by folder: a name is a module at the root of gradaccum/ or a subpackage (every
# module in it). A module may import modules of its own layer (without a cycle) or of the layers
# below it, never above. Every module of gradaccum/ is in exactly one layer.
LAYERS: list[tuple[str, set[str]]] = [
    (
        "leaves",
        {
            "_errors",
            "_checks",
            "_tree",
            "_split",
            "_reduce",
            "_kinds",
            "_layout",
            "_autograd",
            "_hooks",
            "_metrics",
        },
    ),
    ("transport", {"_dist"}),
    ("core", {"_core"}),
    ("syncs", {"sync", "sharding"}),
    ("checkpoints", {"checkpoint"}),
    (
        "extras",
        {"_coupled", "_module", "boundary", "compression", "privacy", "streaming", "testing"},
    ),
    ("loop", {"loop"}),
    ("public", {"__init__"}),
]
CORE = "_core"  # drives any sync through the protocol: imports no sync module or class
SYNC_PACKAGES = {"sync", "sharding"}
SYNC_CLASSES = {"AllReduce", "ReduceScatter", "CustomReduce", "Sharded"}
# Function-local imports of gradaccum modules that are allowed ("module: target"): none. An
# import moved into a function to dodge a cycle is still a cycle.
LOCAL_IMPORTS_ALLOWED: set[str] = set()


@dataclass(frozen=True)
class Import:
    """One import of a gradaccum module by another."""

    source: str  # the importing module, e.g. "_engine"
    target: str  # the imported module, e.g. "_window"
    line: int
    text: str  # the import statement as written
    local: bool  # inside a function


def module_name(path: Path, root: Path) -> str:
    """``_engine`` for gradaccum/_engine.py, ``__init__`` for the package, ``sub.x`` below."""
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts)


def package_of(name: str) -> str:
    """The package (relative to the root, "" for the root) a module's relative imports start in."""
    if name == "__init__" or name.endswith(".__init__"):
        return name.removesuffix("__init__").removesuffix(".")
    return name.rpartition(".")[0]


def imports(root: Path = PACKAGE, package: str = "gradaccum") -> dict[str, list[Import]]:
    """Every module of the package under ``root`` and the package modules it imports."""
    files = {module_name(p, root): p for p in sorted(root.rglob("*.py"))}
    modules = set(files)

    def resolve(dotted: str) -> str | None:
        """A module name relative to the root ("" is the package itself: its __init__)."""
        if dotted in modules:
            return dotted
        init = f"{dotted}.__init__" if dotted else "__init__"
        return init if init in modules else None

    graph: dict[str, list[Import]] = {}
    for name, path in files.items():
        source = path.read_text()
        tree = ast.parse(source, str(path))
        local_nodes = {
            id(node)
            for fn in ast.walk(tree)
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
            for node in ast.walk(fn)
        }
        found: list[Import] = []
        for node in ast.walk(tree):
            targets: list[str | None] = []
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package_of(name).split(".") if package_of(name) else []
                    base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
                    start = ".".join([*base, *(node.module.split(".") if node.module else [])])
                elif node.module == package or (node.module or "").startswith(package + "."):
                    start = (node.module or "").removeprefix(package).removeprefix(".")
                else:
                    continue
                for alias in node.names:  # from . import x, from .x import y (y a submodule)
                    sub = resolve(f"{start}.{alias.name}" if start else alias.name)
                    targets.append(sub if sub is not None else resolve(start))
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name == package or alias.name.startswith(package + "."):
                        targets.append(resolve(alias.name.removeprefix(package).removeprefix(".")))
            else:
                continue
            text = ast.get_source_segment(source, node) or ast.unparse(node)
            for target in dict.fromkeys(targets):
                if target is not None and target != name:
                    found.append(Import(name, target, node.lineno, text, id(node) in local_nodes))
        graph[name] = found
    return graph


def cycles(graph: dict[str, list[Import]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan's algorithm)."""
    edges = {m: sorted({i.target for i in imps}) for m, imps in graph.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, []):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def where(imp: Import) -> str:
    return f"gradaccum/{imp.source.replace('.', '/')}.py:{imp.line}: `{imp.text}`"


GRAPH = imports()


def home(module: str) -> str:
    """The name a module is placed by: its subpackage (``sync`` for ``sync._custom``), or itself."""
    return module.split(".")[0]


def layer_of(module: str) -> int:
    return next(k for k, (_, members) in enumerate(LAYERS) if home(module) in members)


def shortest_cycle(graph: dict[str, list[Import]], component: list[str]) -> list[Import]:
    """A shortest cycle through the first module of a strongly connected ``component``."""
    inside, start = set(component), component[0]
    paths: dict[str, list[Import]] = {start: []}
    queue = [start]
    for module in queue:  # breadth first
        for imp in graph[module]:
            if imp.target == start:
                return [*paths[module], imp]
            if imp.target in inside and imp.target not in paths:
                paths[imp.target] = [*paths[module], imp]
                queue.append(imp.target)
    raise AssertionError(f"{component} is not strongly connected")


def test_no_import_cycles() -> None:
    found = cycles(GRAPH)
    details = []
    for component in found:
        loop = shortest_cycle(GRAPH, component)
        chain = " -> ".join([loop[0].source, *(imp.target for imp in loop)])
        steps = "".join(f"\n    {where(imp)}" for imp in loop)
        details.append(f"{chain} (a cycle among {', '.join(component)}):{steps}")
    assert not found, "import cycles among gradaccum modules:\n" + "\n".join(details)


def test_every_module_is_in_exactly_one_layer() -> None:
    problems = []
    for module in sorted(GRAPH):
        homes = [name for name, members in LAYERS if home(module) in members]
        if len(homes) != 1:
            problems.append(
                f"gradaccum module {module!r} is in {len(homes)} layers ({homes}); put it (or its "
                f"folder) in exactly one of LAYERS in tests/test_architecture.py (see "
                f"docs/architecture.md)"
            )
    stale = sorted(set().union(*(m for _, m in LAYERS)) - {home(m) for m in GRAPH})
    problems += [f"LAYERS names {m!r}, which is not a module of gradaccum/" for m in stale]
    assert not problems, "\n".join(problems)


def test_imports_never_go_up_a_layer() -> None:
    placed = {m for m in GRAPH if any(home(m) in members for _, members in LAYERS)}
    upward = [
        f"{where(imp)} imports {imp.target} (layer {LAYERS[layer_of(imp.target)][0]!r}) from "
        f"{imp.source} (layer {LAYERS[layer_of(imp.source)][0]!r}): imports must point down"
        for imps in GRAPH.values()
        for imp in imps
        if imp.source in placed
        and imp.target in placed
        and layer_of(imp.target) > layer_of(imp.source)
    ]
    assert not upward, "imports that go up a layer:\n" + "\n".join(upward)


def test_no_function_local_imports_of_gradaccum_modules() -> None:
    local = [
        f"{where(imp)} imports {imp.target} inside a function; import it at module level (a "
        f"local import that dodges a cycle is still a cycle)"
        for imps in GRAPH.values()
        for imp in imps
        if imp.local and f"{imp.source}: {imp.target}" not in LOCAL_IMPORTS_ALLOWED
    ]
    assert not local, "function-local imports of gradaccum modules:\n" + "\n".join(local)


def test_core_knows_no_specific_sync() -> None:
    core = sorted(m for m in GRAPH if home(m) == CORE)
    assert core, "no module under gradaccum/_core/"
    problems = [
        f"{where(imp)}: the core ({imp.source}) imports the sync module {imp.target}; drive the "
        f"sync through the Sync/Window protocol (gradaccum/_core/protocol.py) instead"
        for m in core
        for imp in GRAPH[m]
        if home(imp.target) in SYNC_PACKAGES
    ]
    for m in core:
        path = PACKAGE / f"{m.replace('.', '/')}.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in {"isinstance", "issubclass"}
                and len(node.args) == 2
            ):
                continue
            named = {
                n.id if isinstance(n, ast.Name) else n.attr
                for n in ast.walk(node.args[1])
                if isinstance(n, (ast.Name, ast.Attribute))
            }
            if named & SYNC_CLASSES:
                problems.append(
                    f"gradaccum/{m}.py:{node.lineno}: `{ast.unparse(node)}` checks for a specific "
                    f"sync in the core; move the behaviour into that sync's Window"
                )
    assert not problems, "\n".join(problems)


def test_no_module_outside_the_syncs_sniffs_a_sync() -> None:
    """The loop and the core ask the ``Sync`` protocol (``sync.timeout``, ``sync.data_group()``,
    ``sync.shards``), never ``hasattr(sync, ...)`` or ``getattr(sync, ...)``."""
    problems = []
    for m in sorted(GRAPH):
        if home(m) in SYNC_PACKAGES:
            continue
        path = PACKAGE / f"{m.replace('.', '/')}.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in {"hasattr", "getattr"}
                and node.args
                and ast.unparse(node.args[0]).lower().endswith("sync")
            ):
                problems.append(
                    f"gradaccum/{m}.py:{node.lineno}: `{ast.unparse(node)}` sniffs a sync; add "
                    f"what is needed to gradaccum.sync.Sync (documented, with a default) and ask it"
                )
    assert not problems, "\n".join(problems)


# -- the checker checks what it should: a small package with each kind of import -----------------


@pytest.fixture
def toy(tmp_path: Path) -> Path:
    root = tmp_path / "toy"
    (root / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "from ._a import a as a\n",
        "_a.py": "from . import _b\nfrom ._c import C\n",
        "_b.py": "import toy._c\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
        "    from ._a import a\n",
        "_c.py": "def f():\n    from . import _d\n    return _d\n",
        "_d.py": "import os\nfrom toy import sub\n",
        "sub/__init__.py": "",
        "sub/x.py": "from .. import _d\nfrom . import y\n",
        "sub/y.py": "",
    }
    for rel, text in files.items():
        (root / rel).write_text(text)
    return root


def test_checker_counts_every_kind_of_import(toy: Path) -> None:
    graph = imports(toy, "toy")
    edges = {(i.source, i.target, i.local) for imps in graph.values() for i in imps}
    assert edges == {
        ("__init__", "_a", False),
        ("_a", "_b", False),  # from . import x
        ("_a", "_c", False),  # from .x import y
        ("_b", "_c", False),  # import toy.x
        ("_b", "_a", False),  # under TYPE_CHECKING
        ("_c", "_d", True),  # inside a function
        ("_d", "sub.__init__", False),  # from toy import subpackage
        ("sub.x", "_d", False),  # from .. import x
        ("sub.x", "sub.y", False),
    }
    assert cycles(graph) == [["_a", "_b"]]
    assert [(i.source, i.target) for i in shortest_cycle(graph, ["_a", "_b"])] == [
        ("_a", "_b"),
        ("_b", "_a"),
    ]


# A function takes at most this many parameters (self and cls not counted): more is a bundle of
# state or options that wants a name (the engine's WindowRun and RunOptions). Public signatures
# are the API and are exempt: they are listed here, "module: function".
MAX_PARAMS = 8
PUBLIC_SIGNATURES = {
    "_core/accumulate.py: accumulate",  # its keyword options
    "_core/accumulate.py: accumulate_as",  # accumulate's, and the call its errors name
    "loop/_step.py: __init__",  # gradaccum.loop.Step(...)
}


def test_no_private_function_takes_more_than_eight_parameters() -> None:
    over = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            a = node.args
            names = [x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs)]
            count = len([x for x in names if x not in ("self", "cls")])
            count += (a.vararg is not None) + (a.kwarg is not None)
            where = f"{path.relative_to(PACKAGE).as_posix()}: {node.name}"
            if count > MAX_PARAMS and where not in PUBLIC_SIGNATURES:
                over.append(f"{where} (line {node.lineno}, {count} parameters)")
    assert not over, over
