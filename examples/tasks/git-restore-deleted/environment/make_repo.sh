#!/bin/bash
# Builds the task's repository in $1 with a fixed history (fixed dates: same hashes on every build).
set -euo pipefail
cd "$1"
git init -q -b main .

commit() {  # commit DATE MESSAGE
    GIT_AUTHOR_DATE="$1" GIT_COMMITTER_DATE="$1" git commit -q -m "$2"
}

mkdir -p config
cat > README.md <<'TXT'
# station

Reads sensor samples and flags values outside the configured limits.
TXT
cat > station.py <<'TXT'
import configparser

LIMITS_FILE = "config/limits.ini"


def load_limits(path=LIMITS_FILE):
    parser = configparser.ConfigParser()
    parser.read(path)
    return {name: (float(s["min"]), float(s["max"])) for name, s in parser.items() if name != "DEFAULT"}


def out_of_range(sample, limits):
    return sorted(k for k, v in sample.items() if k in limits and not limits[k][0] <= v <= limits[k][1])
TXT
cat > config/limits.ini <<'TXT'
[temperature]
min = -30
max = 45

[humidity]
min = 5
max = 90
TXT
git add -A
commit "2024-03-01T09:00:00+00:00" "Initial import"

sed -i 's/^max = 90$/max = 97/' config/limits.ini
git add -A
commit "2024-03-04T10:15:00+00:00" "Raise humidity ceiling"

cat >> config/limits.ini <<'TXT'

[pressure]
min = 870
max = 1085
TXT
git add -A
commit "2024-03-09T16:40:00+00:00" "Add pressure limits"

git rm -q config/limits.ini
cat > station.py <<'TXT'
import os


def load_limits(prefix="STATION_LIMIT_"):
    limits = {}
    for key, value in os.environ.items():
        if key.startswith(prefix):
            low, high = value.split(":")
            limits[key[len(prefix):].lower()] = (float(low), float(high))
    return limits


def out_of_range(sample, limits):
    return sorted(k for k, v in sample.items() if k in limits and not limits[k][0] <= v <= limits[k][1])
TXT
git add -A
commit "2024-03-12T08:05:00+00:00" "Read limits from the environment"

cat > RELEASE.md <<'TXT'
# Releasing

Tag the commit on main as vYYYY.MM and push the tag.
TXT
git add -A
commit "2024-03-20T14:30:00+00:00" "Document release process"
