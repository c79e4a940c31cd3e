"""The package's import graph has no cycle: data flows one way (job -> key -> trace -> store ->
runtime), and a cycle is where that stops being true."""

import ast
import pathlib

import spmd_aot

PACKAGE = pathlib.Path(spmd_aot.__file__).parent


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports() -> dict[str, set[str]]:
    """module -> the package modules it imports (at any level of the file, lazily or not)."""
    files = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    edges: dict[str, set[str]] = {m: set() for m in files}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.ImportFrom):
                base = package
                for _ in range(max(node.level - 1, 0)):
                    base = base.rpartition(".")[0]
                module = (f"{base}.{node.module}" if node.module else base) if node.level else node.module
                targets = [f"{module}.{a.name}" if f"{module}.{a.name}" in files else module for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            # a package's __init__ re-exporting its submodules is not a cycle with them
            edges[name] |= {t for t in targets if t in files and t != name and not t.startswith(name + ".")
                            and not name.startswith(t + ".")}
    return edges


def _cycle(edges: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}

    def visit(node, path):
        state[node] = 1
        for nxt in sorted(edges[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt, path + [nxt])
                if found:
                    return found
        state[node] = 2
        return None

    for module in sorted(edges):
        if module not in state:
            found = visit(module, [module])
            if found:
                return found
    return None


def test_the_package_import_graph_has_no_cycle():
    edges = _imports()
    # the walk sees imports
    assert "spmd_aot.tracing.trace" in edges and "spmd_aot.parallel.mesh" in edges["spmd_aot.tracing.expand"]
    assert _cycle(edges) is None, " -> ".join(_cycle(edges))


def test_the_cycle_finder_finds_one():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None
