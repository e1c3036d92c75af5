"""The documentation's links: every relative link in README.md, docs/ and data/README.md names
a file of the repository, and an #anchor into a Markdown file names one of its headings (as
GitHub spells them)."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", REPO / "data" / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def anchors(page: Path) -> set[str]:
    """GitHub's heading ids: lower case, punctuation dropped, spaces to hyphens."""
    out = set()
    for line in page.read_text().splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            out.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return out


def broken(page: Path, root: Path = REPO) -> list[str]:
    """The page's relative links that name no file, or no heading of a Markdown file."""
    found = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target):  # https:, mailto:: not checked offline
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            found.append(f"{page.relative_to(root)}: {target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            found.append(f"{page.relative_to(root)}: {target} (no such heading)")
    return found


def test_relative_links_resolve():
    assert [p for p in PAGES if not p.is_file()] == []
    assert [b for page in PAGES for b in broken(page)] == []


def test_the_checker_sees_broken_links(tmp_path):
    (tmp_path / "a.md").write_text("# Top part\n\n## The (v2) fields\n")
    page = tmp_path / "b.md"
    page.write_text(
        "[ok](a.md) [ok](a.md#top-part) [ok](a.md#the-v2-fields) [web](https://x.org/y)\n"
        "[gone](missing.md) [bad](a.md#nope)\n"
    )
    assert broken(page, tmp_path) == [
        "b.md: missing.md (no such file)",
        "b.md: a.md#nope (no such heading)",
    ]
