"""Queries the agent's server on 127.0.0.1:8731; exit 0 when every check passes."""

import json
import sys
import time
import urllib.error
import urllib.request

BASE = "http://127.0.0.1:8731"


def get(path):
    """(status, content type, body bytes) of GET path; HTTP errors are answers too."""
    try:
        with urllib.request.urlopen(BASE + path, timeout=3) as response:
            return response.status, response.headers.get("Content-Type", ""), response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.headers.get("Content-Type", ""), error.read()


def wait_for_server(seconds=6.0):
    deadline = time.monotonic() + seconds
    while True:
        try:
            return get("/health")
        except (urllib.error.URLError, ConnectionError, OSError) as exc:
            if time.monotonic() > deadline:
                print(f"FAIL: nothing answers on {BASE}: {exc}")
                return None
            time.sleep(0.5)


def main():
    health = wait_for_server()
    if health is None:
        return 1
    problems = []

    def expect(condition, what):
        if not condition:
            problems.append(what)

    status, _, body = health
    expect(status == 200 and body.strip() == b"ok", f"/health: {status} {body[:60]!r}")

    for sku, name, qty in [
        ("CRB-1100", "Carabiner screw-gate", 14),
        ("HLM-2203", "Climbing helmet", 0),
        ("RPE-9810", "Dynamic rope 9.8 mm", 6),
    ]:
        status, kind, body = get(f"/items/{sku}")
        try:
            data = json.loads(body)
        except ValueError:
            data = None
        expect(status == 200, f"/items/{sku}: status {status}")
        expect("application/json" in kind, f"/items/{sku}: Content-Type {kind!r}")
        expect(data == {"sku": sku, "name": name, "qty": qty}, f"/items/{sku}: {body[:120]!r}")
        expect(isinstance(data, dict) and type(data.get("qty")) is int, f"/items/{sku}: qty not an integer")

    status, kind, body = get("/items/ZZZ-0000")
    try:
        data = json.loads(body)
    except ValueError:
        data = None
    expect(status == 404 and data == {"error": "not found"}, f"/items/ZZZ-0000: {status} {body[:80]!r}")

    for below, want in [
        (10, ["GLV-0007", "HLM-2203", "RPE-9810"]),
        (1, ["HLM-2203"]),
        (0, []),
        (100, ["CRB-1100", "GLV-0007", "HLM-2203", "RPE-9810", "SLG-1200", "TPE-0025"]),
    ]:
        status, kind, body = get(f"/low-stock?below={below}")
        try:
            data = json.loads(body)
        except ValueError:
            data = None
        expect(status == 200 and data == want, f"/low-stock?below={below}: {status} {body[:120]!r}")
        expect("application/json" in kind, f"/low-stock?below={below}: Content-Type {kind!r}")

    for path in ("/low-stock", "/low-stock?below=many"):
        status, _, _ = get(path)
        expect(status == 400, f"{path}: status {status}, want 400")

    for problem in problems:
        print("FAIL:", problem)
    if not problems:
        print("PASS: all endpoint checks")
    return 0 if not problems else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception as exc:  # a malformed answer is a failed check, never a crash without a verdict
        print(f"FAIL: {type(exc).__name__}: {exc}")
        sys.exit(1)
