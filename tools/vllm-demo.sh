#!/usr/bin/env bash
# The main job: sets everything up (venv, vLLM CPU build, release build of the
# native module), makes a small random-weight model, starts vLLM with
# UCMConnector on its default store (Cache|Posix under .ucm-demo/vllm), sends a
# long prompt, restarts the engine, sends it again and prints cold and warm
# time to first token and the hit rate. Arguments go to
# `python -m ucm.testing.vllm_demo` (--tokens N, --layerwise, --dir DIR).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$ROOT/tools/setup.sh"
cd "$ROOT"
exec "$ROOT/.venv/bin/python" -m ucm.testing.vllm_demo "$@"
