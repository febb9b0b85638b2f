"""The config reference's key tables are generated from the core's key
declarations; they must not drift."""

from __future__ import annotations

from pathlib import Path

from ucm.store.config_doc import BEGIN, main, replaced

ROOT = Path(__file__).resolve().parents[3]
REFERENCE = ROOT / "docs" / "config-reference.md"


def test_reference_key_tables_match_the_core() -> None:
    text = REFERENCE.read_text()
    assert replaced(text) == text, (
        "docs/config-reference.md's config key tables are stale: "
        "run `python -m ucm.store.config_doc --write docs/config-reference.md`"
    )
    assert main(["--check", str(REFERENCE)]) == 0


def test_the_tables_live_on_one_page_only() -> None:
    """The README keeps a short table of the main keys; the generated
    tables are the config reference's alone."""
    from support.docs import pages

    assert [p for p in pages() if BEGIN in p.read_text()] == [REFERENCE]


def test_check_fails_on_a_stale_table(tmp_path: Path) -> None:
    stale = tmp_path / "config-reference.md"
    stale.write_text(REFERENCE.read_text().replace("| `io_threads` |", "| `io_thread` |"))
    assert main(["--check", str(stale)]) == 1
    assert main(["--write", str(stale)]) == 0
    assert main(["--check", str(stale)]) == 0


CONFIGS = ROOT / "configs"


def test_every_shipped_config_example_is_valid() -> None:
    """The examples in ``configs/`` load and pass every key check: the
    store configs as pipelines, the connector configs as the connector
    reads them."""
    from ucm.integration.vllm.config import CONFIG_FILE_KEY, resolve_config
    from ucm.store import PipelineStoreConfig

    stores = sorted(CONFIGS.glob("store-*.yaml"))
    engines = sorted(CONFIGS.glob("ucm-vllm*.yaml"))
    assert stores and engines
    for path in stores:
        cfg = PipelineStoreConfig.from_yaml(path)
        assert cfg.stages, path
    for path in engines:
        resolve_config({CONFIG_FILE_KEY: str(path)}, env={})
