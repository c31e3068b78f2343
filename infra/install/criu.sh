#!/usr/bin/env bash
# Provides CRIU >= $CRIU_MIN_VERSION at a stable path, $BELAYER_CACHE_DIR/bin/criu
# (default ~/.cache/belayer/bin/criu), verified with `criu check`.
#
# This kernel (6.x) needs CRIU >= 4.2: Debian 12's 3.17 fails on the vDSO and 4.1 on
# any socket (docs/design.md §7). Routes, tried in order:
#   system  the machine's own criu, when it is already >= the floor;
#   sid     Debian sid's criu binary package and its shared libraries (C library and
#           dynamic loader included) fetched with a PRIVATE apt configuration (its own
#           sources/state/cache under the cache dir; the mirror is derived from the
#           machine's own apt sources), extracted with `dpkg -x` into the private prefix
#           $CACHE/criu-<debian version>/ and run through that prefix's own dynamic
#           loader (--library-path). Nothing from sid is installed into the system;
#   source  Debian sid's source package (`apt-get source` via the same private
#           configuration), built against the system's own -dev packages (installed
#           from the machine's release, i.e. bookworm) into $CACHE/criu-<ver>-source/.
# BELAYER_CRIU_ROUTE=system|sid|source forces one route (default: auto).
#
# $CACHE/bin/criu is a tiny wrapper script naming its route. Belayer hands it to
# runc with `--runtime-flag=criu=<path>` and puts $CACHE/bin first on PATH for
# podman's own CRIU version check (see infra/podman/containers.conf).
#
# Idempotent: when the wrapper exists, reports a version >= the floor and
# `criu check` passes, nothing is fetched or rebuilt. Needs root for `criu check`
# and for the build-deps of the source route.
set -euo pipefail
exec </dev/null
export DEBIAN_FRONTEND=noninteractive

ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
# shellcheck source=../versions.env
. "$ROOT/infra/versions.env"
: "${CRIU_MIN_VERSION:?CRIU_MIN_VERSION missing from infra/versions.env}"
: "${CRIU_DEBIAN_SUITE:=sid}"

CACHE="${BELAYER_CACHE_DIR:-$HOME/.cache/belayer}"
BIN="$CACHE/bin"
WRAPPER="$BIN/criu"
ROUTE="${BELAYER_CRIU_ROUTE:-auto}"

log() { printf '[criu] %s\n' "$*"; }
die() { printf '[criu] ERROR: %s\n' "$*" >&2; exit 1; }
t0=$(date +%s%N)
elapsed() { echo "$(( ($(date +%s%N) - t0) / 1000000 ))ms"; }

case "$ROUTE" in auto|system|sid|source) ;; *) die "BELAYER_CRIU_ROUTE=$ROUTE: use auto, system, sid or source";; esac

mkdir -p "$BIN"
exec 9>"$CACHE/.criu.lock"
flock 9

# "Version: 4.2.1" -> "4.2.1"; empty when the binary does not run.
criu_version_of() { "$@" --version 2>/dev/null | awk '/^Version:/ {print $2; exit}'; }
at_least_floor() { [ -n "$1" ] && dpkg --compare-versions "$1" ge "$CRIU_MIN_VERSION"; }
wrapper_route() { sed -n 's/^# route: \([a-z]*\).*/\1/p' "$WRAPPER" 2>/dev/null | head -1; }

criu_check() {  # $1 = criu command; prints criu's verdict
  if [ "$(id -u)" -ne 0 ]; then
    log "not root: skipping \`criu check\` (checkpoint/restore needs root)"
    return 0
  fi
  local out
  if out=$("$1" check 2>&1); then
    log "criu check: $(echo "$out" | tr '\n' ' ')"
  else
    log "criu check FAILED: $out" >&2
    return 1
  fi
}

# ---------------------------------------------------------------- cached?
if [ -x "$WRAPPER" ]; then
  have=$(criu_version_of "$WRAPPER")
  have_route=$(wrapper_route)
  if at_least_floor "$have" && { [ "$ROUTE" = auto ] || [ "$ROUTE" = "$have_route" ]; }; then
    if criu_check "$WRAPPER" >/dev/null; then
      log "already installed: $WRAPPER -> criu $have (route: $have_route), criu check ok [$(elapsed)]"
      exit 0
    fi
    log "cached $WRAPPER (criu $have) fails \`criu check\`; reinstalling"
  elif [ -n "$have" ]; then
    log "cached $WRAPPER is criu $have (route: $have_route); want >= $CRIU_MIN_VERSION (route: $ROUTE)"
  fi
fi

write_wrapper() {  # $1 = route line, rest = command to exec
  local route_line=$1; shift
  local tmp="$WRAPPER.tmp.$$" q=""
  local a
  # POSIX single quotes: the wrapper runs under /bin/sh (dash), which lacks $'...'.
  for a in "$@"; do q+=" '${a//\'/\'\\\'\'}'"; done
  cat >"$tmp" <<EOF
#!/bin/sh
# Belayer's criu, written by infra/install/criu.sh. Do not edit; rerun the script.
# route: $route_line
exec$q "\$@"
EOF
  chmod 0755 "$tmp"
  mv -f "$tmp" "$WRAPPER"
}

finish() {  # verify the wrapper we just wrote
  local v
  v=$(criu_version_of "$WRAPPER")
  at_least_floor "$v" || die "$WRAPPER reports version '${v:-none}', want >= $CRIU_MIN_VERSION"
  criu_check "$WRAPPER" || die "$WRAPPER (criu $v) fails \`criu check\`"
  log "ready: $WRAPPER -> criu $v (route: $(wrapper_route)) [$(elapsed)]"
}

# ---------------------------------------------------------------- route: system
try_system() {
  local c v
  for c in $(command -v -a criu 2>/dev/null) /usr/sbin/criu /usr/local/sbin/criu /sbin/criu; do
    [ -x "$c" ] || continue
    case "$(readlink -f "$c")" in "$(readlink -f "$BIN")"/*) continue;; esac
    v=$(criu_version_of "$c")
    if at_least_floor "$v"; then
      log "route: system — $c is criu $v (>= $CRIU_MIN_VERSION)"
      write_wrapper "system (criu $v at $c)" "$c"
      return 0
    fi
    log "system criu $c is ${v:-unusable}, below the floor $CRIU_MIN_VERSION"
  done
  [ "$ROUTE" = system ] && die "no system criu >= $CRIU_MIN_VERSION"
  log "no system criu >= $CRIU_MIN_VERSION (Debian 12 ships 3.17, which fails on this kernel)"
  return 1
}

# ---------------------------------------------------------------- private apt (sid)
APTDIR="$CACHE/apt-$CRIU_DEBIAN_SUITE"
APT_PRIV=()

machine_mirror() {
  # The URI that serves the machine's own Debian release (e.g. bookworm) in its apt
  # sources. `apt-get indextargets` reads both sources formats but needs the lists.
  local codename uri
  codename=$(. /etc/os-release; echo "${VERSION_CODENAME:-}")
  [ -n "$codename" ] || die "no VERSION_CODENAME in /etc/os-release"
  find_uri() {
    apt-get indextargets --format '$(REPO_URI) $(RELEASE) $(TARGET_OF)' 2>/dev/null |
      awk -v c="$codename" '$2 == c && $3 == "deb" {print $1; exit}'
  }
  uri=$(find_uri)
  if [ -z "$uri" ]; then
    log "no apt lists for $codename yet: running apt-get update (the machine's own sources)" >&2
    apt-get update -q -o Dpkg::Use-Pty=0 >&2
    uri=$(find_uri)
  fi
  [ -n "$uri" ] || die "cannot find the mirror serving $codename in the machine's apt sources"
  echo "${uri%/}"
}

setup_private_apt() {
  local mirror keyring
  mirror=$(machine_mirror)
  keyring=/usr/share/keyrings/debian-archive-keyring.gpg
  [ -r "$keyring" ] || die "$keyring missing (package debian-archive-keyring)"
  mkdir -p "$APTDIR"/etc/preferences.d "$APTDIR"/etc/apt.conf.d \
           "$APTDIR"/state/lists/partial "$APTDIR"/cache/archives/partial
  touch "$APTDIR/state/status"
  cat >"$APTDIR/etc/sources.list" <<EOF
# Private to Belayer's criu.sh: never added to the system's sources.
deb [signed-by=$keyring] $mirror $CRIU_DEBIAN_SUITE main
deb-src [signed-by=$keyring] $mirror $CRIU_DEBIAN_SUITE main
EOF
  APT_PRIV=(
    -o "Dir::Etc::sourcelist=$APTDIR/etc/sources.list" -o "Dir::Etc::sourceparts=-"
    -o "Dir::Etc::preferences=$APTDIR/etc/preferences"
    -o "Dir::Etc::preferencesparts=$APTDIR/etc/preferences.d"
    -o "Dir::Etc::parts=$APTDIR/etc/apt.conf.d"
    -o "Dir::State=$APTDIR/state" -o "Dir::State::status=$APTDIR/state/status"
    -o "Dir::Cache=$APTDIR/cache" -o "Debug::NoLocking=1"
    -o "APT::Sandbox::User=root" -o "Acquire::Languages=none" -o "Dpkg::Use-Pty=0"
  )
  log "private apt config $APTDIR: $mirror $CRIU_DEBIAN_SUITE (derived from the machine's sources)"
  apt-get "${APT_PRIV[@]}" update -q >/dev/null || die "apt-get update of $CRIU_DEBIAN_SUITE via $mirror failed"
}

candidate_version() {  # $1 = binary or source package name
  apt-cache "${APT_PRIV[@]}" policy "$1" 2>/dev/null | awk '/Candidate:/ {print $2; exit}'
}

triplet() {
  case "$(dpkg --print-architecture)" in
    amd64) echo x86_64-linux-gnu;; arm64) echo aarch64-linux-gnu;;
    *) die "unsupported architecture $(dpkg --print-architecture)";;
  esac
}

# ---------------------------------------------------------------- route: sid binary
try_sid() {
  local deb_ver up_ver prefix pkgs tmp tri loader
  deb_ver=$(candidate_version criu)
  [ -n "$deb_ver" ] || { log "no criu package in $CRIU_DEBIAN_SUITE"; return 1; }
  up_ver=${deb_ver#*:}; up_ver=${up_ver%-*}
  if ! at_least_floor "$up_ver"; then
    log "$CRIU_DEBIAN_SUITE has criu $deb_ver, below the floor $CRIU_MIN_VERSION"; return 1
  fi
  prefix="$CACHE/criu-${deb_ver//[:~]/_}"
  tri=$(triplet)
  if [ ! -x "$prefix/usr/sbin/criu" ]; then
    # criu plus its shared-library closure. Only library packages (lib*, and the
    # tiny gcc-*-base data package libgcc-s1 needs) are followed: Recommends such as
    # python3-pycriu and iproute2 are not needed, the system's `ip`/`iptables`
    # serve criu's external tool calls.
    pkgs=$(apt-cache "${APT_PRIV[@]}" depends --recurse --no-recommends --no-suggests \
             --no-conflicts --no-breaks --no-replaces --no-enhances criu 2>/dev/null |
           grep -v '^ ' | grep -E '^(criu|lib.*|gcc-[0-9]+-base)$' | sort -u | tr '\n' ' ')
    log "route: $CRIU_DEBIAN_SUITE binary — criu $deb_ver + libraries: $pkgs"
    tmp="$prefix.tmp.$$"
    rm -rf "$tmp"; mkdir -p "$tmp/debs" "$tmp/root"
    # shellcheck disable=SC2086
    (cd "$tmp/debs" && apt-get "${APT_PRIV[@]}" -q download $pkgs >/dev/null) ||
      { rm -rf "$tmp"; log "download from $CRIU_DEBIAN_SUITE failed"; return 1; }
    for d in "$tmp"/debs/*.deb; do dpkg -x "$d" "$tmp/root"; done
    rm -rf "$prefix"; mv "$tmp/root" "$prefix"; rm -rf "$tmp"
  else
    log "route: $CRIU_DEBIAN_SUITE binary — criu $deb_ver already extracted in $prefix"
  fi
  loader=$(ls "$prefix"/usr/lib/"$tri"/ld-linux*.so.* 2>/dev/null | head -1)
  [ -n "$loader" ] || { log "no dynamic loader in $prefix"; return 1; }
  write_wrapper "sid (Debian criu $deb_ver, private prefix $prefix, its own loader)" \
    "$loader" --library-path "$prefix/usr/lib/$tri:$prefix/lib/$tri" "$prefix/usr/sbin/criu"
  local v; v=$(criu_version_of "$WRAPPER")
  if ! at_least_floor "$v" || ! criu_check "$WRAPPER" >/dev/null; then
    log "the $CRIU_DEBIAN_SUITE binary does not work here (version '${v:-none}')"; return 1
  fi
}

# ---------------------------------------------------------------- route: source
# Build-deps of Debian's criu minus docs (asciidoc/xmlto) and python bits, from the
# machine's own release.
BUILD_DEPS=(gcc make pkgconf libbsd-dev libcap-dev libgnutls28-dev libnet1-dev
  libnftables-dev libnl-3-dev libprotobuf-c-dev libprotobuf-dev protobuf-c-compiler
  protobuf-compiler uuid-dev dpkg-dev)

fetch_source() {  # $1 = Debian version, $2 = directory; verified against the Sources index
  local line uri name size hash got
  local -a lines
  mapfile -t lines < <(apt-get "${APT_PRIV[@]}" -q source --print-uris "criu=$1" 2>/dev/null | grep "^'")
  [ "${#lines[@]}" -gt 0 ] || die "apt-get source --print-uris criu=$1 found nothing"
  for line in "${lines[@]}"; do
    read -r uri name size hash <<<"$line"
    uri=${uri//\'/}
    if ! curl -fsS --retry 2 -o "$2/$name" "$uri" 2>/dev/null; then
      rm -f "$2/$name"
      case "$name" in
        *.debian.tar.*) log "could not fetch $uri"; continue;;
        *) die "could not fetch $uri";;
      esac
    fi
    case "$hash" in
      SHA256:*) got=$(sha256sum "$2/$name" | cut -d' ' -f1)
                [ "$got" = "${hash#SHA256:}" ] || die "$name: sha256 $got, the signed index says ${hash#SHA256:}";;
      *) die "$name: no SHA256 in the index ($hash)";;
    esac
  done
  ls "$2"/*.orig.tar.* >/dev/null 2>&1 || die "no orig tarball for criu $1"
}

try_source() {
  local deb_ver up_ver prefix src tmp missing=() p
  deb_ver=$(candidate_version criu)
  [ -n "$deb_ver" ] || die "no criu source in $CRIU_DEBIAN_SUITE"
  up_ver=${deb_ver#*:}; up_ver=${up_ver%-*}
  at_least_floor "$up_ver" || die "$CRIU_DEBIAN_SUITE has criu $deb_ver, below the floor $CRIU_MIN_VERSION"
  prefix="$CACHE/criu-${deb_ver//[:~]/_}-source"
  if [ ! -x "$prefix/usr/sbin/criu" ]; then
    log "route: source — building Debian's criu $deb_ver from its source package"
    for p in "${BUILD_DEPS[@]}"; do
      [ "$(dpkg-query -W -f='${db:Status-Status}' "$p" 2>/dev/null)" = installed ] || missing+=("$p")
    done
    if [ "${#missing[@]}" -gt 0 ]; then
      [ "$(id -u)" -eq 0 ] || die "build deps missing (${missing[*]}) and not root"
      log "installing build deps from the machine's release: ${missing[*]}"
      apt-get install -y -q --no-install-recommends -o Dpkg::Use-Pty=0 "${missing[@]}" >/dev/null
    fi
    tmp="$CACHE/criu-src.tmp.$$"
    rm -rf "$tmp"; mkdir -p "$tmp"
    fetch_source "$deb_ver" "$tmp"
    if ls "$tmp"/*.debian.tar.* >/dev/null 2>&1; then
      (cd "$tmp" && dpkg-source --no-check -x ./*.dsc src >/dev/null) || die "dpkg-source -x failed"
    else
      # Seen on this machine kind: the mirror serves the .dsc and the orig tarball but
      # 404s on criu_*.debian.tar.xz. Debian's patches are packaging fixes; upstream
      # criu builds and works without them.
      log "Debian's packaging tarball is not available from the mirror: building upstream criu $up_ver from the orig tarball"
      mkdir -p "$tmp/src"
      tar -xf "$tmp"/criu_*.orig.tar.* -C "$tmp/src" --strip-components=1
    fi
    src="$tmp/src"
    log "compiling (make -j$(nproc) criu)"
    make -C "$src" -j"$(nproc)" criu >"$tmp/build.log" 2>&1 ||
      { tail -30 "$tmp/build.log" >&2; die "criu build failed (log: $tmp/build.log)"; }
    mkdir -p "$prefix.tmp/usr/sbin"
    install -m 0755 "$src/criu/criu" "$prefix.tmp/usr/sbin/criu"
    rm -rf "$prefix"; mv "$prefix.tmp" "$prefix"; rm -rf "$tmp"
  else
    log "route: source — criu $deb_ver already built in $prefix"
  fi
  write_wrapper "source (Debian criu $deb_ver built here, $prefix)" "$prefix/usr/sbin/criu"
}

# ---------------------------------------------------------------- choose
case "$ROUTE" in
  system) try_system ;;
  sid)    setup_private_apt; try_sid || die "sid route failed" ;;
  source) setup_private_apt; try_source ;;
  auto)
    if ! try_system; then
      setup_private_apt
      if ! try_sid; then
        log "falling back to building from source"
        try_source
      fi
    fi ;;
esac
finish
