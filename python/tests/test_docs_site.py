"""The docs site builds with ``mkdocs build --strict``: a link to a page or
an anchor that does not exist, or a page left out of the nav, fails the
build (``mkdocs.yml``'s ``validation`` makes them warnings, ``--strict``
makes warnings errors). Never with ``-q`` or ``-v``: mkdocs 1.6 then stops
counting those warnings and a broken link passes."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from support.docs import DOCS, ROOT


def build(config: Path, site: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", config, "--site-dir", site],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_site_builds_strictly(tmp_path: Path) -> None:
    r = build(ROOT / "mkdocs.yml", tmp_path / "site")
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "site" / "user-guide" / "sparse" / "index.html").is_file()


def test_the_check_script_builds_strictly_and_not_quietly() -> None:
    (line,) = [
        x
        for x in (ROOT / "tools" / "test.sh").read_text().splitlines()
        if x.startswith("mkdocs build")
    ]
    words = line.split()
    assert "--strict" in words
    assert not {"-q", "--quiet", "-v", "--verbose"} & set(words), line


def copy_of_the_site(tmp_path: Path) -> tuple[Path, Path]:
    """The config and the pages, copied where a test may break them."""
    shutil.copytree(DOCS, tmp_path / "docs")
    config = tmp_path / "mkdocs.yml"
    shutil.copy(ROOT / "mkdocs.yml", config)
    return config, tmp_path / "docs"


def test_a_broken_link_fails_the_build(tmp_path: Path) -> None:
    config, docs = copy_of_the_site(tmp_path)
    page = docs / "user-guide" / "pd.md"
    page.write_text(page.read_text() + "\nSee [the gone page](gone.md).\n")
    r = build(config, tmp_path / "site")
    assert r.returncode != 0
    assert "gone.md" in r.stderr


def test_a_broken_anchor_fails_the_build(tmp_path: Path) -> None:
    config, docs = copy_of_the_site(tmp_path)
    page = docs / "index.md"
    page.write_text(page.read_text() + "\nSee [keys](config-reference.md#no-such-part).\n")
    r = build(config, tmp_path / "site")
    assert r.returncode != 0
    assert "no-such-part" in r.stderr


def test_a_page_outside_the_nav_fails_the_build(tmp_path: Path) -> None:
    config, docs = copy_of_the_site(tmp_path)
    (docs / "orphan.md").write_text("# Orphan\n")
    r = build(config, tmp_path / "site")
    assert r.returncode != 0
    assert "orphan.md" in r.stderr
