#!/usr/bin/env bash
# Builds the base sandbox image and imports it into Belayer's podman storage as
# localhost/belayer-base:v$BASE_IMAGE_VERSION.
#
#  1. rootfs: `debootstrap --variant=minbase` of the machine's own Debian release from
#     the machine's own mirror (both read from the system's apt configuration), plus
#     bash coreutils findutils grep sed procps python3 python3-venv git make; logs, apt caches and
#     other run-specific files are dropped, and the tarball is written with sorted
#     names, numeric owners and one fixed mtime, so that it depends on the package
#     set only (cached: $CACHE/base-rootfs-<release>-v$BASE_IMAGE_VERSION.tar);
#  2. supervisor hook: when infra/sandbox/ holds files, they are copied into
#     /opt/belayer/ of the rootfs, and their hash is part of the image's cache key; the
#     users the supervisor runs actions and checks as (agent 1000, verifier 1001) are
#     named in /etc/passwd and /etc/group, so `id`, `ls -l` and the like say who is who;
#  3. image tarball: $CACHE/base-image-v$BASE_IMAGE_VERSION[-<sandbox hash>].tar;
#  4. `podman import` into Belayer's storage (flags from belayer/sandbox/runtime.py),
#     skipped when the tag already carries this cache key (image label). Importing the
#     same tarball again gives the same image id, which checkpoint restore on another
#     host requires (docs/design.md §7).
#
# Idempotent; non-interactive; needs root (debootstrap, rootful podman).
set -euo pipefail
exec </dev/null
export DEBIAN_FRONTEND=noninteractive

ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
# shellcheck source=../versions.env
. "$ROOT/infra/versions.env"
: "${BASE_IMAGE_VERSION:?BASE_IMAGE_VERSION missing from infra/versions.env}"

CACHE="${BELAYER_CACHE_DIR:-$HOME/.cache/belayer}"
PACKAGES=bash,coreutils,findutils,grep,sed,procps,python3,python3-venv,git,make
# One fixed mtime for every file of the image (2024-01-01T00:00:00Z).
EPOCH=1704067200

log() { printf '[base-image] %s\n' "$*"; }
die() { printf '[base-image] ERROR: %s\n' "$*" >&2; exit 1; }
t0=$(date +%s%N)
elapsed() { echo "$(( ($(date +%s%N) - t0) / 1000000 ))ms"; }

[ "$(id -u)" -eq 0 ] || die "run as root (debootstrap and rootful podman)"
command -v debootstrap >/dev/null || die "debootstrap missing: run infra/install/podman.sh first"
command -v podman >/dev/null || die "podman missing: run infra/install/podman.sh first"

PYTHON=$(command -v python3 || true)
[ -n "$PYTHON" ] || die "python3 is needed to read belayer/sandbox/runtime.py's podman flags"
RUNTIME_PY="$ROOT/belayer/sandbox/runtime.py"
mapfile -t PODMAN_ARGS < <("$PYTHON" "$RUNTIME_PY" base-args)
while IFS= read -r kv; do export "${kv?}"; done < <("$PYTHON" "$RUNTIME_PY" env)
IMAGE=$("$PYTHON" "$RUNTIME_PY" image)
pm() { podman "${PODMAN_ARGS[@]}" "$@"; }

mkdir -p "$CACHE"
exec 9>"$CACHE/.base-image.lock"
flock 9

RELEASE=$(. /etc/os-release; echo "${VERSION_CODENAME:-}")
[ -n "$RELEASE" ] || die "no VERSION_CODENAME in /etc/os-release"

# ------------------------------------------------------------------ cache keys
SANDBOX_DIR="$ROOT/infra/sandbox"
sandbox_hash=""
if [ -d "$SANDBOX_DIR" ] && [ -n "$(find "$SANDBOX_DIR" -type f -print -quit)" ]; then
  # Names, modes and contents of every file, in a stable order.
  sandbox_hash=$(cd "$SANDBOX_DIR" && find . -type f -print0 | LC_ALL=C sort -z |
    xargs -0 -r sh -c 'for f; do printf "%s %s\n" "$(stat -c %a "$f")" "$f"; sha256sum < "$f"; done' sh |
    sha256sum | cut -c1-12)
fi
ROOTFS_TAR="$CACHE/base-rootfs-$RELEASE-v$BASE_IMAGE_VERSION.tar"
IMAGE_TAR="$CACHE/base-image-v$BASE_IMAGE_VERSION${sandbox_hash:+-$sandbox_hash}.tar"
KEY="v$BASE_IMAGE_VERSION-$RELEASE${sandbox_hash:+-$sandbox_hash}"

# ------------------------------------------------------------------ already imported?
existing_key=$(pm image inspect --format '{{index .Labels "belayer.base-image.key"}}' "$IMAGE" 2>/dev/null || true)
if [ "$existing_key" = "$KEY" ]; then
  log "already imported: $IMAGE id $(pm image inspect --format '{{.Id}}' "$IMAGE") (key $KEY) [$(elapsed)]"
  exit 0
fi

deterministic_tar() {  # $1 = dir, $2 = output tar
  tar --create --file="$2.tmp" --directory="$1" \
      --sort=name --numeric-owner --mtime="@$EPOCH" --xattrs --xattrs-include='security.capability' \
      --pax-option=exthdr.name=%d/PaxHeaders/%f,delete=atime,delete=ctime \
      --format=posix .
  # `podman import` takes the image's "created" time from the tarball's mtime, and
  # the image id hashes it: pin it, so the same content always gives the same id.
  touch -d "@$EPOCH" "$2.tmp"
  mv -f "$2.tmp" "$2"
}

machine_mirror() {
  find_uri() {
    apt-get indextargets --format '$(REPO_URI) $(RELEASE) $(TARGET_OF)' 2>/dev/null |
      awk -v c="$RELEASE" '$2 == c && $3 == "deb" {print $1; exit}'
  }
  local uri; uri=$(find_uri)
  if [ -z "$uri" ]; then
    log "no apt lists for $RELEASE yet: running apt-get update (the machine's own sources)" >&2
    apt-get update -q -o Dpkg::Use-Pty=0 >&2
    uri=$(find_uri)
  fi
  [ -n "$uri" ] || die "cannot find the mirror serving $RELEASE in the machine's apt sources"
  echo "${uri%/}"
}

# ------------------------------------------------------------------ 1. rootfs
if [ ! -f "$ROOTFS_TAR" ]; then
  MIRROR=$(machine_mirror)
  WORK=$(mktemp -d "$CACHE/base-rootfs.XXXXXX")
  trap 'rm -rf "$WORK"' EXIT
  mkdir -p "$CACHE/debootstrap-debs"
  log "debootstrap --variant=minbase $RELEASE from $MIRROR (+ $PACKAGES)"
  t1=$(date +%s)
  if ! debootstrap --variant=minbase --include="$PACKAGES" \
        --cache-dir="$CACHE/debootstrap-debs" \
        "$RELEASE" "$WORK/rootfs" "$MIRROR" >"$WORK/debootstrap.log" 2>&1; then
    tail -30 "$WORK/debootstrap.log" >&2
    [ -f "$WORK/rootfs/debootstrap/debootstrap.log" ] && tail -30 "$WORK/rootfs/debootstrap/debootstrap.log" >&2
    die "debootstrap failed"
  fi
  log "debootstrap done in $(( $(date +%s) - t1 ))s"
  R="$WORK/rootfs"
  # Drop what is specific to this run (logs, caches, ids) so the tarball depends on
  # the package set only.
  rm -rf "$R"/debootstrap "$R"/var/cache/apt/*.bin "$R"/var/cache/apt/archives/*.deb \
         "$R"/var/lib/apt/lists/* "$R"/var/log/* "$R"/var/cache/ldconfig/aux-cache \
         "$R"/var/cache/debconf/*-old "$R"/var/lib/dpkg/*-old "$R"/tmp/* "$R"/var/tmp/* \
         "$R"/root/.bash_history
  mkdir -p "$R"/var/lib/apt/lists/partial "$R"/var/cache/apt/archives/partial
  : >"$R"/etc/machine-id
  rm -f "$R"/var/lib/dbus/machine-id
  # Password ages are "days since epoch" of the build day.
  sed -i -E 's/^([^:]*:[^:]*:)[0-9]+:/\1'"$((EPOCH / 86400))"':/' "$R"/etc/shadow
  [ -f "$R"/etc/shadow- ] && rm -f "$R"/etc/shadow- "$R"/etc/gshadow- "$R"/etc/passwd- "$R"/etc/group- "$R"/etc/subuid- "$R"/etc/subgid-
  # Byte-compiled Python files are not reproducible (marshal): python3 rebuilds them.
  find "$R"/usr/lib/python3* -name '__pycache__' -type d -prune -exec rm -rf {} + 2>/dev/null || true
  printf 'deb %s %s main\n' "$MIRROR" "$RELEASE" >"$R"/etc/apt/sources.list
  deterministic_tar "$R" "$ROOTFS_TAR"
  rm -rf "$WORK"; trap - EXIT
  log "cached rootfs $ROOTFS_TAR ($(du -h "$ROOTFS_TAR" | cut -f1), sha256 $(sha256sum "$ROOTFS_TAR" | cut -c1-16)…)"
else
  log "rootfs cached: $ROOTFS_TAR"
fi

# ------------------------------------------------------------------ 2+3. image tarball
if [ ! -f "$IMAGE_TAR" ]; then
  if [ -z "$sandbox_hash" ]; then
    # Same bytes: a hard link (falls back to a copy across file systems).
    ln -f "$ROOTFS_TAR" "$IMAGE_TAR" 2>/dev/null || cp --preserve=timestamps "$ROOTFS_TAR" "$IMAGE_TAR"
  else
    # Supervisor hook: infra/sandbox/* -> /opt/belayer/ in the image.
    WORK=$(mktemp -d "$CACHE/base-image.XXXXXX")
    trap 'rm -rf "$WORK"' EXIT
    mkdir -p "$WORK/rootfs"
    tar --extract --file="$ROOTFS_TAR" --directory="$WORK/rootfs" --numeric-owner \
        --xattrs --xattrs-include='security.capability'
    mkdir -p "$WORK/rootfs/opt/belayer"
    cp -a "$SANDBOX_DIR"/. "$WORK/rootfs/opt/belayer/"
    chown -R 0:0 "$WORK/rootfs/opt/belayer"
    printf 'agent:x:1000:1000:Belayer agent:/home/agent:/bin/bash\nverifier:x:1001:1001:Belayer verifier:/nonexistent:/usr/sbin/nologin\n' >>"$WORK/rootfs/etc/passwd"
    printf 'agent:x:1000:\nverifier:x:1001:\n' >>"$WORK/rootfs/etc/group"
    log "baked infra/sandbox/ into /opt/belayer (hash $sandbox_hash)"
    deterministic_tar "$WORK/rootfs" "$IMAGE_TAR"
    rm -rf "$WORK"; trap - EXIT
  fi
  log "image tarball $IMAGE_TAR"
else
  log "image tarball cached: $IMAGE_TAR"
fi

# ------------------------------------------------------------------ 4. import
touch -d "@$EPOCH" "$IMAGE_TAR"  # in case it was copied here without its mtime
# podman 4.3's import (containers/image) writes root's blob-info cache to
# /var/lib/containers/cache whatever --root says; remove it again if we created it.
had_var_lib_containers=no
[ -e /var/lib/containers ] && had_var_lib_containers=yes
old_id=$(pm image inspect --format '{{.Id}}' "$IMAGE" 2>/dev/null || true)
log "podman import $IMAGE_TAR as $IMAGE (key $KEY)"
new_id=$(pm import -q \
  --change "LABEL belayer.base-image.key=$KEY" \
  --change "LABEL belayer.base-image.version=$BASE_IMAGE_VERSION" \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'CMD ["/bin/bash"]' \
  --message "belayer base image $KEY" \
  "$IMAGE_TAR" "$IMAGE" | tail -1)
new_id=${new_id#sha256:}
if [ "$had_var_lib_containers" = no ] && [ -d /var/lib/containers ]; then
  rm -f /var/lib/containers/cache/blob-info-cache-v1.boltdb
  rmdir /var/lib/containers/cache /var/lib/containers 2>/dev/null || true
fi
if [ -n "$old_id" ] && [ "$old_id" != "$new_id" ]; then
  # The old image is untagged now; drop it unless a container still uses it.
  pm rmi "$old_id" >/dev/null 2>&1 && log "removed the previous $IMAGE ($old_id)" || true
fi
log "imported: $IMAGE id $new_id [$(elapsed)]"

# Each tarball is ~250 MB: keep only the current ones (older image versions or
# supervisor hashes are never imported again; a bump rebuilds them).
for f in "$CACHE"/base-image-v*.tar "$CACHE"/base-rootfs-*.tar; do
  [ -f "$f" ] || continue
  [ "$f" = "$IMAGE_TAR" ] || [ "$f" = "$ROOTFS_TAR" ] && continue
  rm -f "$f" && log "pruned old $(basename "$f")"
done
