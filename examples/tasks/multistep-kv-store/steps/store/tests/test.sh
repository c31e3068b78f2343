#!/bin/bash
# Step "store": /app/kvstore.py behaves as asked.
source /tests/lib.sh
start_verdict
[ -f /app/kvstore.py ] || fail "no /app/kvstore.py"
timeout 30 python3 /tests/check_store.py || fail "KVStore checks"
pass
