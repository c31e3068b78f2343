#!/bin/bash
# Verifier: /app/bin/semver-sort sorts, validates and reports as asked.
mkdir -p /logs/verifier
echo 0 > /logs/verifier/reward.txt
if timeout 45 python3 /tests/check_semver.py; then
    echo 1 > /logs/verifier/reward.txt
fi
exit 0
