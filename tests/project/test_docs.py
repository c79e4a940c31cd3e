"""The user guide (README.md) and the reference in docs/ say only what can be checked.

Why: documentation rots where nothing reads it. A path that moved, a link to a section that was
renamed, or a sentence that narrates how the project got here ("in this round", "issue 19")
misleads a reader who has only the repository. So every repository path named in backticks or
links must exist, every relative link must land on a file (and, with an anchor, on a heading of
it), no sentence may narrate rounds or issues, the README stays a short guide that links every
docs/ page, and its quickstart block holds exactly the three commands `.ci/run` executes.
"""

from __future__ import annotations

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, *DOCS]

#: repository paths as prose names them: from the root, or a module below spmd_aot/
ROOT_PATH = re.compile(r"(?<![\w/.$-])(?:spmd_aot|tests_cuda|tests|tools|docs|cache|\.ci)/[\w./-]*")
PACKAGE_PATH = re.compile(r"(?<![\w/.$-])(?:building|cli|entries|format|interpreter|keying|parallel|passes|runtime|store|tracing)"
                          r"/[\w/-]*\.(?:py|txt)")
NARRATION = re.compile(r"this round|previous round|rounds ago|issue \d+|issue-\d+", re.IGNORECASE)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)


def _prose(page: pathlib.Path) -> str:
    """The page without its fenced code blocks (examples may name files a user would create)."""
    return FENCE.sub("", page.read_text(encoding="utf-8"))


def _code_spans(text: str) -> list[str]:
    return re.findall(r"`([^`\n]+)`", text)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lowercase, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(page: pathlib.Path) -> set[str]:
    return {_slug(line.lstrip("#")) for line in FENCE.sub("", page.read_text(encoding="utf-8")).splitlines()
            if line.startswith("#")}


def _named_paths(page: pathlib.Path) -> set[str]:
    found = set()
    for span in _code_spans(_prose(page)):
        for match in ROOT_PATH.findall(span):
            found.add(match.rstrip(".,:;"))
        for match in PACKAGE_PATH.findall(span):
            found.add("spmd_aot/" + match)
    return found


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_path_named_in_backticks_exists(page):
    missing = sorted(p for p in _named_paths(page) if not (ROOT / p.split("::")[0]).exists())
    assert not missing, f"{page.relative_to(ROOT)} names paths that do not exist: {missing}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_lands_on_a_file_and_heading(page):
    broken = []
    for target in LINK.findall(_prose(page)):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(target)
    assert not broken, f"{page.relative_to(ROOT)} has broken links: {broken}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_no_sentence_narrates_rounds_or_issues(page):
    hits = [line.strip() for line in page.read_text(encoding="utf-8").splitlines() if NARRATION.search(line)]
    assert not hits, f"{page.relative_to(ROOT)} narrates history instead of saying what is: {hits}"


def test_readme_is_a_short_guide_linking_every_docs_page():
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) < 300
    assert DOCS, "docs/ holds the reference"
    linked = {(ROOT / target.partition("#")[0]).resolve() for target in LINK.findall(text)}
    unlinked = [d.relative_to(ROOT).as_posix() for d in DOCS if d.resolve() not in linked]
    assert not unlinked, f"README.md does not link {unlinked}"


def test_quickstart_block_holds_the_three_commands_ci_runs():
    """The same extraction as `.ci/run`'s awk: the fenced block after `<!-- quickstart`, comment
    lines and blanks dropped, up to `<!-- /quickstart -->`."""
    lines = README.read_text(encoding="utf-8").splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("<!-- quickstart"))
    end = next(i for i, line in enumerate(lines) if line.startswith("<!-- /quickstart -->"))
    fence = [i for i in range(start, end) if lines[i].startswith("```")]
    assert len(fence) == 2, "one fenced block between the quickstart markers"
    commands = [line for line in lines[fence[0] + 1:fence[1]] if line.strip() and not line.lstrip().startswith("#")]
    assert len(commands) == 3, commands
    assert commands[0].startswith("pip install -e ")
    assert "spmd_aot.examples.quickstart" in commands[1]
    assert "pytest" in commands[2]
