#!/bin/bash
# Verifier: the baked-in unit tests must be untouched and must pass.
mkdir -p /logs/verifier
echo 0 > /logs/verifier/reward.txt

cd /app || exit 0

# The agent was told not to edit the baked tests: refuse a changed suite.
if ! sha256sum --check --status <<'SUMS'
21c094b8d3fb7f25acdc5860f51f0eca137c56906f60b1b9ed5816d3e5033cc3  /app/tests/test_intervals.py
SUMS
then
    echo "FAIL: /app/tests/test_intervals.py was modified or removed"
    exit 0
fi

if timeout 30 python3 -m unittest discover -s tests -t . -v; then
    echo 1 > /logs/verifier/reward.txt
    echo "PASS"
else
    echo "FAIL: unit tests failed"
fi
exit 0
