#!/usr/bin/env bash
# Installs everything Belayer needs on a fresh machine of this kind (idempotent):
# the Python environment with the pinned Temporal and SeaweedFS binaries, the sandbox
# runtime (podman + runc + CRIU + base image), the rollout engine (vLLM on CPU), the
# project-built tiny model and its two warm starts (tiny-warm and tiny-agent, ~2 min of
# fine-tuning each). Heavy artefacts are cached under ~/.cache/belayer keyed by version,
# so a second run takes seconds.
set -euo pipefail
exec </dev/null
HERE="$(cd "$(dirname "$0")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
step() {
  local start=$SECONDS
  echo "==> $*"
  "$@"
  echo "<== $(basename "${2:-$1}") ($((SECONDS - start)) s)"
}
step bash "$HERE/venv.sh"
step bash "$HERE/sandbox-runtime.sh"
step bash "$HERE/vllm.sh"
step "$ROOT/.venv/bin/belayer" model build --size tiny
step "$ROOT/.venv/bin/belayer" model build --size tiny-warm
step "$ROOT/.venv/bin/belayer" model build --size tiny-agent
