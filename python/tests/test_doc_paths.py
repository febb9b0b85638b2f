"""Every repository path that ``docs/architecture.md`` and the Layout table
of ``docs/layout.md`` name exists, and every relative link of README.md
leads to a file, so none of them can drift from the tree (links between the
docs site's pages are ``mkdocs build --strict``'s: ``test_docs_site.py``).

What counts as a path:

* in the architecture doc, a code span (or a word of the diagram) with a
  ``/`` or a file extension, and a dotted ``ucm.*`` module name. A path
  relative to a folder the text is about (``store/registry.rs``,
  ``scheduler.py``) is found when some path of the repository ends with it;
  a ``<placeholder>`` and what follows it are not checked;
* in the Layout table, the first column exactly, from the
  repository root, and each code span of the second column: a path-like one
  as above, a bare module name (``scheduler``, ``hashing``) as a file or
  folder of that name under the row's path.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ARCHITECTURE = REPO / "docs" / "architecture.md"
LAYOUT = REPO / "docs" / "layout.md"
README = REPO / "README.md"

EXTENSIONS = (".py", ".rs", ".toml", ".md", ".yaml", ".yml", ".json", ".sh", ".txt", ".lock")
#: Folders that are built, cached or another repository's, never named by the docs.
PRUNED = {"target", "__pycache__", "dist", "node_modules"}
#: Code spans in the Layout table that look like module names but are not paths.
NOT_PATHS = {"kv_transfer_params": "a request field"}
#: Modules that exist only once built, not in a checkout.
BUILT_MODULES = {"ucm._native"}

CODE_SPAN = re.compile(r"`([^`\n]+)`")
DIAGRAM_WORD = re.compile(r"[\w<>][\w./<>-]*(?:\.(?:py|rs|toml|md|yaml)\b|/)")
MODULE = re.compile(r"ucm(?:\.[a-z_][a-z0-9_]*)+")
BARE_NAME = re.compile(r"[a-z][a-z0-9_]*")
#: A Markdown link or image: ``[text](target)``.
LINK = re.compile(r"!?\[[^\]\n]*\]\(([^)\s]+)\)")


def repo_paths(root: Path = REPO) -> set[str]:
    """Every file and folder of the checkout, relative and with ``/``
    (hidden and built folders left out)."""
    out: set[str] = set()
    for parent, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in PRUNED]
        rel = Path(parent).relative_to(root)
        for name in [*dirs, *files]:
            out.add((rel / name).as_posix())
    return out


def path_like(span: str) -> bool:
    return (
        not any(c.isspace() for c in span)
        and "://" not in span
        and ("/" in span or span.endswith(EXTENSIONS))
    )


def checked_part(path: str) -> str:
    """The part of a named path to check: up to a ``<placeholder>``, without a
    trailing ``/``."""
    return path.split("<", 1)[0].rstrip("/")


def found(path: str, paths: set[str], under: str = "") -> bool:
    """Whether ``path`` is in the repository, from ``under`` (the root if
    empty) or as the tail of some path below it (a path relative to a folder
    the text is about)."""
    path = checked_part(path)
    if not path:
        return True
    prefix = f"{under}/" if under else ""
    return any(
        p.startswith(prefix) and (p == prefix + path or p.endswith(f"/{path}")) for p in paths
    )


def module_found(module: str, paths: set[str]) -> bool:
    rel = "python/" + module.replace(".", "/")
    return f"{rel}.py" in paths or f"{rel}/__init__.py" in paths


def named_module_found(name: str, under: str, paths: set[str]) -> bool:
    """A bare module name of a Layout row: a file (any extension) or folder
    of that name somewhere under the row's path."""
    return any(p.startswith(f"{under}/") and Path(p).stem == name for p in paths)


def architecture_paths(text: str) -> list[str]:
    """The paths and ``ucm.*`` modules the architecture doc names."""
    names: list[str] = []
    for block_index, block in enumerate(text.split("```")):
        if block_index % 2:  # a fenced block: the diagram
            names += DIAGRAM_WORD.findall(block)
        else:
            names += [s for s in CODE_SPAN.findall(block) if path_like(s) or MODULE.fullmatch(s)]
    return list(dict.fromkeys(names))


def missing_in_architecture(text: str, paths: set[str]) -> list[str]:
    missing = []
    for name in architecture_paths(text):
        if MODULE.fullmatch(name):
            if name not in BUILT_MODULES and not module_found(name, paths):
                missing.append(f"{name} (module)")
        elif not found(name, paths):
            missing.append(name)
    return missing


@dataclass(frozen=True)
class LayoutRow:
    path: str
    names: list[str]


def layout_rows(doc: str) -> list[LayoutRow]:
    """The rows of the Layout table: the path and the code spans of its
    description."""
    section = doc.split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 2 or not cells[0].startswith("`"):
            continue
        rows.append(LayoutRow(cells[0].strip("`"), CODE_SPAN.findall("|".join(cells[1:]))))
    return rows


def missing_in_layout(doc: str, paths: set[str]) -> list[str]:
    missing = []
    for row in layout_rows(doc):
        if row.path not in paths:
            missing.append(f"{row.path} (Layout row)")
            continue
        for name in row.names:
            if name in NOT_PATHS:
                continue
            if path_like(name):
                ok = found(name, paths, row.path) or found(name, paths)
            elif MODULE.fullmatch(name):
                ok = name in BUILT_MODULES or module_found(name, paths)
            elif BARE_NAME.fullmatch(name):
                ok = named_module_found(name, row.path, paths)
            else:
                continue  # a class, a command, a marker expression
            if not ok:
                missing.append(f"{name} (in the {row.path} row)")
    return missing


def test_every_path_of_the_architecture_doc_exists() -> None:
    text = ARCHITECTURE.read_text()
    names = architecture_paths(text)
    # The extraction sees the doc's paths, in prose and in the diagram.
    for expected in (
        "store/registry.rs",
        "config/keys.toml",
        "integration/vllm/sparse/bridge.py",
        "ucm.sparse",
        "saves.py",
        "esa/",
    ):
        assert expected in names, f"{expected} not read from {ARCHITECTURE.name}"
    missing = missing_in_architecture(text, repo_paths())
    assert not missing, f"{ARCHITECTURE.name} names paths that do not exist: " + ", ".join(missing)


def test_every_path_of_the_layout_exists() -> None:
    rows = layout_rows(LAYOUT.read_text())
    assert {"rust/ucm-core", "python/ucm/store", "python/tests"} <= {r.path for r in rows}
    missing = missing_in_layout(LAYOUT.read_text(), repo_paths())
    assert not missing, "docs/layout.md names paths that do not exist: " + ", ".join(missing)


def relative_links(text: str) -> list[str]:
    """The link targets of ``text`` that are files of the repository: not
    URLs, mail addresses or anchors of the same page; an anchor is cut off."""
    targets = [t.split("#", 1)[0] for t in LINK.findall(text)]
    return [t for t in targets if t and ":" not in t]


def missing_links(doc: Path) -> list[str]:
    return [t for t in relative_links(doc.read_text()) if not (doc.parent / t).is_file()]


def test_every_relative_link_of_the_readme_exists() -> None:
    links = relative_links(README.read_text())
    # The README points into the docs: its links are read.
    assert "docs/config-reference.md" in links and "docs/user-guide/vllm.md" in links
    missing = missing_links(README)
    assert not missing, "README.md links to files that do not exist: " + ", ".join(missing)


def test_the_link_check_reports_a_missing_file(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "here.md").write_text("# here\n")
    doc = tmp_path / "README.md"
    doc.write_text(
        "[a](docs/here.md) [b](docs/here.md#top) [c](docs/gone.md) [d](#local) "
        "[e](https://example.com/x.md) ![f](docs/img.png)\n"
    )
    assert missing_links(doc) == ["docs/gone.md", "docs/img.png"]


def test_the_check_reports_each_missing_path() -> None:
    paths = {
        "rust",
        "rust/core",
        "rust/core/src",
        "rust/core/src/store.rs",
        "python",
        "python/ucm",
        "python/ucm/__init__.py",
        "python/ucm/io.py",
    }
    doc = (
        "```text\n  store.rs  gone.rs  src/\n```\n"
        "`core/src/store.rs`, `core/old.rs`, `rust/core/src/<name>/`, `ucm.io`, `ucm.nope`\n"
    )
    assert missing_in_architecture(doc, paths) == ["gone.rs", "core/old.rs", "ucm.nope (module)"]
    layout = (
        "\n## Layout\n\n| path | what |\n|---|---|\n"
        "| `rust/core` | stores (`store`, `cache`), `src/store.rs`, the `Store` trait |\n"
        "| `rust/gone` | nothing |\n\n## Next\n"
    )
    assert missing_in_layout(layout, paths) == [
        "cache (in the rust/core row)",
        "rust/gone (Layout row)",
    ]
