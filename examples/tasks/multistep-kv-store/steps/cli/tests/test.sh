#!/bin/bash
# Step "cli": incr and the kv command work, and step 1's store still does.
source /tests/lib.sh
start_verdict
[ -f /app/kvstore.py ] || fail "no /app/kvstore.py"
[ -f /app/kv ] || fail "no /app/kv"
timeout 30 python3 /tests/check_store.py || fail "KVStore checks of step 1"
timeout 60 python3 /tests/check_cli.py || fail "incr / kv command checks"
pass
