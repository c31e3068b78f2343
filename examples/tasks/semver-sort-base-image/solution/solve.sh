#!/bin/bash
# Oracle: a Python implementation of SemVer 2.0.0 parsing and precedence.
set -euo pipefail
mkdir -p /app/bin
cat > /app/bin/semver-sort <<'PY'
#!/usr/bin/env python3
"""Sort stdin's versions by SemVer 2.0.0 precedence (--reverse: highest first)."""

import functools
import re
import sys

NUM = r"(0|[1-9]\d*)"
IDENT = r"(?:0|[1-9]\d*|\d*[A-Za-z-][0-9A-Za-z-]*)"
SEMVER = re.compile(
    rf"^{NUM}\.{NUM}\.{NUM}(?:-({IDENT}(?:\.{IDENT})*))?(?:\+([0-9A-Za-z-]+(?:\.[0-9A-Za-z-]+)*))?$",
    re.ASCII,
)


def compare_identifiers(a, b):
    for x, y in zip(a, b):
        if x == y:
            continue
        if x.isdigit() and y.isdigit():
            return -1 if int(x) < int(y) else 1
        if x.isdigit() != y.isdigit():
            return -1 if x.isdigit() else 1
        return -1 if x < y else 1
    return (len(a) > len(b)) - (len(a) < len(b))


def compare(a, b):
    (core_a, pre_a), (core_b, pre_b) = a, b
    if core_a != core_b:
        return -1 if core_a < core_b else 1
    if pre_a == pre_b:
        return 0
    if not pre_a or not pre_b:
        return -1 if pre_a else 1
    return compare_identifiers(pre_a, pre_b)


def main():
    reverse = "--reverse" in sys.argv[1:]
    versions, invalid = [], False
    for raw in sys.stdin:
        text = raw.strip()
        if not text:
            continue
        match = SEMVER.match(text)
        if match is None:
            print(f"invalid: {text}", file=sys.stderr)
            invalid = True
            continue
        core = tuple(int(part) for part in match.group(1, 2, 3))
        pre = tuple(match.group(4).split(".")) if match.group(4) else ()
        versions.append(((core, pre), text))
    key = functools.cmp_to_key(compare)
    for _, text in sorted(versions, key=lambda item: key(item[0]), reverse=reverse):
        print(text)
    return 1 if invalid else 0


if __name__ == "__main__":
    sys.exit(main())
PY
chmod +x /app/bin/semver-sort
