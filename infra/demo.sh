#!/usr/bin/env bash
# `make demo`: bring the local stack up and run the main job on it.
# Until trajectories exist, the main job is what exists: the stack's health and the
# storage benchmark against the local disk.
set -euo pipefail
cd "$(dirname "$0")/.."
BELAYER=.venv/bin/belayer

$BELAYER up
$BELAYER status
if $BELAYER bench --help | grep -q '^  storage'; then
  $BELAYER bench storage --size-mb 64
fi
echo
echo "The stack keeps running: Temporal UI on http://127.0.0.1:8233. Stop it with 'make down'."
