"""The README's config key tables are generated from the core's key
declarations; they must not drift."""

from __future__ import annotations

from pathlib import Path

from ucm.store.config_doc import main, replaced

README = Path(__file__).resolve().parents[3] / "README.md"


def test_readme_key_tables_match_the_core() -> None:
    text = README.read_text()
    assert replaced(text) == text, (
        "README.md's config key tables are stale: "
        "run `python -m ucm.store.config_doc --write README.md`"
    )
    assert main(["--check", str(README)]) == 0


def test_check_fails_on_a_stale_table(tmp_path: Path) -> None:
    stale = tmp_path / "README.md"
    stale.write_text(README.read_text().replace("| `io_threads` |", "| `io_thread` |"))
    assert main(["--check", str(stale)]) == 1
    assert main(["--write", str(stale)]) == 0
    assert main(["--check", str(stale)]) == 0
