#!/usr/bin/env bash
# Makes the sandbox runtime work on this host, idempotently: podman + runc + iptables +
# debootstrap (podman.sh), CRIU >= $CRIU_MIN_VERSION at ~/.cache/belayer/bin/criu
# (criu.sh) and the action script its sandboxes' restores run (criu-action-script.sh),
# the base image localhost/belayer-base:v$BASE_IMAGE_VERSION in Belayer's podman storage
# (base-image.sh) and the trusted toolchain every sandbox runs Belayer's own programs
# from (toolchain.sh). This is what CI and `make install` call.
# Run as root. Heavy artefacts are cached under $BELAYER_CACHE_DIR (~/.cache/belayer)
# keyed by version; a second run changes nothing and takes about a second.
set -euo pipefail
exec </dev/null
HERE="$(cd "$(dirname "$0")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"

if [ "$(id -u)" -ne 0 ]; then
  echo "[sandbox-runtime] ERROR: run as root: apt-get, debootstrap, rootful podman and CRIU (checkpoint/restore) need it." >&2
  exit 1
fi

now() { date +%s%N; }
total0=$(now)
timings=()
for step in podman criu criu-action-script base-image toolchain; do
  t=$(now)
  bash "$HERE/$step.sh"
  timings+=("$step $(( ($(now) - t) / 1000000 ))ms")
done

echo "[sandbox-runtime] timings: ${timings[*]}; total $(( ($(now) - total0) / 1000000 ))ms"
python3 "$ROOT/belayer/sandbox/runtime.py" check
