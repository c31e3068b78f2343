#!/bin/bash
# Oracle, step "cli": add KVStore.incr, write the kv command.
set -euo pipefail
cat >> /app/kvstore.py <<'PY'


def _incr(self, key, by=1):
    current = self.get(key, "0")
    try:
        value = int(current) + int(by)
    except ValueError:
        raise ValueError(f"{key} holds {current!r}, not an integer") from None
    self.set(key, str(value))
    return value


KVStore.incr = _incr
PY
cat > /app/kv <<'PY'
#!/usr/bin/env python3
"""kv: the command line of /app/kvstore.py."""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.realpath(__file__)))
from kvstore import KVStore  # noqa: E402


def main():
    parser = argparse.ArgumentParser(prog="kv")
    parser.add_argument("--db", default="/app/data/kv.json")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("set"); p.add_argument("key"); p.add_argument("value")
    p = sub.add_parser("get"); p.add_argument("key")
    p = sub.add_parser("del"); p.add_argument("key")
    p = sub.add_parser("list"); p.add_argument("prefix", nargs="?", default="")
    p = sub.add_parser("incr"); p.add_argument("key"); p.add_argument("by", nargs="?", type=int, default=1)
    args = parser.parse_args()
    store = KVStore(args.db)
    if args.command == "set":
        store.set(args.key, args.value)
    elif args.command == "get":
        value = store.get(args.key)
        if value is None:
            return 1
        print(value)
    elif args.command == "del":
        return 0 if store.delete(args.key) else 1
    elif args.command == "list":
        for key in store.keys():
            if key.startswith(args.prefix):
                print(key)
    elif args.command == "incr":
        try:
            print(store.incr(args.key, args.by))
        except ValueError as exc:
            print(f"kv: {exc}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
PY
chmod +x /app/kv
