"""Scores /app/out/summary.json and /app/out/top_products.csv; prints a JSON object of checks."""

import hashlib
import json
import sys

EXPECTED_ROWS = {"valid_rows": 16, "skipped_rows": 7}
EXPECTED_REGIONS = {
    "east": (8, 271.90),
    "north": (8, 293.40),
    "south": (7, 345.30),
    "west": (10, 241.00),
}
EXPECTED_TOP = ["product,revenue", "Quickdraw set,359.60", "Harness,320.00", "Rope bag,272.00"]
DATA_SHA256 = sys.argv[1] if len(sys.argv) > 1 else ""


def load_summary():
    try:
        with open("/app/out/summary.json") as handle:
            summary = json.load(handle)
        return summary if isinstance(summary, dict) else None
    except (OSError, ValueError):
        return None


def rows_ok(summary):
    if summary is None:
        return False
    return all(type(summary.get(key)) is int and summary[key] == want for key, want in EXPECTED_ROWS.items())


def regions_ok(summary):
    regions = summary.get("regions") if summary else None
    if not isinstance(regions, dict) or set(regions) != set(EXPECTED_REGIONS):
        return False
    for name, (units, revenue) in EXPECTED_REGIONS.items():
        got = regions[name]
        if not isinstance(got, dict) or type(got.get("units")) is not int or got["units"] != units:
            return False
        value = got.get("revenue")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or abs(value - revenue) > 0.005:
            return False
    return True


def top_ok():
    try:
        with open("/app/out/top_products.csv") as handle:
            lines = [line.rstrip("\r\n") for line in handle]
    except (OSError, UnicodeDecodeError):
        return False
    while lines and not lines[-1].strip():
        lines.pop()
    return lines == EXPECTED_TOP


def data_untouched():
    try:
        with open("/app/data/sales.csv", "rb") as handle:
            return hashlib.sha256(handle.read()).hexdigest() == DATA_SHA256
    except OSError:
        return False


def main():
    summary = load_summary()
    checks = {
        "rows": rows_ok(summary),
        "regions": regions_ok(summary),
        "top_products": top_ok(),
        "input_unchanged": data_untouched(),
    }
    scores = {name: 1.0 if ok else 0.0 for name, ok in checks.items()}
    scores["reward"] = 1.0 if all(checks.values()) else 0.0
    print(json.dumps(scores))


if __name__ == "__main__":
    main()
