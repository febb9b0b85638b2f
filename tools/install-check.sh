#!/usr/bin/env bash
# Builds the wheel, installs it into a new virtual environment outside the
# checkout, and runs a store round trip, `ucm serve` with a tiny model, two
# requests, a restart, `ucm store info` and `ucm store verify` from there.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$ROOT/tools/setup.sh"
exec "$ROOT/.venv/bin/python" "$ROOT/tools/install_check.py" "$@"
