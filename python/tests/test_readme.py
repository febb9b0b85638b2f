"""The README's Python examples run as they stand (the user-method example
needs a vLLM engine: ``e2e/test_sparse_vllm.py::test_readme_user_method``)."""

from __future__ import annotations

from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"


def python_blocks() -> list[str]:
    return [b.split("```", 1)[0] for b in README.read_text().split("```python\n")[1:]]


def test_store_example(tmp_path: Path) -> None:
    (block,) = [b for b in python_blocks() if "ucm.store.open(" in b]
    assert '"/data/kvcache"' in block
    code = block.replace('"/data/kvcache"', repr(str(tmp_path)))
    namespace: dict = {}
    exec(compile(code, str(README), "exec"), namespace)  # its asserts are the test
    namespace["store"].close()


def yaml_blocks() -> list[str]:
    return [b.split("```", 1)[0] for b in README.read_text().split("```yaml\n")[1:]]


def test_kept_segment_example(tmp_path: Path) -> None:
    """The connector keys that keep the Cache tier in /dev/shm after exit."""
    import textwrap

    import yaml

    from ucm.integration.vllm.config import resolve_config
    from ucm.integration.vllm.store_handle import build_store_config
    from ucm.store import UcmConnectorFactory

    (block,) = [b for b in yaml_blocks() if "share_buffer_keep" in b]
    keys = yaml.safe_load(textwrap.dedent(block))
    r = resolve_config(
        {"store_pipeline": "Cache|Posix", "storage_backends": str(tmp_path), **keys}, env={}
    )
    cfg = build_store_config(
        r.store,
        {"block_size": 8192, "shard_size": 4096, "tensor_size_list": [4096]},
        device_id=0,
    )
    cfg["cache_buffer_capacity_gb"] = 0.01
    store = UcmConnectorFactory.create_connector("UcmPipelineStore", cfg)
    segment = Path(store.describe()["shm_path"])
    try:
        store.close()
        assert segment.exists(), "not kept after its last process"
    finally:
        segment.unlink(missing_ok=True)
