#!/bin/bash
# Verifier: /app/out holds the catalogue's report, and svc-report produces the right
# report for a catalogue the agent has not seen. Outputs are compared with jq -S.
mkdir -p /logs/verifier
echo 0 > /logs/verifier/reward.txt

fail() { echo "FAIL: $*"; exit 0; }

command -v jq >/dev/null || fail "jq is not installed"
jq --version | grep -q '^jq-1\.6' || fail "jq is not Debian bookworm's 1.6: $(jq --version)"

same_json() {  # same_json EXPECTED ACTUAL
    [ -s "$2" ] || return 1
    local want got
    want="$(jq -S -c . "$1")" || return 1
    got="$(jq -S -c . "$2" 2>/dev/null)" || return 1
    [ -n "$got" ] && [ "$want" = "$got" ]
}

for name in enabled teams; do
    same_json "/tests/expected/$name.json" "/app/out/$name.json" \
        || fail "/app/out/$name.json: $(head -c 300 "/app/out/$name.json" 2>&1)"
done

[ -x /app/bin/svc-report ] || fail "/app/bin/svc-report is missing or not executable"
work="$(mktemp -d)"
timeout 20 /app/bin/svc-report /tests/hidden/catalogue.ndjson "$work/report" \
    || fail "svc-report failed on another catalogue"
for name in enabled teams; do
    same_json "/tests/hidden/$name.json" "$work/report/$name.json" \
        || fail "another catalogue's $name.json: $(head -c 300 "$work/report/$name.json" 2>&1)"
done
rm -rf "$work"

echo 1 > /logs/verifier/reward.txt
echo "PASS"
exit 0
