"""Stages import only downward: every import in ``spmd_aot/`` points at its own stage or one below.

The stage list lives in one place, the "Stages" table of ``docs/architecture.md``; this test reads
it from there, so the document and the check cannot drift apart. Every import counts: top-level
and inside functions (a lazy import is still a dependency), absolute and relative,
``from package import submodule`` resolved to the submodule. A new folder or top-level module
fails the test until the table names its stage.
"""

from __future__ import annotations

import ast
import dataclasses
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = "spmd_aot"
DOC = ROOT / "docs" / "architecture.md"


@dataclasses.dataclass(frozen=True)
class Stage:
    name: str
    holds: tuple[str, ...]  # "folder/" or "module.py", relative to the package


@dataclasses.dataclass(frozen=True)
class Upward:
    """One import that points above its module's stage."""
    module: str
    line: int
    target: str
    source_stage: str
    target_stage: str

    def __str__(self) -> str:
        return (f"{self.module.replace('.', '/')}.py:{self.line} imports {self.target} "
                f"(stage {self.source_stage!r} imports from stage {self.target_stage!r}, above it)")


def stages_from_doc(text: str) -> list[Stage]:
    """The rows of the table under the ``## Stages`` heading, bottom stage first."""
    section = re.search(r"^## Stages\n(.*?)(?=^## |\Z)", text, flags=re.MULTILINE | re.DOTALL)
    assert section, "docs/architecture.md has no '## Stages' section"
    stages = []
    for line in section.group(1).splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") else []
        if len(cells) < 3 or set(cells[0]) <= set("-: ") or cells[0].lower() == "stage":
            continue
        stages.append(Stage(cells[0].strip("*`"), tuple(re.findall(r"`([^`]+)`", cells[1]))))
    assert stages, "the Stages table of docs/architecture.md has no rows"
    return stages


def module_names(root: pathlib.Path, package: str) -> dict[str, pathlib.Path]:
    """Every module of ``package`` under ``root`` (packages by their ``__init__``), by dotted name."""
    names = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def imports_of(name: str, path: pathlib.Path, known: set[str]):
    """(line, target module) of every import in ``path``, wherever it stands in the file."""
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[:len(base) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            for alias in node.names:  # ``from pkg import submodule`` depends on the submodule
                child = f"{module}.{alias.name}"
                yield node.lineno, child if child in known else module


def stage_of(module: str, package: str, owner: dict[str, int]) -> int | None:
    """The stage index of ``module``: its top-level module's, or its top-level folder's."""
    parts = module.split(".")
    if parts[0] != package:
        return None
    if len(parts) == 1:
        return owner.get("__init__.py")
    return owner.get(parts[1] + "/", owner.get(parts[1] + ".py"))


def check_layers(root: pathlib.Path, package: str, stages: list[Stage]) -> tuple[list[str], list[Upward]]:
    """(modules no stage holds, imports that point upward) for the package under ``root``."""
    owner = {}
    for index, stage in enumerate(stages):
        for item in stage.holds:
            assert item not in owner, f"{item} is in two stages of the table"
            owner[item] = index
    modules = module_names(root, package)
    unplaced = sorted(m for m in modules if stage_of(m, package, owner) is None)
    upward = []
    for name, path in modules.items():
        here = stage_of(name, package, owner)
        if here is None:
            continue
        for line, target in imports_of(name, path, set(modules)):
            there = stage_of(target, package, owner)
            if there is not None and there > here:
                upward.append(Upward(name, line, target, stages[here].name, stages[there].name))
    return unplaced, upward


def test_every_import_points_down_the_documented_stages():
    stages = stages_from_doc(DOC.read_text())
    unplaced, upward = check_layers(ROOT, PACKAGE, stages)
    assert not unplaced, (f"{unplaced} belong to no stage: add the folder or module to the Stages "
                          "table of docs/architecture.md")
    assert not upward, "imports that point up the stages:\n" + "\n".join(map(str, upward))


#: What the store may use of the package: it knows bytes only (and runs without torch), so of the
#: stages below it only the exceptions and the format's byte codecs, which import no torch either.
STORE_USES = {"spmd_aot.errors", "spmd_aot.format", "spmd_aot.format.bounded", "spmd_aot.format.digests",
              "spmd_aot.format.limits", "spmd_aot.format.signing"}


def test_the_store_uses_only_the_byte_codecs_of_the_format():
    modules = module_names(ROOT, PACKAGE)
    def within(module: str, prefix: str) -> bool:
        return module == prefix or module.startswith(prefix + ".")

    store = f"{PACKAGE}.store"
    used = {(name, line, target) for name, path in modules.items() if within(name, store)
            for line, target in imports_of(name, path, set(modules))
            if within(target, PACKAGE) and not within(target, store)}
    other = sorted(f"{name.replace('.', '/')}.py:{line} imports {target}" for name, line, target in used
                   if target not in STORE_USES)
    assert not other, "the store uses more than bytes:\n" + "\n".join(other)


def test_the_table_names_what_exists():
    """A stage entry for a folder or module that is gone would let a new one of that name in unchecked."""
    for stage in stages_from_doc(DOC.read_text()):
        for item in stage.holds:
            assert (ROOT / PACKAGE / item).exists(), f"stage {stage.name!r} names {item}, which does not exist"


def test_the_readme_states_the_same_order():
    """Where the README gives the stage order (``a < b < ...``), it is the table's."""
    chains = re.findall(r"`?(\w+(?: < \w+){3,})`?", (ROOT / "README.md").read_text())
    order = " < ".join(s.name for s in stages_from_doc(DOC.read_text()))
    for chain in chains:
        assert chain == order, f"README.md says {chain}, docs/architecture.md says {order}"


# ---------------------------------------------------------------------------- the check can fail
def _tree(tmp_path: pathlib.Path, files: dict[str, str]) -> pathlib.Path:
    for rel, text in files.items():
        path = tmp_path / "pkg" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


_STAGES = [Stage("low", ("base.py", "low/")), Stage("high", ("high/", "__init__.py"))]


def test_downward_imports_pass(tmp_path):
    root = _tree(tmp_path, {"__init__.py": "from .high import top\n", "base.py": "",
                            "low/__init__.py": "", "low/a.py": "from .. import base\nfrom . import b\n",
                            "low/b.py": "import pkg.base\n", "high/__init__.py": "",
                            "high/top.py": "from ..low.a import x\nfrom pkg.low import b\n"})
    assert check_layers(root, "pkg", _STAGES) == ([], [])


@pytest.mark.parametrize("text, target", [
    ("from ..high import top\n", "pkg.high.top"),                   # relative, top of the file
    ("def f():\n    from ..high.top import g\n", "pkg.high.top"),  # lazy, inside a function
    ("import pkg.high.top as t\n", "pkg.high.top"),                 # absolute
    ("from pkg import high\n", "pkg.high"),                         # a package as a name
    ("from .. import __version__\n", "pkg"),                        # the package's own __init__
])
def test_an_upward_import_is_found(tmp_path, text, target):
    root = _tree(tmp_path, {"__init__.py": "", "base.py": "", "low/__init__.py": "", "low/a.py": text,
                            "high/__init__.py": "", "high/top.py": ""})
    unplaced, upward = check_layers(root, "pkg", _STAGES)
    assert unplaced == []
    assert [(u.module, u.target, u.source_stage, u.target_stage) for u in upward] == [
        ("pkg.low.a", target, "low", "high")]
    assert "pkg/low/a.py:" in str(upward[0])


def test_a_module_of_no_stage_is_reported(tmp_path):
    root = _tree(tmp_path, {"__init__.py": "", "base.py": "", "stray.py": "", "extra/__init__.py": ""})
    assert check_layers(root, "pkg", _STAGES)[0] == ["pkg.extra", "pkg.stray"]


def test_the_table_is_read_from_the_document():
    text = ("# T\n\n## Stages\n\n| Stage | Holds | What |\n|---|---|---|\n"
            "| **low** | `base.py`, `low/` | x |\n| high | `high/` | y |\n\n## Next\n| no | `x/` | z |\n")
    assert stages_from_doc(text) == [Stage("low", ("base.py", "low/")), Stage("high", ("high/",))]
