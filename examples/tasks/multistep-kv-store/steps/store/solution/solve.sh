#!/bin/bash
# Oracle, step "store": the KVStore module.
set -euo pipefail
cat > /app/kvstore.py <<'PY'
"""A tiny persistent key-value store kept in one JSON file."""

import json
import os


class KVStore:
    def __init__(self, path):
        self.path = path
        self._data = {}
        if os.path.exists(path):
            with open(path) as handle:
                self._data = dict(json.load(handle))

    def get(self, key, default=None):
        return self._data.get(key, default)

    def set(self, key, value):
        if not isinstance(key, str) or not isinstance(value, str):
            raise TypeError("keys and values are strings")
        self._data[key] = value
        self._save()

    def delete(self, key):
        if key not in self._data:
            return False
        del self._data[key]
        self._save()
        return True

    def keys(self):
        return sorted(self._data)

    def _save(self):
        directory = os.path.dirname(os.path.abspath(self.path))
        os.makedirs(directory, exist_ok=True)
        partial = self.path + ".tmp"
        with open(partial, "w") as handle:
            json.dump(self._data, handle, indent=2, sort_keys=True)
        os.replace(partial, self.path)
PY
