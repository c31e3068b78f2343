#!/bin/bash
# Oracle: find the commit that deleted the file, take the file from its parent,
# commit it on a new branch from main.
set -euo pipefail
cd /app
deleting="$(git log --diff-filter=D --format=%H -1 main -- config/limits.ini)"
git switch -c restore-limits main
git checkout "${deleting}^" -- config/limits.ini
git commit -m "Restore config/limits.ini" -- config/limits.ini
git log --oneline -3
