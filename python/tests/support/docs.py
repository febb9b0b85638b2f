"""The user documentation as the tests read it: ``README.md`` and every page
under ``docs/``. A test that runs an example finds its block on whichever
page holds it, and runs every copy, so text can move between pages (the
README's quick start repeats a few) without leaving an example untested."""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
README = ROOT / "README.md"
DOCS = ROOT / "docs"


def pages() -> list[Path]:
    """README.md, then the pages of the docs site in path order."""
    return [README, *sorted(DOCS.rglob("*.md"))]


def text() -> str:
    """Every page, one after the other."""
    return "\n".join(p.read_text() for p in pages())


@dataclass(frozen=True)
class Block:
    """A fenced code block and the page it is on."""

    page: Path
    code: str

    @property
    def name(self) -> str:
        return self.page.relative_to(ROOT).as_posix()


def blocks(lang: str, pages_: list[Path] | None = None) -> list[Block]:
    """The fenced blocks of one language (```` ```bash ````, ...), page by page."""
    out = []
    for page in pages_ if pages_ is not None else pages():
        for part in page.read_text().split(f"```{lang}\n")[1:]:
            out.append(Block(page, part.split("```", 1)[0]))
    return out


def blocks_with(lang: str, needle: str = "", starting: str = "") -> list[Block]:
    """Every block of ``lang`` that contains ``needle`` and starts with
    ``starting``; at least one, or the docs lost the example."""
    found = [b for b in blocks(lang) if needle in b.code and b.code.startswith(starting)]
    assert found, f"no {lang} block with {needle or starting!r} in README.md or docs/"
    return found


def bash_words(starting: str) -> list[list[str]]:
    """The words of every bash block that starts with ``starting``."""
    return [shlex.split(b.code, comments=True) for b in blocks_with("bash", starting=starting)]


def bash_lines(starting: str) -> list[list[str]]:
    """The words of every line of a bash block that starts with
    ``starting`` (a line that ends in ``\\`` goes on on the next)."""
    out = []
    for b in blocks("bash"):
        for line in b.code.replace("\\\n", " ").splitlines():
            if line.startswith(starting):
                out.append(shlex.split(line, comments=True))
    assert out, f"no bash line starting with {starting!r} in README.md or docs/"
    return out
