"""`belayer bench fork` at a tiny scale: the JSON shape, identical starts, nothing left behind.

Speed is not asserted (no wall-clock assertions); the figures come from full-scale runs.
"""

from __future__ import annotations

import json

from click.testing import CliRunner


def test_fork_bench_json(sandbox_runtime, tmp_path):
    from belayer.cli.bench.fork import fork
    from belayer.config import load_config
    from belayer.sandbox.podman import PodmanBackend

    # Room for one mode's sandboxes at a time: every sandbox the bench removes must stop
    # counting against the host's capacity, or a later repetition is refused (HostFull).
    result = CliRunner().invoke(
        fork, ["--json", "--group-size", "2", "--repetitions", "2", "--scale", "0.02", "--archive-dir", str(tmp_path)],
        obj={}, env={"BELAYER_SANDBOX__MAX_SANDBOXES": "3"}, catch_exceptions=False,
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout.strip().splitlines()[-1])
    for key in ("fork_ready_s", "independent_ready_s", "speedup", "fork_reused_ready_s", "speedup_reused",
                "cpu_ratio", "group_size", "machine", "baked_ready_s", "bake_s"):  # fmt: skip
        assert key in data
    assert data["identical_start"] is True and data["group_size"] == 2
    for mode in ("fork", "fork_reused", "independent", "baked"):
        assert set(data[mode]["ready_s"]) == {"min", "median", "max"}
    # the reused fork leads, against the set-up baked into an image
    assert list(data)[3] == "speedup_reused_vs_baked"
    assert data["speedup_reused_vs_baked"] == round(data["baked_ready_s"] / data["fork_reused_ready_s"], 2)
    assert "baked the set-up into localhost/belayer-bench-baked:" in result.stderr
    assert data["fork"]["setup_s"]["median"] > 0 and "setup_s" not in data["fork_reused"]
    assert not any(tmp_path.rglob("archive")), "checkpoint objects left behind"
    config = load_config(None)
    left = (
        PodmanBackend(config.sandbox, config.state_dir)
        .podman("ps", "-a", "--filter", "label=belayer.bench=fork", "--format", "{{.Names}}")
        .stdout.split()
    )
    assert left == [], f"bench sandboxes left running: {left}"
    images = (
        PodmanBackend(config.sandbox, config.state_dir)
        .podman("images", "--format", "{{.Repository}}")
        .stdout.decode()
    )
    assert "belayer-bench-baked" not in images and "belayer-bench-bake" not in images
