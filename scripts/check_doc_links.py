"""Check that every relative Markdown link, and its #anchor, in the docs resolves.

Usage: ``python scripts/check_doc_links.py [FILE.md ...]`` (default: README.md, CONTRIBUTING.md
and every page under docs/). Prints each broken link and exits 1 if there is one. Links inside
fenced code blocks and absolute URLs are not checked; anchors follow GitHub's heading slugs.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def anchors(page: Path) -> set[str]:
    """GitHub's anchor slugs of the page's headings."""
    slugs = set()
    for line in page.read_text().splitlines():
        heading = re.match(r"^#+\s+(.*)", line)
        if heading:
            text = heading.group(1).strip().lower()
            slugs.add(re.sub(r"[^\w\- ]", "", text).replace(" ", "-"))
    return slugs


def broken_links(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    broken = []
    for match in re.finditer(r"\]\(([^)\s]+)\)", text):
        link = match.group(1)
        if re.match(r"[a-z]+://", link) or link.startswith("mailto:"):
            continue
        target, _, anchor = link.partition("#")
        path = (page.parent / target).resolve() if target else page
        if not path.exists():
            broken.append(f"{page}: {link}: no such file")
        elif anchor and path.suffix == ".md" and anchor not in anchors(path):
            broken.append(f"{page}: {link}: no such heading")
    return broken


def main(argv: list[str]) -> int:
    pages = [Path(a) for a in argv] or [ROOT / "README.md", ROOT / "CONTRIBUTING.md",
                                        *sorted((ROOT / "docs").rglob("*.md"))]
    broken = [line for page in pages for line in broken_links(page)]
    print("\n".join(broken) or f"{len(pages)} pages, every relative link resolves")
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
