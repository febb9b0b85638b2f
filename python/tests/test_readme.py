"""The Python and YAML examples of the README and the docs run as they stand
(the user-method example of ``docs/user-guide/sparse.md`` needs a vLLM
engine: ``e2e/test_sparse_vllm.py::test_readme_user_method``)."""

from __future__ import annotations

from pathlib import Path

from support.docs import blocks_with


def test_store_example(tmp_path: Path) -> None:
    """The README's quick start and the Python API page: every copy runs."""
    found = blocks_with("python", "ucm.store.open(")
    assert {b.name for b in found} >= {"README.md", "docs/user-guide/python-api.md"}
    for i, block in enumerate(found):
        assert '"/data/kvcache"' in block.code, block.name
        code = block.code.replace('"/data/kvcache"', repr(str(tmp_path / str(i))))
        namespace: dict = {}
        exec(compile(code, block.name, "exec"), namespace)  # its asserts are the test
        namespace["store"].close()


def test_kept_segment_example(tmp_path: Path) -> None:
    """The connector keys that keep the Cache tier in /dev/shm after exit."""
    import textwrap

    import yaml

    from ucm.integration.vllm.config import resolve_config
    from ucm.integration.vllm.store_handle import build_store_config
    from ucm.store import UcmConnectorFactory

    (block,) = blocks_with("yaml", "share_buffer_keep")
    keys = yaml.safe_load(textwrap.dedent(block.code))
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
