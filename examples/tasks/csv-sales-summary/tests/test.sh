#!/bin/bash
# Verifier: reward.json with one value per check and "reward" (1 only when all pass).
mkdir -p /logs/verifier
echo '{"reward": 0.0, "rows": 0.0, "regions": 0.0, "top_products": 0.0, "input_unchanged": 0.0}' \
    > /logs/verifier/reward.json

scores="$(timeout 30 python3 /tests/check_outputs.py abf2a09edf2ab51706c13239ea2a694d6e73a69bae2b6a28e00019cad89d9a32)"
if [ -n "$scores" ]; then
    echo "$scores" > /logs/verifier/reward.json
fi
cat /logs/verifier/reward.json
exit 0
