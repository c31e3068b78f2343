#!/usr/bin/env bash
# Starts one Belayer component of a deployment; configuration comes from BELAYER_*
# variables only (belayer/config.py), as everywhere else.
#
#   entrypoint.sh sandbox-host        this machine's sandbox worker (privileged: podman + CRIU)
#   entrypoint.sh rollout-node        a rollout node (memory owner, engines, node supervisor)
#   entrypoint.sh trajectory-worker   the workflows and their context activities
#   entrypoint.sh trainer-worker      the trainer
#   entrypoint.sh endpoint            the OpenAI-compatible endpoint over agent sessions (belayer serve)
#   entrypoint.sh prepare             search attributes and bucket (`belayer prepare`), then exit
#   entrypoint.sh belayer ARGS...     any other belayer command
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
PY="$ROOT/.venv/bin/python"
BELAYER="$ROOT/.venv/bin/belayer"

usage() { sed -n '2,11p' "$0" | sed 's/^# \{0,1\}//'; }

# The project-built model the rollout node serves; trajectory workers read its tokenizer
# and trainers its weights. Deterministic and cached in BELAYER_CACHE_DIR, so every pod
# that builds it gets the same bytes.
built_model() {
  local size; size=$("$BELAYER" config show --json | "$PY" -c 'import json,sys; print(json.load(sys.stdin)["rollout"]["model"])')
  "$BELAYER" model build --size "$size"  # a warm start builds its base first
}

role="${1:---help}"
shift || true
case "$role" in
  sandbox-host)
    # Every sandbox host imports the same base-image tarball (same image id), which a
    # restore on another host requires; then the runtime is checked before serving.
    bash "$ROOT/infra/install/base-image.sh"
    bash "$ROOT/infra/install/toolchain.sh"
    "$PY" "$ROOT/belayer/sandbox/runtime.py" check
    exec "$PY" -m belayer.workers.sandbox "$@" ;;
  rollout-node) built_model; exec "$PY" -m belayer.workers.rollout "$@" ;;
  trajectory-worker) built_model; exec "$PY" -m belayer.workers.trajectory "$@" ;;
  trainer-worker) built_model; exec "$PY" -m belayer.workers.trainer "$@" ;;
  endpoint) built_model; exec "$BELAYER" serve --host 0.0.0.0 --port 8400 "$@" ;;  # its tokenizer
  prepare) exec "$BELAYER" prepare "$@" ;;
  belayer) exec "$BELAYER" "$@" ;;
  -h|--help) usage ;;
  *) echo "entrypoint.sh: unknown role '$role'" >&2; usage >&2; exit 2 ;;
esac
