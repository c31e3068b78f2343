#!/usr/bin/env bash
# Creates .venv with Belayer and its dependencies (idempotent).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  echo "[venv] creating .venv with $($PY --version)"
  "$PY" -m venv .venv
fi
stamp=.venv/.belayer-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  echo "[venv] installing belayer and its dependencies"
  .venv/bin/pip install -q --upgrade pip
  .venv/bin/pip install -q -e '.[test]'
  touch "$stamp"
fi
# matplotlib builds its font cache (running fc-list) the first time it is imported: do it
# here, once, rather than inside the first `belayer report` or the first test that plots.
MPLBACKEND=Agg .venv/bin/python -c "import matplotlib.pyplot" 2>/dev/null || true
echo "[venv] ready: $ROOT/.venv"
