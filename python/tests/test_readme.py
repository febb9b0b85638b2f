"""The README's Python examples run as they stand (the user-method example
needs a vLLM engine: ``e2e/test_sparse_vllm.py::test_readme_user_method``)."""

from __future__ import annotations

from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"


def python_blocks() -> list[str]:
    return [b.split("```", 1)[0] for b in README.read_text().split("```python\n")[1:]]


def test_store_example(tmp_path: Path) -> None:
    (block,) = [b for b in python_blocks() if 'create_connector("UcmPipelineStore"' in b]
    assert '"/data/kvcache"' in block
    code = block.replace('"/data/kvcache"', repr(str(tmp_path)))
    namespace: dict = {}
    exec(compile(code, str(README), "exec"), namespace)  # its asserts are the test
    namespace["store"].close()
