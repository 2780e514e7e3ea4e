# Copyright (c) the DeepSpeed ZeRO-3 fork authors.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""No module of tools/patchtool imports, directly or through others, a module that imports it back: a circle works
only while every import stays inside a function, and the next engineer cannot tell which order is safe."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "tools" / "patchtool"


def relative_imports(path):
    """The package's modules that the module at `path` imports, wherever the import statement is."""
    imported = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            imported.update([node.module.split(".")[0]] if node.module else [a.name for a in node.names])
    return imported


def cycles(graph):
    """Each circle of imports found by a depth-first walk, as the list of modules around it."""
    found, done = [], set()

    def visit(module, path):
        for imported in sorted(graph.get(module, ())):
            if imported in path:
                found.append(path[path.index(imported):] + [imported])
            elif imported not in done:
                visit(imported, path + [imported])
        done.add(module)

    for module in sorted(graph):
        visit(module, [module])
    return found


def test_patchtool_has_no_import_circle():
    graph = {path.stem: relative_imports(path) for path in PACKAGE.glob("*.py")}
    assert "check" in graph and "branches" in graph, sorted(graph)
    assert not cycles(graph), cycles(graph)


def test_a_circle_is_found():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
