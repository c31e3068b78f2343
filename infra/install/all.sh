#!/usr/bin/env bash
# Installs everything Belayer needs on a fresh machine of this kind (idempotent):
# the Python environment with the pinned Temporal and SeaweedFS binaries, then the
# sandbox runtime (podman + runc + CRIU + base image). Heavy artefacts are cached
# under ~/.cache/belayer keyed by version, so a second run takes seconds.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
step() {
  local start=$SECONDS
  echo "==> $1"
  bash "$HERE/$1"
  echo "<== $1 ($((SECONDS - start)) s)"
}
step venv.sh
step sandbox-runtime.sh
