#!/usr/bin/env bash
# Builds Belayer's trusted toolchain for this checkout, idempotently: the base rootfs's
# python3, its standard library (byte-compiled), the shared libraries it needs and its
# dynamic loader, plus infra/sandbox/supervisor.py and its drop_caps_exec.py, in
# $BELAYER_CACHE_DIR/toolchain/<content hash> (~/.cache/belayer). Every sandbox mounts it
# read-only at /.belayer, and PID 1, the action helper and the workspace hash run from it,
# never from the image's own python3 (belayer/sandbox/toolchain.py says why and how).
# Run after base-image.sh (it reads the rootfs tarball that script caches, or exports the
# imported image when the tarball is gone). Run as root; a second run takes well under a
# second.
set -euo pipefail
exec </dev/null
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"

[ "$(id -u)" -eq 0 ] || { echo "[toolchain] ERROR: run as root (the toolchain is root-owned; podman)" >&2; exit 1; }
PYTHON=$(command -v python3 || true)
[ -n "$PYTHON" ] || { echo "[toolchain] ERROR: python3 is needed to run belayer/sandbox/toolchain.py" >&2; exit 1; }
mkdir -p "${BELAYER_CACHE_DIR:-$HOME/.cache/belayer}"
exec 9>"${BELAYER_CACHE_DIR:-$HOME/.cache/belayer}/.toolchain.lock"
flock 9
cd "$ROOT"
"$PYTHON" -m belayer.sandbox.toolchain build
