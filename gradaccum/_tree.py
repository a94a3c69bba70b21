"""The only module that talks to optree.

Pytrees here follow optree's defaults: ``None`` is an empty node, dict keys are sorted, so the
flat order of leaves is the same whatever the dict insertion order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import optree
from optree import PyTreeSpec
from torch.compiler import is_compiling

__all__ = [
    "PyTreeSpec",
    "broadcast_prefix",
    "first_difference",
    "flatten",
    "flatten_with_paths",
    "keystr",
    "map_",
    "unflatten",
]


def flatten(tree: Any) -> tuple[list[Any], PyTreeSpec]:
    """Leaves in optree's canonical order, and the tree structure."""
    return optree.tree_flatten(tree)


def unflatten(spec: PyTreeSpec, leaves: Sequence[Any]) -> Any:
    """Inverse of ``flatten``."""
    return optree.tree_unflatten(spec, leaves)


def map_(fn: Callable[..., Any], tree: Any, *rest: Any) -> Any:
    """``optree.tree_map``."""
    return optree.tree_map(fn, tree, *rest)


def keystr(path: tuple[Any, ...]) -> str:
    """A key path as the user would index it: ``['layer']['weight']``; the root is ``<root>``."""
    return "".join(f"[{k!r}]" if not isinstance(k, int) else f"[{k}]" for k in path) or "<root>"


def flatten_with_paths(tree: Any) -> tuple[list[str], list[Any], PyTreeSpec]:
    """Key-path strings, leaves and structure, in the canonical flat order."""
    if is_compiling():  # traced: no cache (Dynamo does not hash a PyTreeSpec)
        keys, leaves, spec = optree.tree_flatten_with_path(tree)
        return [keystr(p) for p in keys], leaves, spec
    leaves, spec = optree.tree_flatten(tree)
    try:
        paths = _PATHS.get(spec)
        cache = True
    except TypeError:  # a custom node with unhashable metadata: no cache
        paths, cache = None, False
    if paths is None:  # the key paths depend on the structure only: built once per structure
        paths = [keystr(p) for p in optree.tree_flatten_with_path(tree)[0]]
        if cache:
            if len(_PATHS) >= 256:
                _PATHS.clear()
            _PATHS[spec] = paths
    return list(paths), leaves, spec


_PATHS: dict[PyTreeSpec, list[str]] = {}


def none_paths(tree: Any) -> list[str]:
    """Key paths of the ``None`` leaves of ``tree`` (optree otherwise drops them silently)."""
    paths, leaves, _ = optree.tree_flatten_with_path(tree, none_is_leaf=True)
    return [keystr(p) for p, x in zip(paths, leaves) if x is None]


def first_difference(expected: Any, got: Any, *, prefix: bool = False) -> str:
    """Say where two trees first differ in structure, with the key path.

    E.g. ``"at ['b']: expected a dict with keys ['x', 'y'], got a dict with keys ['x']"``. With
    ``prefix=True``, a leaf of ``expected`` matches any subtree.
    """

    def node_desc(node: Any) -> str:
        if isinstance(node, dict):
            return f"a dict with keys {sorted(node, key=repr)}"
        if isinstance(node, tuple) and hasattr(node, "_fields"):
            return f"a {type(node).__name__} with fields {list(node._fields)}"
        if isinstance(node, (list, tuple)):
            return f"a {type(node).__name__} of length {len(node)}"
        if optree.treespec_is_leaf(optree.tree_structure(node)):
            return "a leaf"
        return f"a {type(node).__name__}"

    def walk(a: Any, b: Any, path: tuple[Any, ...]) -> str | None:
        sa, sb = optree.tree_structure(a), optree.tree_structure(b)
        if sa == sb or (prefix and optree.treespec_is_leaf(sa)):
            return None
        a_leaf, b_leaf = optree.treespec_is_leaf(sa), optree.treespec_is_leaf(sb)
        if not (a_leaf or b_leaf or type(a) is not type(b)):
            one_a, one_b = optree.tree_flatten_one_level(a), optree.tree_flatten_one_level(b)
            if tuple(one_a.entries) == tuple(one_b.entries):
                for key, x, y in zip(one_a.entries, one_a.children, one_b.children):
                    found = walk(x, y, (*path, key))
                    if found is not None:
                        return found
        return f"at {keystr(path)}: expected {node_desc(a)}, got {node_desc(b)}"

    return walk(expected, got, ()) or "in structure"


def broadcast_prefix(prefix: Any, tree: Any) -> list[Any]:
    """One value of the tree prefix ``prefix`` per leaf of ``tree``; ``ValueError`` if no prefix."""
    return optree.broadcast_prefix(prefix, tree)
