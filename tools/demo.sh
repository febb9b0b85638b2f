#!/usr/bin/env bash
# The main job: sets everything up, then dumps and loads a few hundred MiB of
# KV blocks through the Python store API on a local directory and prints GB/s.
# Extra arguments go to `python -m ucm.demo` (see --help).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$ROOT/tools/setup.sh"
cd "$ROOT"
exec "$ROOT/.venv/bin/python" -m ucm.demo "$@"
