#!/usr/bin/env bash
# Creates or reuses the virtual environment in .venv, installs the Python
# requirements and builds the native extension in release mode.
# Idempotent: each step is skipped when its inputs did not change.
#
# Usage: source tools/setup.sh   (or run it; it exports nothing you need)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VENV="$ROOT/.venv"
STAMPS="$ROOT/.stamps"
PYTHON_BIN="${PYTHON:-python3.11}"
command -v "$PYTHON_BIN" >/dev/null 2>&1 || PYTHON_BIN=python3
mkdir -p "$STAMPS"

log() { printf '[setup] %s\n' "$*" >&2; }

hash_of() { cat "$@" 2>/dev/null | sha256sum | cut -d' ' -f1; }

if [ ! -x "$VENV/bin/python" ]; then
    log "creating virtual environment in .venv ($PYTHON_BIN)"
    "$PYTHON_BIN" -m venv "$VENV"
fi

req_hash="$(hash_of requirements-dev.txt)"
if [ "$(cat "$STAMPS/requirements" 2>/dev/null)" != "$req_hash" ]; then
    log "installing Python requirements (first run downloads torch, a few minutes)"
    "$VENV/bin/pip" install -q -r requirements-dev.txt
    echo "$req_hash" > "$STAMPS/requirements"
fi

# Rebuild the extension only when Rust sources or build files changed.
src_hash="$( (find rust -type f \( -name '*.rs' -o -name 'Cargo.toml' \) -print0 | sort -z | xargs -0 cat; cat Cargo.toml Cargo.lock pyproject.toml) 2>/dev/null | sha256sum | cut -d' ' -f1)"
if [ "$(cat "$STAMPS/native" 2>/dev/null)" != "$src_hash" ] \
    || ! "$VENV/bin/python" -c 'import ucm._native' >/dev/null 2>&1; then
    log "building the native extension (release)"
    (
        # shellcheck disable=SC1091
        source "$VENV/bin/activate"
        maturin develop --release -q
    )
    echo "$src_hash" > "$STAMPS/native"
fi
