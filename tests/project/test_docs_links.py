"""The README and docs/ hold together: every link stays in the repository and resolves (file and
heading), every docs page is reachable from the README, the README stays a front door, and CI runs
exactly the README's test command.

Pure standard library and fast: it reads Markdown files and nothing else.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
README_MAX_LINES = 320

FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
# [text](target) and ![alt](target); the target may be <bracketed> and may carry a "title".
INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*(<[^<>\n]*>|[^\s()]*(?:\([^\s()]*\)[^\s()]*)*)"
                         r"(?:\s+(?:\"[^\"]*\"|'[^']*'|\([^)]*\)))?\s*\)")
REFERENCE_DEFINITION = re.compile(r"^ {0,3}\[[^\]]+\]:\s*(<[^<>]*>|\S+)", re.MULTILINE)
# <target>: an autolink (<https://...>, <mailto:...>) or a bare path written the same way
# (<docs/page.md>); HTML tags such as <br> or </think> have no '.', '/' or ':' before their
# end, or start with '/'.
ANGLE_LINK = re.compile(r"<([^\s<>/!][^\s<>]*[./:][^\s<>]*)>")
HTML_LINK = re.compile(r"""<[a-zA-Z][^<>]*?\s(?:href|src)\s*=\s*["']([^"']*)["']""", re.IGNORECASE)
BARE_URL = re.compile(r"(?<![\w/])(?:https?://|www\.)[^\s<>)]+", re.IGNORECASE)
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")
# a code span may wrap lines but not cross a blank line (a stray backtick must not
# hide the links after it)
INLINE_CODE = re.compile(r"(`+)((?:(?!\n[ \t]*\n).)+?)\1", re.DOTALL)


def markdown_files() -> list[Path]:
    return [README, *sorted(DOCS.rglob("*.md"))]


def prose(text: str) -> str:
    """The text with fenced code blocks and inline code spans blanked (line numbers kept): links
    in code are not links."""
    lines, fence = [], None
    for line in text.split("\n"):
        opened = FENCE.match(line)
        if fence is None and opened:
            fence = opened.group(1)[0] * len(opened.group(1))
            lines.append("")
        elif fence is not None:
            if line.strip().startswith(fence) and set(line.strip()) == {fence[0]}:
                fence = None
            lines.append("")
        else:
            lines.append(line)
    return INLINE_CODE.sub(blank, "\n".join(lines))


def blank(match: re.Match) -> str:
    """The matched text as spaces, its newlines kept, so that line numbers stay right."""
    return re.sub(r"[^\n]", " ", match.group(0))


def links(path: Path) -> list[tuple[int, str]]:
    """Every link target in a Markdown file with its line number: inline links and images,
    reference definitions, <angle> links, href and src of HTML tags, and bare URLs (which
    GitHub turns into links)."""
    text = prose(path.read_text(encoding="utf-8"))
    found = []
    for pattern in (INLINE_LINK, REFERENCE_DEFINITION, ANGLE_LINK, HTML_LINK):
        for match in pattern.finditer(text):
            target = match.group(1).strip()
            if target.startswith("<") and target.endswith(">"):
                target = target[1:-1]
            found.append((text.count("\n", 0, match.start()) + 1, target))
    without_links = INLINE_LINK.sub(blank, ANGLE_LINK.sub(blank, HTML_LINK.sub(blank, text)))
    for match in BARE_URL.finditer(without_links):
        found.append((without_links.count("\n", 0, match.start()) + 1, match.group(0)))
    return found


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup dropped, lowercase, punctuation other than '-' and '_'
    removed, spaces turned into '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading counts by its text
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The heading anchors of a Markdown file, with GitHub's -1, -2 ... suffixes
    for repeated headings."""
    seen: dict[str, int] = {}
    found = set()
    lines = prose_keeping_code_spans(path.read_text(encoding="utf-8"))
    for line in lines:
        match = re.match(r"^ {0,3}#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not match:
            continue
        base = slug(match.group(1))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def prose_keeping_code_spans(text: str) -> list[str]:
    """The lines outside fenced code blocks (a '# comment' in a shell block is no heading); inline
    code is kept, since a heading's code span counts for its anchor."""
    kept, fence = [], None
    for line in text.split("\n"):
        opened = FENCE.match(line)
        if fence is None and opened:
            fence = opened.group(1)[0] * len(opened.group(1))
        elif fence is not None:
            if line.strip().startswith(fence) and set(line.strip()) == {fence[0]}:
                fence = None
        else:
            kept.append(line)
    return kept


def problem(source: Path, target: str, root: Path = ROOT) -> str | None:
    """Why a link target from ``source`` is broken, or None when it resolves inside
    ``root`` (the repository)."""
    if not target:
        return "an empty link"
    mail = "@" in target and "/" not in target
    if SCHEME.match(target) or target.lower().startswith("www.") or target.startswith("//") or mail:
        return "a link that leaves the repository (name the project instead of linking it)"
    path_part, _, fragment = target.partition("#")
    resolved = (source.parent / path_part).resolve() if path_part else source
    if path_part.startswith("/"):
        return "an absolute path (write it relative to the linking file)"
    if not resolved.is_relative_to(root):
        return f"a path outside the repository ({resolved})"
    if not resolved.exists():
        return f"{path_part} does not exist"
    if fragment:
        if resolved.suffix != ".md" or not resolved.is_file():
            return f"#{fragment} points into {path_part}, which is not a Markdown file"
        if fragment not in anchors(resolved):
            return f"no heading #{fragment} in {resolved.relative_to(root)}"
    return None


def test_every_link_stays_in_the_repository_and_resolves():
    broken = []
    for path in markdown_files():
        for line, target in links(path):
            why = problem(path, target)
            if why:
                broken.append(f"{path.relative_to(ROOT)}:{line}: ({target}) {why}")
    assert not broken, "\n".join(broken)


def test_the_link_checker_sees_links_and_catches_broken_ones(tmp_path):
    """The checks above would pass vacuously if links were not found: a page with one
    link of each kind, broken."""
    page = tmp_path / "page.md"
    page.write_text("# A page\n\n[ok](#a-page) [gone](missing.md) [web](https://example.org) "
                    "<docs/x.md>\n[bad anchor](#nowhere)\n\n[ref]: "
                    "../../outside.md\n\n```bash\n[in "
                    "code](not-a-link.md)\n```\n`[inline](not-a-link.md)` and "
                    "http://example.org/bare <img src=\"pic.png\">\n", encoding="utf-8")
    targets = [target for _, target in links(page)]
    assert sorted(targets) == sorted(["#a-page", "missing.md", "https://example.org", "docs/x.md", "#nowhere",
                                      "../../outside.md", "http://example.org/bare", "pic.png"])
    assert problem(page, "#a-page", root=tmp_path) is None
    assert "does not exist" in problem(page, "missing.md", root=tmp_path)
    assert "leaves the repository" in problem(page, "https://example.org", root=tmp_path)
    assert "leaves the repository" in problem(page, "mailto:someone@example.org", root=tmp_path)
    assert "no heading" in problem(page, "#nowhere", root=tmp_path)
    assert "outside the repository" in problem(page, "../../outside.md", root=tmp_path)
    assert "outside the repository" in problem(README, "../shared/ARCHITECTURE.md")
    assert slug("`slm-align train --algo dpo|kto` (preference optimisation)") == (
        "slm-align-train---algo-dpokto-preference-optimisation")


def test_every_docs_page_is_reachable_from_the_readme():
    reached, queue = {README.resolve()}, [README.resolve()]
    while queue:
        page = queue.pop()
        for _, target in links(page):
            path_part = target.partition("#")[0]
            if not path_part or SCHEME.match(target):
                continue
            linked = (page.parent / path_part).resolve()
            if linked.suffix == ".md" and linked.is_file() and linked not in reached:
                reached.add(linked)
                queue.append(linked)
    unreached = [str(p.relative_to(ROOT)) for p in sorted(DOCS.rglob("*.md")) if p.resolve() not in reached]
    assert not unreached, f"docs pages no link leads to from README.md: {unreached}"


def test_the_docs_index_lists_every_page():
    index = DOCS / "README.md"
    listed = {(index.parent / t.partition("#")[0]).resolve() for _, t in links(index) if t.partition("#")[0]}
    missing = [str(p.relative_to(ROOT)) for p in sorted(DOCS.rglob("*.md")) if p != index and p.resolve() not in listed]
    assert not missing, f"docs/README.md does not list: {missing}"


def test_the_readme_is_a_front_door():
    lines = README.read_text(encoding="utf-8").count("\n")
    assert lines < README_MAX_LINES, f"README.md has {lines} lines; move reference material into docs/"


def test_ci_runs_exactly_the_readmes_test_command():
    ci = ROOT / ".ci" / "run"
    if not ci.is_file():
        pytest.skip(".ci/run is not in this checkout")
    command = [line for line in ci.read_text(encoding="utf-8").splitlines() if line.strip()][-1]
    assert command in README.read_text(encoding="utf-8").splitlines(), (
        f".ci/run's command is not a line of README.md:\n{command}")
