"""README.md is also the package index's page for the project, where relative links and
images break: every link and image in it is absolute, and each one into this repository
names a file (and a heading anchor, when it has one) that exists here. Offline: the
repository's own files stand for what the links will show once pushed."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.no_database  # runs once, in the common pass

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")
REPO_PAGES = "https://github.com/celery-steplock/celery-steplock/blob/main/"
REPO_FILES = "https://raw.githubusercontent.com/celery-steplock/celery-steplock/main/"
TARGETS = re.findall(r"\]\(\s*([^)\s]+)", README) + re.findall(r"<img[^>]+src=\"([^\"]+)", README)


def _anchors(page: Path) -> set[str]:
    """GitHub's anchors of a Markdown page's headings (lower case, punctuation dropped,
    spaces as hyphens) and the explicit MyST targets ``(name)=``."""
    found = set()
    for line in page.read_text(encoding="utf-8").splitlines():
        heading = re.match(r"#{1,6}\s+(.*)", line)
        if heading:
            text = re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower())
            found.add(text.replace(" ", "-"))
        target = re.match(r"\(([\w\-]+)\)=\s*$", line)
        if target:
            found.add(target.group(1))
    return found


def test_the_readme_has_links_to_check():
    assert len(TARGETS) >= 10, TARGETS


@pytest.mark.parametrize("target", sorted(set(TARGETS)))
def test_each_readme_link_is_absolute_and_its_file_exists(target):
    assert target.startswith(("https://", "mailto:")), (
        f"{target!r} is relative: it breaks on the package index; use {REPO_PAGES}<path>"
    )
    for base in (REPO_PAGES, REPO_FILES):
        if target.startswith(base):
            path, _, anchor = target[len(base) :].partition("#")
            assert (ROOT / path).is_file(), f"{target} names {path}, which is not in the repo"
            if anchor:
                assert anchor in _anchors(ROOT / path), f"{target}: no heading #{anchor}"
