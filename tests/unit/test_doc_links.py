"""Every relative link in README.md and docs/*.md resolves: to a file of the repository and, for
a link with a #fragment into a Markdown file, to one of its headings (GitHub's anchors). Every
file under docs/perf/ is linked from those pages, so no measurement is left unexplained."""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PERF = ROOT / "docs" / "perf"

LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)
CODE_SPAN = re.compile(r"`[^`\n]*`")


def _links(text: str) -> list[str]:
    text = CODE_SPAN.sub("", FENCE.sub("", text))
    return [match.group(1) for match in LINK.finditer(text)]


def _anchors(path: Path) -> set[str]:
    """GitHub's heading ids: lower case, punctuation dropped, spaces to '-', repeats numbered."""
    seen: dict[str, int] = {}
    anchors = set()
    text = FENCE.sub("", path.read_text(encoding="utf-8"))
    for heading in re.findall(r"^#{1,6}\s+(.*?)\s*#*\s*$", text, re.M):
        heading = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text only
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def _relative(target: str) -> bool:
    return not re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I)


def _broken(page: Path) -> list[str]:
    broken = []
    for target in _links(page.read_text(encoding="utf-8")):
        if not _relative(target):
            continue
        path_part, _, fragment = target.partition("#")
        path = (page.parent / unquote(path_part)).resolve() if path_part else page
        if not path.is_file():
            broken.append(f"{target}: no such file")
        elif fragment and path.suffix == ".md" and unquote(fragment).lower() not in _anchors(path):
            broken.append(f"{target}: no heading #{fragment}")
    return broken


def test_every_relative_link_of_the_readme_and_the_docs_resolves() -> None:
    broken = {page.relative_to(ROOT).as_posix(): _broken(page) for page in PAGES}
    assert {page: links for page, links in broken.items() if links} == {}


def test_every_file_under_docs_perf_is_linked_from_the_docs() -> None:
    linked = set()
    for page in PAGES:
        for target in _links(page.read_text(encoding="utf-8")):
            if _relative(target) and target.partition("#")[0]:
                linked.add((page.parent / unquote(target.partition("#")[0])).resolve())
    unlinked = sorted(p.name for p in PERF.iterdir() if p.is_file() and p.resolve() not in linked)
    assert unlinked == []


def test_links_and_anchors_are_read_as_github_reads_them(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "# KV-cache formats: what `--kv-dtype` costs\n## Results\n## Results\n"
        "```bash\n# not a heading, [not](a-link.md)\n```\n"
        "[a](page.md#results-1) ![b](missing.png) `[c](d.md)` [e](https://example.com) [f](#nowhere)\n",
        encoding="utf-8",
    )
    assert _anchors(page) == {"kv-cache-formats-what---kv-dtype-costs", "results", "results-1"}
    assert _links(page.read_text(encoding="utf-8")) == ["page.md#results-1", "missing.png", "https://example.com", "#nowhere"]
    assert _broken(page) == ["missing.png: no such file", "#nowhere: no heading #nowhere"]
