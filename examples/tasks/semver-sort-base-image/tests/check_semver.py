"""Runs /app/bin/semver-sort on fixed inputs; exit 0 when every case matches."""

import os
import subprocess
import sys

TOOL = "/app/bin/semver-sort"

CASES = [
    # (arguments, input lines, expected stdout lines, expected invalid lines, expected exit)
    ([], ["1.10.0", "1.9.0", "1.10.0-rc.1", "banana"], ["1.9.0", "1.10.0-rc.1", "1.10.0"], ["banana"], 1),
    (
        [],
        [
            "1.0.0",
            "1.0.0-rc.1",
            "1.0.0-beta.11",
            "1.0.0-beta.2",
            "1.0.0-beta",
            "1.0.0-alpha.beta",
            "1.0.0-alpha.1",
            "1.0.0-alpha",
        ],
        [
            "1.0.0-alpha",
            "1.0.0-alpha.1",
            "1.0.0-alpha.beta",
            "1.0.0-beta",
            "1.0.0-beta.2",
            "1.0.0-beta.11",
            "1.0.0-rc.1",
            "1.0.0",
        ],
        [],
        0,
    ),
    (
        [],
        ["  2.0.0+build.7 ", "", "0.0.1", "2.0.0", "10.0.0", "2.0.0+a", "0.10.0", "   "],
        ["0.0.1", "0.10.0", "2.0.0+build.7", "2.0.0", "2.0.0+a", "10.0.0"],
        [],
        0,
    ),
    (
        [],
        [
            "01.2.3",
            "1.2",
            "1.2.3-01",
            "1.2.3-",
            "v1.2.3",
            "1.2.3+",
            "1.2.3 beta",
            "1.2.3-a..b",
            "1.2.3-0a",
            "1.2.3-x-y.0",
            "1.2.3-rc.1+b_1",
            "1.2.3.4",
            "1.2.3",
        ],
        ["1.2.3-0a", "1.2.3-x-y.0", "1.2.3"],
        [
            "01.2.3",
            "1.2",
            "1.2.3-01",
            "1.2.3-",
            "v1.2.3",
            "1.2.3+",
            "1.2.3 beta",
            "1.2.3-a..b",
            "1.2.3-rc.1+b_1",
            "1.2.3.4",
        ],
        1,
    ),
    (
        [],
        ["3.1.4-alpha.10", "3.1.4-alpha.9", "3.1.4-alpha.a", "3.1.4-alpha.9.1", "3.1.4-Alpha", "3.1.4-alpha"],
        ["3.1.4-Alpha", "3.1.4-alpha", "3.1.4-alpha.9", "3.1.4-alpha.9.1", "3.1.4-alpha.10", "3.1.4-alpha.a"],
        [],
        0,
    ),
    (
        ["--reverse"],
        ["1.2.3", "1.2.3+first", "2.0.0-rc.2", "0.9.9", "2.0.0-rc.10", "1.2.3+second", "x.y.z"],
        ["2.0.0-rc.10", "2.0.0-rc.2", "1.2.3", "1.2.3+first", "1.2.3+second", "0.9.9"],
        ["x.y.z"],
        1,
    ),
]


def main():
    if not os.access(TOOL, os.X_OK):
        print(f"FAIL: {TOOL} is missing or not executable")
        return 1
    failed = 0
    for number, (args, lines, want_out, want_invalid, want_status) in enumerate(CASES, 1):
        done = subprocess.run([TOOL, *args], input="\n".join(lines) + "\n", capture_output=True,
                              text=True, timeout=10)  # fmt: skip
        got_out = done.stdout.splitlines()
        got_invalid = [
            line[len("invalid: ") :] for line in done.stderr.splitlines() if line.startswith("invalid: ")
        ]
        if (
            got_out != want_out
            or sorted(got_invalid) != sorted(want_invalid)
            or done.returncode != want_status
        ):
            failed += 1
            print(f"FAIL case {number} {args}: stdout {got_out}, want {want_out}; invalid {got_invalid}, "
                  f"want {want_invalid}; exit {done.returncode}, want {want_status}")  # fmt: skip
    if failed:
        return 1
    print(f"PASS: {len(CASES)} cases")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception as exc:
        print(f"FAIL: {type(exc).__name__}: {exc}")
        sys.exit(1)
