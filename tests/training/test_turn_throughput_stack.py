"""`belayer bench turn-throughput` as a user runs it, against the package's private stack:
both loops run their trajectories with real sandboxes, and the CPU of a turn is charged to
the processes that spent it. Nothing is judged on how long it took or on whether the goal
was met here; the exit status must say which."""

from __future__ import annotations

import json

from tests.test_stack import belayer


def test_the_bench_charges_each_turn_to_the_processes_that_served_it(stack):
    done = belayer(stack[1], "bench", "turn-throughput", "--concurrency", "1,3", "--turns", "1,3",
                   "--repetitions", "1", "--json", check=False, timeout=900)  # fmt: skip
    assert done.stdout.startswith("{"), done.stderr
    report = json.loads(done.stdout)
    assert done.returncode == (0 if report["goal_met"] else 1), done.stderr
    for goal, met in report["goals"].items():
        assert (f"goal not met: {goal}" in done.stderr) == (not met), done.stderr
    assert (report["concurrency"], report["turns"], report["not_completed"]) == (3, [1, 3], [])
    for count in (1, 3):
        for mode in ("belayer", "plain"):
            assert f"{mode:8s} {count:3d} x  3 turns" in done.stderr
    windows = {(w["mode"], w["concurrency"], w["turns"]): w for w in report["windows"]}
    assert len(windows) == 8 and all(
        w["statuses"] == {"completed": w["concurrency"]} for w in windows.values()
    )
    # Belayer's turns go through Temporal, the object store and both workers; the plain
    # loop's through none of them. Both run real actions in real sandboxes.
    longest = windows[("belayer", 3, 3)]["cpu_s"]
    for group in ("temporal", "seaweedfs", "trajectory-worker", "sandbox-worker", "in-sandbox", "bench"):
        assert longest.get(group, 0) > 0, (group, longest)
    assert windows[("plain", 3, 3)]["cpu_s"].get("in-sandbox", 0) > 0
    top = report["runs"]["3"]["belayer"]
    assert report["cpu_ms_per_turn"] == top["cpu_ms_per_turn"]["median"]
    assert set(top["cpu_ms_per_turn_by_process"]) <= {
        "temporal", "seaweedfs", "trajectory-worker", "sandbox-worker", "bench", "podman", "conmon", "in-sandbox"
    }  # fmt: skip
    assert "engine" in report["simulated"]
