"""The relative links of README.md and docs/*.md point at files (and headings) that exist."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from mext_testing import ROOT

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
CODE_SPAN = re.compile(r"`[^`\n]*`")


def _text(path: Path) -> str:
    """The page without code blocks and code spans, where brackets are not links."""
    return CODE_SPAN.sub("code", FENCE.sub("", path.read_text()))


def _anchors(path: Path) -> set:
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, '-' for ' '."""
    seen, anchors = {}, set()
    for line in FENCE.sub("", path.read_text()).splitlines():
        match = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not match:
            continue
        slug = re.sub(r"[^\w\- ]", "", match.group(1).lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def relative_links(page: Path) -> list:
    """(target path, anchor or '') of each link of ``page`` that is not a URL."""
    links = []
    for target in LINK.findall(_text(page)):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        links.append((page if not path else (page.parent / path).resolve(), anchor))
    return links


def test_the_pages_exist_and_link_to_each_other():
    assert (ROOT / "docs" / "README.md") in PAGES
    readme_targets = {path for path, _ in relative_links(ROOT / "README.md")}
    for page in PAGES[1:]:
        assert page in readme_targets, f"README.md does not link {page.relative_to(ROOT)}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    links = relative_links(page)
    assert links or page.name != "README.md", "no links found: the pattern is broken"
    for path, anchor in links:
        where = f"{page.relative_to(ROOT)} -> {path}#{anchor}"
        assert path.exists(), f"missing file: {where}"
        if anchor and path.suffix == ".md":
            assert anchor in _anchors(path), f"missing heading: {where}"


def test_anchor_rule_matches_github():
    page = ROOT / "docs" / "running.md"
    assert "slurm-and-the-job-scripts-in-examples" in _anchors(page)
    assert "bad-input" in _anchors(page)
