"""Checks KVStore.incr and the /app/kv command (step "cli")."""

import os
import subprocess
import sys
import tempfile

sys.path.insert(0, "/app")
sys.dont_write_bytecode = True


def kv(db, *args):
    done = subprocess.run(["/app/kv", "--db", db, *args], capture_output=True, text=True, timeout=10)
    return done.returncode, done.stdout


def main():
    from kvstore import KVStore

    with tempfile.TemporaryDirectory() as work:
        store = KVStore(os.path.join(work, "counters.json"))
        assert store.incr("hits") == 1, "incr of a missing key is not 1"
        assert store.incr("hits", 41) == 42, "incr by 41 is not 42"
        assert store.incr("hits", -2) == 40, "incr by -2 is not 40"
        assert store.get("hits") == "40", f"the stored value is {store.get('hits')!r}, not '40'"
        store.set("name", "rope")
        try:
            store.incr("name")
        except ValueError:
            pass
        else:
            raise AssertionError("incr of a non-integer value did not raise ValueError")
        assert KVStore(store.path).get("name") == "rope", "a failed incr changed the store"

        db = os.path.join(work, "cli.json")
        assert os.access("/app/kv", os.X_OK), "/app/kv is not executable"
        assert kv(db, "set", "user.alice", "admin") == (0, ""), "set"
        assert kv(db, "set", "user.bob", "viewer") == (0, ""), "set"
        assert kv(db, "set", "team", "ops") == (0, ""), "set"
        assert kv(db, "get", "user.bob") == (0, "viewer\n"), f"get: {kv(db, 'get', 'user.bob')!r}"
        assert kv(db, "get", "nobody") == (1, ""), f"get of a missing key: {kv(db, 'get', 'nobody')!r}"
        assert kv(db, "list") == (0, "team\nuser.alice\nuser.bob\n"), f"list: {kv(db, 'list')!r}"
        assert kv(db, "list", "user.") == (0, "user.alice\nuser.bob\n"), "list with a prefix"
        assert kv(db, "del", "user.alice")[0] == 0, "del"
        assert kv(db, "del", "user.alice")[0] == 1, "del of a missing key"
        assert kv(db, "incr", "visits") == (0, "1\n"), f"incr: {kv(db, 'incr', 'visits')!r}"
        assert kv(db, "incr", "visits", "9") == (0, "10\n"), "incr by 9"
        assert kv(db, "incr", "team")[0] == 1, "incr of a non-integer value"
        assert KVStore(db).keys() == ["team", "user.bob", "visits"], (
            f"the CLI's file holds {KVStore(db).keys()!r}"
        )


if __name__ == "__main__":
    try:
        main()
    except Exception as exc:
        print(f"cli check failed: {type(exc).__name__}: {exc}")
        sys.exit(1)
    print("cli checks passed")
