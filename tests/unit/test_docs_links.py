"""The relative links of README.md and docs/*.md point at files (and headings) that exist."""

from __future__ import annotations

import pytest
from markdown_links import anchors, broken_links, relative_links

from mext_testing import ROOT

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_the_pages_exist_and_link_to_each_other():
    assert (ROOT / "docs" / "README.md") in PAGES
    readme_targets = {path for path, _ in relative_links(ROOT / "README.md")}
    for page in PAGES[1:]:
        assert page in readme_targets, f"README.md does not link {page.relative_to(ROOT)}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    assert relative_links(page) or page.name != "README.md", "no links found: the pattern is broken"
    assert broken_links(page, ROOT) == []


def test_anchor_rule_matches_github():
    page = ROOT / "docs" / "running.md"
    assert "slurm-and-the-job-scripts-in-examples" in anchors(page)
    assert "bad-input" in anchors(page)
