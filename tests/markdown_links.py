"""The relative links of a Markdown page and the anchors of its headings, as GitHub reads them.

Shared by the tests that keep the README, docs/ and bench/BENCHMARKS.md linked to files that
exist (tests/unit/test_docs_links.py, test_readme.py, bench/test_benchmarks_page.py).
"""

from __future__ import annotations

import re
from pathlib import Path

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
CODE_SPAN = re.compile(r"`[^`\n]*`")


def _text(path: Path) -> str:
    """The page without code blocks and code spans, where brackets are not links."""
    return CODE_SPAN.sub("code", FENCE.sub("", path.read_text()))


def anchors(path: Path) -> set:
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, '-' for ' '."""
    seen, found = {}, set()
    for line in FENCE.sub("", path.read_text()).splitlines():
        match = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not match:
            continue
        slug = re.sub(r"[^\w\- ]", "", match.group(1).lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def relative_links(page: Path) -> list:
    """(target path, anchor or '') of each link of ``page`` that is not a URL."""
    links = []
    for target in LINK.findall(_text(page)):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        links.append((page if not path else (page.parent / path).resolve(), anchor))
    return links


def broken_links(page: Path, root: Path) -> list:
    """One line per relative link of ``page`` whose file, or heading in a .md file, is missing."""
    broken = []
    for path, anchor in relative_links(page):
        where = f"{page.relative_to(root)} -> {path}#{anchor}"
        if not path.exists():
            broken.append(f"missing file: {where}")
        elif anchor and path.suffix == ".md" and anchor not in anchors(path):
            broken.append(f"missing heading: {where}")
    return broken
