#!/usr/bin/env bash
# Installs infra/podman/criu-action-script at /usr/local/lib/belayer/criu-action-script,
# the path infra/podman/criu.conf names: the same on every sandbox host, whatever the
# checkout's path, since a checkpoint made on one host restores on another. Without it a
# sandbox cannot be restored (the script says why). Idempotent; needs root.
set -euo pipefail
exec </dev/null
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
SRC="$ROOT/infra/podman/criu-action-script"
DEST=$(sed -n 's/^action-script //p' "$ROOT/infra/podman/criu.conf")
log() { printf '[criu-action-script] %s\n' "$*"; }
[ "$(id -u)" -eq 0 ] || { log "ERROR: run as root (it installs under /usr/local)" >&2; exit 1; }
[ -n "$DEST" ] || { log "ERROR: infra/podman/criu.conf names no action-script" >&2; exit 1; }
if cmp -s "$SRC" "$DEST"; then
  log "already installed: $DEST"
else
  install -D -m 0755 "$SRC" "$DEST"
  log "installed $DEST"
fi
