"""The markers the suite sets by itself: ``multiproc`` from the code, ``slow`` from a measurement.

``multiproc``: a test that starts processes through ``support.multiproc`` (gloo ranks, or a pool
of processes) is marked without anyone remembering to.

Why by reading and not by hand: a mark someone must remember is a mark someone forgets, and a
forgotten one puts a minute of rank processes into the fast tier (``docs/testing.md``). The
test's function, the fixtures it requests and every function those reach (in its module, the
conftest files and ``tests/support/``) are followed by name; reaching a launcher marks it.
Names are matched without their module, so a helper that merely shares a launcher's name marks
a test too: the error is always towards ``multiproc``, never away from it.

``slow``: the tests ``tests/slow.txt`` lists, each measured (CPU seconds, ``support.cpu_time``)
over the fast tier's limit. A list and not decorators: one measurement rewrites one file, and
the test files stay as their owners wrote them.
"""

from __future__ import annotations

import ast
import functools
import pathlib

import pytest

#: What starts processes in ``support.multiproc`` (and ``preloaded_context``, the pool behind them).
LAUNCHERS = frozenset({"run_ranks", "start_ranks", "run_launches", "run_processes", "preloaded_context"})

SUPPORT = pathlib.Path(__file__).resolve().parent
TESTS = SUPPORT.parent
SLOW_LIST = TESTS / "slow.txt"


@functools.cache
def _references(path: str) -> dict[str, frozenset[str]]:
    """Every function defined in the file (at any depth: fixtures, methods, nested helpers) ->
    the names and attribute names its body mentions. Same-named functions are merged."""
    tree = ast.parse(pathlib.Path(path).read_text(), filename=path)
    out: dict[str, set[str]] = {}
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names = out.setdefault(node.name, set())
            for sub in ast.walk(node):
                if isinstance(sub, ast.Name):
                    names.add(sub.id)
                elif isinstance(sub, ast.Attribute):
                    names.add(sub.attr)
    return {name: frozenset(refs) for name, refs in out.items()}


@functools.cache
def _support_references() -> dict[str, frozenset[str]]:
    merged: dict[str, set[str]] = {}
    for path in sorted(SUPPORT.glob("*.py")):
        for name, refs in _references(str(path)).items():
            merged.setdefault(name, set()).update(refs)
    return {name: frozenset(refs) for name, refs in merged.items()}


def _reaches_launcher(roots: set[str], tables: list[dict[str, frozenset[str]]]) -> bool:
    seen: set[str] = set()
    todo = list(roots)
    while todo:
        name = todo.pop()
        if name in LAUNCHERS:
            return True
        if name in seen:
            continue
        seen.add(name)
        for table in tables:
            todo.extend(table.get(name, ()))
    return False


def starts_processes(item: pytest.Item) -> bool:
    """Whether ``item`` (a collected test function) reaches a launcher of ``support.multiproc``."""
    path = getattr(item, "path", None)
    function = getattr(item, "function", None)
    if path is None or function is None or path.suffix != ".py":
        return False
    tables = [_references(str(path))]
    for folder in (path.parent, *path.parents):
        conftest = folder / "conftest.py"
        if conftest.is_file():
            tables.append(_references(str(conftest)))
        if folder == TESTS:
            break
    tables.append(_support_references())
    return _reaches_launcher({function.__name__, *getattr(item, "fixturenames", ())}, tables)


def mark_multiproc(items: list[pytest.Item]) -> None:
    """Add the ``multiproc`` marker to every item that starts processes (see the module doc)."""
    for item in items:
        if starts_processes(item):
            item.add_marker(pytest.mark.multiproc)


def slow_ids(path: pathlib.Path = SLOW_LIST) -> list[str]:
    """The node ids ``path`` lists (relative to the repository root), comments and blanks skipped."""
    lines = (line.split("#", 1)[0].strip() for line in path.read_text(encoding="utf-8").splitlines())
    return [line for line in lines if line]


def _listed(nodeid: str, listed: frozenset[str]) -> bool:
    """``nodeid`` or, for a parametrized test, the id without its ``[parameters]``."""
    return nodeid in listed or nodeid.split("[", 1)[0] in listed


def mark_slow(items: list[pytest.Item]) -> None:
    """Add the ``slow`` marker to every item ``tests/slow.txt`` lists (node ids are relative to the
    rootdir, the repository root where ``pyproject.toml`` is, from whatever directory pytest runs)."""
    listed = frozenset(slow_ids())
    for item in items:
        if _listed(item.nodeid, listed):
            item.add_marker(pytest.mark.slow)
