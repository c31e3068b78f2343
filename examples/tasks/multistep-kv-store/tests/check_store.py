"""Checks /app/kvstore.py's KVStore as step "store" asks (shared: step "cli" reruns it)."""

import json
import os
import sys
import tempfile

sys.path.insert(0, "/app")
sys.dont_write_bytecode = True


def main():
    from kvstore import KVStore

    with tempfile.TemporaryDirectory() as work:
        path = os.path.join(work, "nested", "db.json")
        store = KVStore(path)
        assert store.get("missing") is None, "get of a missing key is not None"
        assert store.get("missing", "fallback") == "fallback", "get ignores its default"
        assert store.keys() == [], "a new store is not empty"
        store.set("beta", "2")
        store.set("alpha", "1")
        store.set("beta", "two")
        assert store.get("beta") == "two", "set does not overwrite"
        assert store.keys() == ["alpha", "beta"], f"keys() = {store.keys()!r}"
        assert os.path.isfile(path), "the store file is not written (parent directories created?)"
        with open(path) as handle:
            assert json.load(handle) == {"alpha": "1", "beta": "two"}, (
                "the file is not the JSON object of the store"
            )

        reopened = KVStore(path)
        assert reopened.get("alpha") == "1", "a reopened store does not see earlier writes"
        assert reopened.delete("alpha") is True, "delete of a present key is not True"
        assert reopened.delete("alpha") is False, "delete of a missing key is not False"
        assert KVStore(path).keys() == ["beta"], "a delete is not persisted"

        with open(os.path.join(work, "seed.json"), "w") as handle:
            json.dump({"z": "last", "m": "middle"}, handle)
        assert KVStore(os.path.join(work, "seed.json")).keys() == ["m", "z"], "an existing file is not loaded"

        for bad in (1, None, ["x"]):
            try:
                store.set("k", bad)
            except TypeError:
                pass
            else:
                raise AssertionError(f"set accepted the non-string value {bad!r}")


if __name__ == "__main__":
    try:
        main()
    except Exception as exc:
        print(f"store check failed: {type(exc).__name__}: {exc}")
        sys.exit(1)
    print("store checks passed")
