"""The package stays easy to walk: no module over 600 lines, no function over 80, and every
stage folder says in its docstring what it holds."""

import ast
import pathlib

import spmd_aot

PACKAGE = pathlib.Path(spmd_aot.__file__).parent
MAX_MODULE_LINES, MAX_FUNCTION_LINES = 600, 80


def _modules():
    return sorted(PACKAGE.rglob("*.py"))


def test_no_module_is_over_600_lines():
    long = {str(p.relative_to(PACKAGE)): n for p in _modules() if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert long == {}, f"split these modules by concept: {long}"


def test_no_function_is_over_80_lines():
    long = []
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name} ({lines} lines)")
    assert long == [], "split these functions: " + ", ".join(long)


def test_every_stage_folder_says_what_it_holds():
    folders = [p.parent for p in PACKAGE.glob("*/__init__.py")]
    assert len(folders) >= 8  # keying, tracing, parallel, passes, format, building, runtime, store, cli, ...
    silent = [f.name for f in folders if not ast.get_docstring(ast.parse((f / "__init__.py").read_text()))]
    assert silent == []
