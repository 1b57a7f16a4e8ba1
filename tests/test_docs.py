"""The documentation inside the repository (issue 33): the README keeps its two commands (CI runs the
test command verbatim) in under 300 lines, every method has its page, every page is in the site's nav,
and nothing points to a document outside the repository. `mkdocs build --strict` (.ci/run) checks the
links between the pages; these tests need no mkdocs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ficoco.methods import METHODS

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
TEST_COMMAND = ('pip install torch==2.13.0 && pip install -e ".[dev]" && '
                'pip install --no-deps "lmms-eval>=0.7.3,<0.7.4" && python -m pytest -q -n 2 --dist loadfile')
MAIN_JOB = ('pip install torch==2.13.0 && pip install -e ".[dev]" && ficoco profile --model llava-1.5-7b '
            '--variant v --tflops 1.5')
# Documents that live outside the repository: a user who clones ficoco cannot read them.
OUTSIDE = ("SPEC.md", "ACCOUNTING.md", "BASELINES.md", "MODELS.md", "DESIGN.md", "../shared")
# FiCoCo-V and -L share one page.
PAGE_OF = {"v": "ficoco", "l": "ficoco"}


def _pages() -> list[Path]:
    return sorted(DOCS.rglob("*.md"))


def test_readme_holds_the_two_commands_and_ci_runs_the_test_command_verbatim() -> None:
    readme = README.read_text().splitlines()
    assert f"    {MAIN_JOB}" in readme
    assert f"    {TEST_COMMAND}" in readme
    assert TEST_COMMAND in (ROOT / ".ci" / "run").read_text().splitlines()


def test_readme_is_a_front_door_of_at_most_200_lines() -> None:
    assert len(README.read_text().splitlines()) <= 200


@pytest.mark.parametrize("name", sorted(METHODS))
def test_every_method_has_a_page_in_the_nav(name: str) -> None:
    page = f"methods/{PAGE_OF.get(name, name)}.md"
    assert (DOCS / page).is_file(), f"docs/{page} is missing"
    assert f": {page}" in (ROOT / "mkdocs.yml").read_text(), f"mkdocs.yml's nav lacks {page}"


def test_the_nav_lists_every_page_and_only_pages_that_exist() -> None:
    nav = set(re.findall(r":\s+(\S+\.md)\s*$", (ROOT / "mkdocs.yml").read_text(), flags=re.MULTILINE))
    pages = {path.relative_to(DOCS).as_posix() for path in _pages()}
    assert nav == pages


def test_nothing_points_to_a_document_outside_the_repository() -> None:
    files = [README, ROOT / "reports" / "README.md", ROOT / "pyproject.toml", ROOT / ".ci" / "run",
             ROOT / "mkdocs.yml", *_pages(), *sorted((ROOT / "profiles").rglob("*.json")),
             *(path for folder in ("ficoco", "ficoco_cli", "benchmarks", "tests") for path in
               sorted((ROOT / folder).rglob("*.py")) if path != Path(__file__).resolve())]
    found = [f"{path.relative_to(ROOT)}: {name}" for path in files for name in OUTSIDE if name in path.read_text()]
    assert not found, found


def test_docs_pages_link_only_to_docs_pages() -> None:
    """A link out of docs/ (`../ficoco/...`) breaks the strict build; code paths are named as `code`."""
    for path in _pages():
        for target in re.findall(r"\]\(([^)#\s]+)", path.read_text()):
            if target.startswith(("http://", "https://")):
                continue
            resolved = (path.parent / target).resolve()
            assert resolved.is_relative_to(DOCS), f"{path.relative_to(ROOT)} links out of docs/: {target}"
            assert resolved.exists(), f"{path.relative_to(ROOT)} links to a missing file: {target}"
