"""The sandbox runtime on this host: podman + runc + Belayer's CRIU + the base image.

Real tests against Belayer's own podman storage (the state dir, where the base image
lives): `bash infra/install/sandbox-runtime.sh` as root first. Every container gets a
unique name and is removed in a `finally`.
"""

from __future__ import annotations

import os
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from belayer.sandbox import runtime
from belayer.sandbox.runtime import (
    CRIU_TOOLS_DIR,
    base_image_name,
    check_runtime,
    criu_path,
    criu_version,
    podman_base_args,
    podman_dirs,
    podman_env,
    run_podman,
)
from tests.tiers import needs


def _name(tag: str) -> str:
    return f"belayer-test-{tag}-{uuid.uuid4().hex[:10]}"


def _rm(*names: str) -> None:
    for name in names:
        run_podman("rm", "--force", "--time", "0", "--ignore", name, timeout=60)


def _ok(r: subprocess.CompletedProcess[str]) -> str:
    assert r.returncode == 0, f"{r.args}\nstdout: {r.stdout}\nstderr: {r.stderr}"
    return r.stdout


# ---------------------------------------------------------------- no podman needed


def test_podman_args_and_env_are_belayer_only(tmp_path: Path) -> None:
    args = podman_base_args(tmp_path / "state", tmp_path / "cache")
    dirs = podman_dirs(tmp_path / "state")
    assert args[args.index("--root") + 1] == str(dirs["root"]) == str(tmp_path / "state/podman/root")
    assert args[args.index("--runroot") + 1] == str(tmp_path / "state/podman/runroot")
    assert args[args.index("--tmpdir") + 1] == str(tmp_path / "state/podman/tmp")
    assert f"--runtime-flag=criu={tmp_path / 'cache/bin/criu'}" in args

    env = podman_env(tmp_path / "state", tmp_path / "cache", base={"PATH": "/usr/bin:/bin"})
    for key in ("CONTAINERS_CONF", "CONTAINERS_STORAGE_CONF"):
        assert Path(env[key]).is_file(), key
    conf = Path(env["CONTAINERS_CONF"]).read_text()
    for line in (
        'runtime = "runc"',
        'cgroup_manager = "cgroupfs"',
        'events_logger = "file"',
        '"nofile=20000:20000"',
        '"nproc=32768:32768"',
        'lock_type = "file"',
    ):
        assert line in conf
    # CRIU runs `tar` from PATH for each tmpfs, podman runs `criu` for its version check:
    # ours come first.
    assert env["PATH"].split(os.pathsep)[:2] == [str(CRIU_TOOLS_DIR), str(tmp_path / "cache/bin")]


@pytest.mark.usefixtures("local_processes")
def test_defaults_follow_belayer_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("BELAYER_STATE_DIR", str(tmp_path / "s"))
    monkeypatch.setenv("BELAYER_CACHE_DIR", str(tmp_path / "c"))
    assert podman_dirs()["runroot"] == tmp_path / "s/podman/runroot"
    assert criu_path() == tmp_path / "c/bin/criu"
    assert criu_version(tmp_path / "c/bin/criu") == ()  # missing: empty, no exception


# ---------------------------------------------------------------- the real runtime


@pytest.fixture(scope="module")
@needs("sandbox")
def health() -> runtime.RuntimeHealth:
    return check_runtime()


def test_runtime_healthy(health: runtime.RuntimeHealth) -> None:
    assert health.ok, health.summary()
    assert health.is_root
    assert health.criu_version >= runtime.criu_min_version()
    assert health.criu_check_ok, health.criu_check_output
    assert health.image == base_image_name()
    assert health.image_id


def test_podman_uses_belayer_storage_and_runc(health: runtime.RuntimeHealth) -> None:
    if not health.can_run:
        pytest.fail(health.summary())
    out = _ok(
        run_podman(
            "info",
            "--format",
            "{{.Host.OCIRuntime.Name}}|{{.Store.GraphRoot}}|{{.Store.RunRoot}}|{{.Host.CgroupManager}}",
        )
    )
    name, graphroot, runroot, cgroup_manager = out.strip().split("|")
    dirs = podman_dirs()
    assert name == "runc"
    assert Path(graphroot) == dirs["root"]
    assert Path(runroot) == dirs["runroot"]
    assert cgroup_manager == "cgroupfs"


def test_echo_in_base_image(health: runtime.RuntimeHealth) -> None:
    if not health.can_run:
        pytest.fail(health.summary())
    name = _name("echo")
    token = uuid.uuid4().hex
    try:
        out = _ok(
            run_podman(
                "run",
                "--name",
                name,
                "--network=none",
                base_image_name(),
                "sh",
                "-c",
                f"echo {token}; ulimit -n; cat /etc/debian_version; python3 -c 'print(6*7)'",
            )
        )
        lines = out.split()
        assert lines[0] == token
        assert lines[1] == "20000"  # default_ulimits from Belayer's containers.conf
        assert lines[2].startswith("12.")  # bookworm
        assert lines[3] == "42"
    finally:
        _rm(name)


def _signal_and_read(name: str, path: str, timeout: float = 10.0) -> int:
    """Ask the shell (USR1 trap) to write its in-memory counter to `path`, read it."""
    _ok(run_podman("exec", name, "rm", "-f", path))
    _ok(run_podman("kill", "--signal", "USR1", name))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r = run_podman("exec", name, "cat", path)
        if r.returncode == 0 and r.stdout.strip():
            return int(r.stdout.strip())
        time.sleep(0.1)
    raise AssertionError(f"{name}: no answer in {path}")


def test_checkpoint_export_and_restore_import(health: runtime.RuntimeHealth, tmp_path: Path) -> None:
    if not health.can_checkpoint:
        pytest.fail(health.summary())
    src, dst = _name("ckpt"), _name("restored")
    archive = tmp_path / "ckpt.tar.zst"
    token = uuid.uuid4().hex
    # A sleeping shell (PID 1) whose state lives only in its memory: a counter it
    # bumps between sleeps, and a token. A file in the rootfs diff travels too.
    script = (
        f"tok={token}; n=0; echo $$ > /tmp/pid; "
        "trap 'echo $n > /tmp/n.$tok' USR1; "
        "while :; do n=$((n+1)); sleep 0.05; done"
    )
    try:
        _ok(run_podman("run", "-d", "--name", src, "--network=none", base_image_name(), "bash", "-c", script))
        time.sleep(0.5)
        before = _signal_and_read(src, f"/tmp/n.{token}")
        assert before > 0

        t0 = time.monotonic()
        _ok(run_podman("container", "checkpoint", f"--export={archive}", src, timeout=120))
        t_ckpt = time.monotonic() - t0
        assert archive.stat().st_size > 0
        state = _ok(run_podman("inspect", "--format", "{{.State.Status}}", src)).strip()
        assert state == "exited"  # checkpointed without --leave-running

        t0 = time.monotonic()
        _ok(run_podman("container", "restore", f"--import={archive}", "--name", dst, timeout=120))
        t_restore = time.monotonic() - t0
        assert _ok(run_podman("inspect", "--format", "{{.State.Status}}", dst)).strip() == "running"

        after = _signal_and_read(dst, f"/tmp/n.{token}")
        # The counter went on from where it was: the process was restored, not restarted.
        assert after >= before, (before, after)
        assert _ok(run_podman("exec", dst, "cat", "/tmp/pid")).strip() == "1"
        print(
            f"checkpoint --export {t_ckpt:.2f}s, restore --import {t_restore:.2f}s, "
            f"archive {archive.stat().st_size} bytes"
        )
    finally:
        _rm(src, dst)


def test_podman_and_runc_call_belayers_criu(health: runtime.RuntimeHealth, tmp_path: Path) -> None:
    """Both podman's own version check and runc's dump/restore go through criu_path()."""
    if not health.can_checkpoint:
        pytest.fail(health.summary())
    # A cache dir whose bin/criu logs each call, then runs Belayer's real CRIU.
    calls = tmp_path / "calls.log"
    spy = tmp_path / "cache" / "bin" / "criu"
    spy.parent.mkdir(parents=True)
    spy.write_text(f'#!/bin/sh\necho "$(cat /proc/$PPID/comm) $*" >> {calls}\nexec {criu_path()} "$@"\n')
    spy.chmod(0o755)
    cache = tmp_path / "cache"
    src, dst = _name("spy"), _name("spy-restored")
    archive = tmp_path / "spy.tar"
    try:
        _ok(
            run_podman(
                "run",
                "-d",
                "--name",
                src,
                "--network=none",
                base_image_name(),
                "sleep",
                "1000",
                cache_dir=cache,
            )
        )
        _ok(run_podman("container", "checkpoint", f"--export={archive}", src, cache_dir=cache, timeout=120))
        dumped = calls.read_text().splitlines()
        _ok(
            run_podman(
                "container", "restore", f"--import={archive}", "--name", dst, cache_dir=cache, timeout=120
            )
        )
        restored = calls.read_text().splitlines()[len(dumped) :]
    finally:
        _rm(src, dst)
    # Each line: the caller's name, then criu's arguments. podman asks for the version
    # (over RPC: `criu swrk <fd>`) before it asks runc, which runs the dump/restore.
    print("criu calls:", dumped, restored)
    for phase in (dumped, restored):
        callers = {line.split()[0] for line in phase if " swrk " in f"{line} "}
        assert {"podman", "runc"} <= callers, phase


@pytest.mark.parametrize("reached_by", ["its directory", "a symlink with a space in its path"])
@pytest.mark.usefixtures("local_processes")
def test_criu_tar_drops_gzip_from_dumps_and_reads_either_kind(tmp_path, reached_by):
    """CRIU's `tar --create --gzip` of a tmpfs runs with the container frozen: Belayer's tar
    (first on podman's PATH) writes it plain, and extracts plain and gzip images alike. It
    finds the real tar however PATH names its own directory."""
    tools = CRIU_TOOLS_DIR
    if reached_by != "its directory":
        tools = tmp_path / "criu tools"
        tools.symlink_to(CRIU_TOOLS_DIR)
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "file").write_text("state\n")
    env = {**os.environ, "PATH": f"{tools}{os.pathsep}{os.environ['PATH']}"}
    image = subprocess.run(
        ["tar", "--create", "--gzip", "--directory", str(tmp_path / "src"), "."],
        env=env,
        capture_output=True,
        check=True,
        timeout=30,
    ).stdout
    assert image[257:262] == b"ustar"  # a plain tar, not gzip (which starts 1f 8b)
    gzipped = subprocess.run(
        ["tar", "--create", "--gzip", "--directory", str(tmp_path / "src"), "."],
        capture_output=True,
        check=True,
    ).stdout  # the system's tar
    assert gzipped[:2] == b"\x1f\x8b"
    for kind, data in (("plain", image), ("gzip", gzipped)):
        # A pipe; a file at its start (what CRIU hands over: tar is given it by name); a
        # file already read into, which must be read on from where it is.
        for stdin in ("pipe", "file", "file read into"):
            out = tmp_path / f"{kind}-{stdin}"
            out.mkdir()
            _extract_with(env, out, data, stdin)
            assert (out / "file").read_text() == "state\n", (kind, stdin)


def _extract_with(env: dict, out: Path, data: bytes, stdin: str) -> None:
    extract = ["tar", "--extract", "--gzip", "--directory", str(out)]
    if stdin == "pipe":
        subprocess.run(extract, input=data, env=env, check=True, timeout=30)
        return
    junk = b"x" * 100 if stdin == "file read into" else b""
    image = out.with_suffix(".img")
    image.write_bytes(junk + data)
    with open(image, "rb", buffering=0) as f:
        f.seek(len(junk))
        subprocess.run(extract, stdin=f, env=env, check=True, timeout=30)


@pytest.mark.usefixtures("local_processes")
def test_criu_tar_says_so_when_no_other_tar_is_on_path(tmp_path):
    env = {**os.environ, "PATH": str(CRIU_TOOLS_DIR)}
    done = subprocess.run(
        ["/bin/sh", str(CRIU_TOOLS_DIR / "tar"), "--version"], env=env, capture_output=True, timeout=30
    )
    assert done.returncode == 127
    assert b"no tar on PATH besides this one" in done.stderr
