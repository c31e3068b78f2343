#!/bin/bash
# Verifier: the agent's server on 127.0.0.1:8731 answers every endpoint as specified.
mkdir -p /logs/verifier
echo 0 > /logs/verifier/reward.txt

if timeout 45 python3 /tests/check_server.py; then
    echo 1 > /logs/verifier/reward.txt
fi
exit 0
