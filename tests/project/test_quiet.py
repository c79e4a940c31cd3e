"""Output belongs to the program: library code logs (``spmd_aot`` logger) and never prints;
only the CLI (with its progress bar) and the examples write to stdout/stderr. Passing tests
print nothing: none bypasses pytest's output capture."""

from __future__ import annotations

import ast
import pathlib

REPO = pathlib.Path(__file__).resolve().parents[2]
# the programs: the command line (its package, progress bar included), and the README's example jobs
PROGRAMS = {"cli", "__main__.py", "examples"}


def _writes_output(node) -> bool:
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "print":
        return True
    return (isinstance(node, ast.Attribute) and node.attr in ("stdout", "stderr")
            and isinstance(node.value, ast.Name) and node.value.id == "sys")


def test_library_code_never_prints():
    offenders = []
    for path in sorted((REPO / "spmd_aot").rglob("*.py")):
        if PROGRAMS & set(path.relative_to(REPO / "spmd_aot").parts):
            continue
        offenders += [f"{path.relative_to(REPO)}:{node.lineno}" for node in ast.walk(ast.parse(path.read_text()))
                      if _writes_output(node)]
    assert offenders == [], "library code must log under the spmd_aot logger, not print: " + ", ".join(offenders)


def test_no_test_bypasses_output_capture():
    offenders = [f"{path.name}:{n}" for path in sorted((REPO / "tests").glob("*.py")) if path.name != "test_quiet.py"
                 for n, line in enumerate(path.read_text().splitlines(), 1)
                 if "capsys.disabled()" in line or "capfd.disabled()" in line or "sys.__stdout__" in line]
    assert offenders == [], "tests print past pytest's capture: " + ", ".join(offenders)
