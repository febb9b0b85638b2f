#!/usr/bin/env bash
# Sets everything up and runs every check: Rust format, clippy, docs and tests,
# ruff, the docs site, and pytest. Fails if any of them fails.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$ROOT/tools/setup.sh"
cd "$ROOT"
export PATH="$ROOT/.venv/bin:$PATH"

# Each step prints the seconds since this script started (setup included),
# so a slow CI run shows where its time went.
step() { printf '\n=== [%ss] %s\n' "$SECONDS" "$*" >&2; }

# Disk is the resource CI machines run short of; say how much there is.
step "disk"
df -h "$ROOT" "${TMPDIR:-/tmp}" >&2 || true

step "cargo fmt --check"
cargo fmt --all -- --check
# Every target and feature (the benchmarks' measurement baselines too), then
# the libraries as wheels build them (without the `bench` feature).
step "cargo clippy --all-targets --all-features -- -D warnings"
cargo clippy --workspace --all-targets --all-features -q -- -D warnings
step "cargo clippy (default features) -- -D warnings"
cargo clippy --workspace -q -- -D warnings
# Docs that name a moved or renamed item fail here, not in a reader's hands.
step "cargo doc (broken intra-doc links fail)"
RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps -q
step "cargo test"
cargo test --workspace --release -q
step "ruff check"
ruff check python benches tools
ruff format --check python benches tools
# Not -q (nor -v): mkdocs 1.6 then stops counting the warnings that --strict
# turns into a failure, and a broken link would pass.
step "docs site (mkdocs build --strict: broken links fail)"
mkdocs build --strict --site-dir "$(mktemp -d)"
# Two processes (pytest-xdist), a test file each at a time: most of an
# end-to-end test is one thread (starting an engine, importing vLLM), so two
# of them share two cores well. Per file, so that a module's engines and
# servers start once. Arguments go to pytest: `-n 0` runs every test in
# one process, `-k NAME` picks tests.
step "pytest"
python -m pytest -q -n 2 --dist loadfile --durations=30 python/tests "$@"
step "done"
