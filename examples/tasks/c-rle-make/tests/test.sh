#!/bin/bash
# Verifier: `make clean && make` builds /app/build/rle, the CLI encodes and decodes,
# and rle_encode passes the verifier's own C checks.
mkdir -p /logs/verifier
echo 0 > /logs/verifier/reward.txt

fail() { echo "FAIL: $*"; exit 0; }

cd /app || fail "no /app"
command -v cc >/dev/null || fail "no C compiler"

rm -f /app/build/rle
timeout 60 make clean >/dev/null 2>&1
timeout 60 make || fail "make did not succeed"
[ -x /app/build/rle ] || fail "make did not produce /app/build/rle"

check() {  # check EXPECTED ARGS...
    local want="$1"; shift
    local got
    got="$(timeout 5 /app/build/rle "$@" 2>/dev/null)" || fail "rle $* exited with an error"
    [ "$got" = "$want" ] || fail "rle $*: got '$got', want '$want'"
}
check "3a1b2c4d" encode aaabccdddd
check "aaabccdddd" decode 3a1b2c4d
check "1h1e2l1o" encode hello
check "15-" encode ---------------
if timeout 5 /app/build/rle encode "route66" >/dev/null 2>&1; then
    fail "rle encode route66 should fail (digits)"
fi

work="$(mktemp -d)"
timeout 60 cc -std=c11 -Wall -I/app/include -o "$work/test_rle" /tests/test_rle.c /app/src/rle.c \
    || fail "the verifier's checks do not compile against /app/src/rle.c"
timeout 10 "$work/test_rle" || fail "rle_encode checks failed"
rm -rf "$work"

echo 1 > /logs/verifier/reward.txt
echo "PASS"
exit 0
