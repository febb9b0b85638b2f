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


CONFIGS = README.parent / "configs"


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
