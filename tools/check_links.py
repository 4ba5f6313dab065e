"""Check that every relative link in the Markdown docs resolves: the file exists, and a ``#anchor``
names a heading (or an ``id=``) of the target page.

    python tools/check_links.py            # README.md, docs/*.md, accelerate_configs/, benchmarks/ READMEs
    python tools/check_links.py FILE.md    # just these

Exit 1 with one line per broken link. Links to the web (``https://...``) are not fetched.
Anchors follow GitHub's rule: the heading text lower-cased, punctuation dropped, spaces to ``-``,
``-1``, ``-2``, ... for repeats.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PAGES = ("README.md", "docs/*.md", "accelerate_configs/README.md", "benchmarks/README.md")

_FENCE = re.compile(r"^\s*(```|~~~)")
_HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$")
_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_CODE_SPAN = re.compile(r"`[^`]*`")
_HTML_ID = re.compile(r"""\b(?:id|name)=["']([^"']+)["']""")


def pages() -> list[Path]:
    return sorted({p for pattern in PAGES for p in REPO.glob(pattern)})


def _prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks."""
    out, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if _FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            out.append((number, line))
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text.

        >>> slug("The device loader (`--loader device`)")
        'the-device-loader---loader-device'
    """
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading anchors on its text
    text = re.sub(r"[^\w\- ]", "", text.lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    found: set[str] = set()
    seen: dict[str, int] = {}
    for _, line in _prose_lines(path.read_text(encoding="utf-8")):
        found.update(_HTML_ID.findall(line))
        match = _HEADING.match(line)
        if match:
            base = slug(match.group(1))
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
    return found


def _shown(path: Path) -> str:
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


def broken_links(path: Path) -> list[str]:
    """One message per link in ``path`` that does not resolve."""
    problems = []
    for number, line in _prose_lines(path.read_text(encoding="utf-8")):
        for target in _LINK.findall(_CODE_SPAN.sub("", line)):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # https:, mailto:, ...
                continue
            file_part, _, anchor = target.partition("#")
            dest = (path.parent / file_part).resolve() if file_part else path
            where = f"{_shown(path)}:{number}: {target}"
            if not dest.exists():
                problems.append(f"{where}: no such file or folder")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                problems.append(f"{where}: no heading with anchor #{anchor} in {_shown(dest)}")
    return problems


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    files = [Path(a).resolve() for a in argv] or pages()
    problems = [p for f in files for p in broken_links(f)]
    for problem in problems:
        print(problem, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
