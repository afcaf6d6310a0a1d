"""The import graph of kvpool: no cycles, and dependencies that point one way.

Every import counts: module level, inside functions, and under ``TYPE_CHECKING`` (a cycle of
type-only imports is still two modules that each need the other to be understood)."""

from __future__ import annotations

import ast
import functools
from collections import defaultdict
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"


def module_files() -> dict[str, Path]:
    out = {}
    for f in (SRC / "kvpool").rglob("*.py"):
        parts = list(f.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = f
    return out


@functools.cache
def import_graph() -> dict[str, set[str]]:
    """module -> the kvpool modules it imports (``from pkg import sub`` names ``pkg.sub``;
    ``pkg`` itself only when a name defined in its ``__init__`` is imported)."""
    mods = module_files()
    graph: dict[str, set[str]] = defaultdict(set)
    for mod, path in mods.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*up, base] if base else up)
                subs = [f"{base}.{a.name}" for a in node.names]
                names = [s for s in subs if s in mods]
                if len(names) < len(subs):
                    names.append(base)
            graph[mod].update(n for n in names if n in mods and n != mod)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        found.append(sorted(comp))
    return found


def test_the_cycle_finder_finds_a_cycle():
    g = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(g) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles():
    graph = import_graph()
    assert len(graph) > 100  # the walk really saw the package
    assert cycles(graph) == []


LIBRARY = ("common", "protocol", "transfer", "store", "model", "engine", "serving", "conductor",
           "bench", "integrations")  # fmt: skip
# (importer prefix, imported prefix): a layer that must not depend on one above it
FORBIDDEN = [
    ("kvpool.common", "kvpool.transfer"),
    ("kvpool.common", "kvpool.store"),
    ("kvpool.common", "kvpool.engine"),
    ("kvpool.config", "kvpool.transfer"),
    ("kvpool.transfer", "kvpool.store"),
    ("kvpool.transfer", "kvpool.engine"),
    ("kvpool.store", "kvpool.engine"),
    ("kvpool.store", "kvpool.serving"),
    ("kvpool.store", "kvpool.conductor"),
    ("kvpool.engine", "kvpool.serving"),
    ("kvpool.engine", "kvpool.conductor"),
    ("kvpool.model", "kvpool.engine"),
    ("kvpool.protocol", "kvpool.engine"),
    ("kvpool.protocol", "kvpool.serving"),
    ("kvpool.config", "kvpool.store"),
    ("kvpool.config", "kvpool.engine"),
    ("kvpool.config", "kvpool.serving"),
    # entry points are the top: no library package imports them
    *[(f"kvpool.{pkg}", "kvpool.entrypoints") for pkg in LIBRARY],
]


def test_command_lines_live_in_entrypoints():
    """Every subcommand's body is under ``kvpool/entrypoints/`` (``kvpool/cli.py`` only
    assembles them): no library package has a ``cli`` module of its own."""
    stray = sorted(m for m in module_files() if m.rpartition(".")[2] == "cli" and m != "kvpool.cli")
    assert stray == []


@pytest.mark.parametrize(("importer", "imported"), FORBIDDEN)
def test_dependencies_point_one_way(importer, imported):
    def under(mod: str, prefix: str) -> bool:
        return mod == prefix or mod.startswith(prefix + ".")

    bad = sorted(f"{m} -> {d}" for m, deps in import_graph().items() if under(m, importer)
                 for d in deps if under(d, imported))  # fmt: skip
    assert bad == []
