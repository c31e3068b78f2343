#!/usr/bin/env bash
# Installs the sandbox container runtime from the machine's own Debian release:
# podman + runc + iptables (NOT crun: it refuses the hybrid cgroup layout of this
# machine kind, docs/design.md §7) and debootstrap for the base image build.
#
# Idempotent: does nothing when every package is already installed.
# Non-interactive: works with CI=true and no stdin. Needs root (apt-get).
#
# --no-install-recommends keeps Debian 12's criu 3.17 (recommended by
# golang-github-containers-common) off the machine: it fails on this kernel, and
# infra/install/criu.sh provides the criu that runc is told to use.
set -euo pipefail
exec </dev/null
export DEBIAN_FRONTEND=noninteractive

log() { printf '[podman] %s\n' "$*"; }
t0=$(date +%s%N)
elapsed() { echo "$(( ($(date +%s%N) - t0) / 1000000 ))ms"; }

# What Belayer needs from the system. conmon and containernetworking-plugins come
# in as podman's hard dependencies; iproute2 gives `ip netns` (per-sandbox loopback
# namespaces) and the `ip` CRIU runs when it dumps network state; zstd unpacks a
# checkpoint archive once per host when it is forked into several sandboxes;
# golang-github-containers-common (podman pulls it in too) holds the default seccomp
# profile, /usr/share/containers/seccomp.json, that belayer/sandbox/seccomp.py narrows.
PACKAGES=(podman runc conmon golang-github-containers-common iptables iproute2 debootstrap zstd)

missing=()
for p in "${PACKAGES[@]}"; do
  status=$(dpkg-query -W -f='${db:Status-Status}' "$p" 2>/dev/null || true)
  [ "$status" = "installed" ] || missing+=("$p")
done

if [ "${#missing[@]}" -eq 0 ]; then
  log "already installed: ${PACKAGES[*]} (podman $(podman --version | awk '{print $3}'), runc $(runc --version | awk 'NR==1{print $3}')) [$(elapsed)]"
  exit 0
fi

if [ "$(id -u)" -ne 0 ]; then
  log "ERROR: missing packages (${missing[*]}) and not root: run this script as root (apt-get install)." >&2
  exit 1
fi

APT_OPTS=(-y -q --no-install-recommends
  -o Dpkg::Options::=--force-confdef -o Dpkg::Options::=--force-confold
  -o Dpkg::Use-Pty=0)

log "installing: ${missing[*]}"
# A fresh machine may have no (or stale) package lists; one update is cheap.
if ! apt-get install "${APT_OPTS[@]}" "${missing[@]}"; then
  log "install failed; running apt-get update and retrying"
  apt-get update -q -o Dpkg::Use-Pty=0
  apt-get install "${APT_OPTS[@]}" "${missing[@]}"
fi

# Guard against an accidental crun-only setup: Belayer's containers.conf names runc.
command -v runc >/dev/null || { log "ERROR: runc not on PATH after install" >&2; exit 1; }
log "installed: podman $(podman --version | awk '{print $3}'), runc $(runc --version | awk 'NR==1{print $3}') [$(elapsed)]"
