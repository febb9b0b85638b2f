"""The design document's connector YAML, for the tests that start from it."""

from __future__ import annotations

from pathlib import Path

#: The design document's connector YAML, verbatim but for the directory.
SEED_YAML = """\
ucm_connectors:
  - ucm_connector_name: "UcmPipelineStore"
    ucm_connector_config:
      store_pipeline: "Cache|Posix"
      storage_backends: "{store}"
      buffer_number: 2048
ucm_sparse_config:
  ESA:
    sparse_ratio: 0.3
    local_window_sz: 2
    retrieval_stride: 5
metrics_config_path: "./metrics_config.yaml"
load_only_first_rank: false
use_layerwise: true
"""


def seed_config(tmp_path: Path, metrics: bool = True) -> Path:
    path = tmp_path / "ucm.yaml"
    path.write_text(SEED_YAML.format(store=tmp_path / "ucm_cache"))
    if metrics:
        (tmp_path / "metrics_config.yaml").write_text("enabled: true\n")
    return path
