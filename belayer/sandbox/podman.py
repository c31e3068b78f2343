"""Podman + runc + CRIU backend (the podman CLI) and the podman/CRIU error translator.

Why the CLI and not podman's REST API: the REST API needs a long-lived
`podman system service` started with Belayer's global flags (--root, --runroot,
--runtime-flag=criu=...), one more process to supervise on every host; the CLI takes
those flags per call from belayer/sandbox/runtime.py, checkpoint --export streams
cleanly to an inherited fd (docs/design.md §7), and the per-call cost (~0.1 s) only hits
lifecycle operations: actions go over the supervisor's socket, not through podman.

Every podman call goes through `runtime.podman_command()` / `runtime.podman_env()`:
Belayer's containers.conf, storage under the state dir, Belayer's CRIU -- never the
user's own podman setup.

Isolation of each container:
* users: a user namespace, the same fixed map on every host (`--uidmap=0:200000:65536`,
  `--gidmap` alike; a restore on another host needs the same map, and `--userns=auto`
  needs /etc/subuid): the container's root is host uid 200000, which owns nothing of the
  host's. Inside, PID 1 (the supervisor) is root with DAC_OVERRIDE, CHOWN, FOWNER, SETUID,
  SETGID and KILL only (to reach the journal and channel of uid 999, to run each action
  as the agent, uid 1000, and the reward check as the verifier, uid 1001, and to stop and
  kill their processes; FOWNER is for Belayer's `podman exec` helpers, which share the
  container's set: the tar that restores a file-system snapshot sets the modes and times
  of the agent's files). The agent holds no capability, owns /workspace and /home/agent, and
  cannot read, signal or trace the verifier's processes and files, nor PID 1's
  (infra/sandbox/supervisor.py says the rest); no-new-privileges keeps every exec from
  gaining anything;
* network: `--network=none`, a namespace of the container's own with loopback only. runc
  makes it inside the user namespace (a namespace made beforehand on the host, which is
  the host's user namespace's, can be neither joined by `podman exec` nor dumped by
  CRIU); a restore asks CRIU for a new one, whose loopback the CRIU action script brings
  up (infra/podman/criu-action-script);
* system calls: Belayer's seccomp profile, podman's default without keyrings, BPF,
  io_uring, userfaultfd and new namespaces (belayer/sandbox/seccomp.py says why each);
* memory (tmpfs included, swap off), cpus and pids limits;
* disk: the root file system is read-only (the agent cannot fill the host's disk
  through the overlay: overlay size= needs XFS) unless `sandbox.read_only_root` is off (a
  task's own image that expects to write there); /workspace, /home/agent, /tmp,
  /var/tmp, /run, /run/lock, /dev/shm and the journal /var/lib/belayer are size-limited
  tmpfs, which travel inside the checkpoint and count against the memory limit (without
  our sizes, --read-only's /run would be half the host's memory); /run and /run/lock are
  the agent's to write, as /tmp is (PID 1 makes them 1777: podman gives them the image's
  modes, whatever `mode=` says);
* environment: no proxy variables of the host's (--http-proxy=false);
* the channel: a host directory (host uid 200999: uid 999 inside, 0700) bind-mounted at
  /run/belayer;
* Belayer's own programs: PID 1, the helper that starts each action and the workspace
  hash run from the trusted toolchain, a host directory mounted read-only at /.belayer,
  never from the image's python3 (belayer/sandbox/toolchain.py says why and how).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import shutil
import subprocess
import tarfile
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from belayer.sandbox import compression, fork_archive, runtime, seccomp, toolchain
from belayer.sandbox.backend import BackendHealth, ContainerExit, ContainerFacts
from belayer.sandbox.dump_watchdog import DumpWatchdog
from belayer.sandbox.errors import (
    CheckpointFailed,
    PodmanFailed,
    RestoreFailed,
    RuntimeUnavailable,
    SandboxError,
    SandboxNotFound,
)
from belayer.sandbox.images import ImageBuilder
from belayer.sandbox.models import ImageSemantics, checked_sandbox_id, path_under

if TYPE_CHECKING:  # config.py validates `sandbox.backend` against the registry, which imports this
    from belayer.sandbox.config import SandboxConfig

GUARD_UID = 999  # owner of the journal and channel (see the supervisor)
# The user namespace of every sandbox: container uid/gid N is host uid/gid USERNS_BASE + N.
# Fixed, and the same on every host: a checkpoint restores only under the map it was made with.
USERNS_BASE = 200000
USERNS_SIZE = 65536
LABEL_SANDBOX = "belayer.sandbox"
LABEL_GENERATION = "belayer.generation"
CAPS = "DAC_OVERRIDE,CHOWN,FOWNER,SETUID,SETGID,KILL"
CHUNK = 1 << 20


def translate_podman_error(args: list[str], returncode: int, stderr: str) -> SandboxError:
    """The one translator from a failed podman/CRIU call to a typed sandbox error."""
    words = [a for a in args if not a.startswith("-")]
    verb = words[1] if len(words) > 1 and words[0] == "container" else (words[0] if words else "?")
    text = " ".join(stderr.split())[-2000:]
    where = f"podman {' '.join(a for a in args if not a.startswith('--root'))[:200]}"
    low = text.lower()
    if "no container with name or id" in low or "no such container" in low:
        return SandboxNotFound(
            f"{where}: container not found ({text}); it was destroyed or lives on another host"
        )
    if "image not known" in low or "unable to find image" in low:
        return RuntimeUnavailable(
            f"{where}: base image missing ({text}); run `bash infra/install/base-image.sh` as root on this host"
        )
    if "criu" in low and ("version" in low or "not found" in low or "executable" in low):
        return RuntimeUnavailable(
            f"{where}: CRIU unusable ({text}); run `bash infra/install/criu.sh` as root"
        )
    if verb == "checkpoint":
        return CheckpointFailed(f"{where}: checkpoint failed (exit {returncode}): {text}{criu_errors(text)}")
    if verb == "restore":
        return RestoreFailed(f"{where}: restore failed (exit {returncode}): {text}{criu_errors(text)}")
    return PodmanFailed(f"{where}: exit {returncode}: {text}")


def criu_errors(text: str) -> str:
    """CRIU's own error lines from the log podman's message names (`log file: PATH`), which
    say what could not be dumped or restored where podman says only `criu failed`."""
    m = re.search(r"log file: (\S+?\.log)", text)
    if not m:
        return ""
    try:
        lines = Path(m.group(1)).read_text(errors="replace").splitlines()
    except OSError:
        return ""
    errors = [line.strip() for line in lines if "Error" in line][-3:]
    return f"; CRIU: {' | '.join(errors)}" if errors else ""


class PodmanBackend:
    """Sandbox containers under Belayer's own podman storage (rootful, runc, CRIU)."""

    name = "podman"

    def __init__(self, cfg: SandboxConfig, state_dir: Path, cache_dir: Path | None = None, *,
                 command_prefix: Sequence[str] = ()):  # fmt: skip
        self.cfg = cfg
        self.state_dir = Path(state_dir)
        self.cache_dir = cache_dir
        self.command_prefix = list(command_prefix)  # `nsenter` into another host's namespaces (backend.py)
        self._image_ids: dict[str, str] = {}  # the base image's id, once found
        self._versions: dict[str, str] | None = None
        self._seccomp_profile: Path | None = None

    # ------------------------------------------------------------------ plumbing
    def _cmd(self, *args: str) -> list[str]:
        return [
            *self.command_prefix,
            *runtime.podman_command(*args, state_dir=self.state_dir, cache_dir=self.cache_dir),
        ]

    def _env(self) -> dict[str, str]:
        return runtime.podman_env(self.state_dir, self.cache_dir)

    def podman(self, *args: str, check: bool = True, input: bytes | None = None,
               env: dict[str, str] | None = None) -> subprocess.CompletedProcess:  # fmt: skip
        """podman with Belayer's flags, in `env` (default: Belayer's, `runtime.podman_env`)."""
        # In the state dir: conmon writes an `oom` file into the directory podman ran in when
        # a process of the container is OOM-killed (a checkout or the user's cwd otherwise).
        self.state_dir.mkdir(parents=True, exist_ok=True)
        try:
            r = subprocess.run(
                self._cmd(*args), env=env or self._env(), capture_output=True, input=input, cwd=self.state_dir,
                stdin=None if input is not None else subprocess.DEVNULL, timeout=self.cfg.podman_timeout_s,
            )  # fmt: skip
        except FileNotFoundError as exc:
            raise RuntimeUnavailable(
                f"podman is not installed ({exc}): run infra/install/podman.sh as root"
            ) from exc
        except subprocess.TimeoutExpired as exc:
            raise PodmanFailed(
                f"podman {args[0]} did not finish in {self.cfg.podman_timeout_s:g}s "
                "(sandbox.podman_timeout_s)"
            ) from exc
        if check and r.returncode != 0:
            raise translate_podman_error(list(args), r.returncode, r.stderr.decode(errors="replace"))
        return r

    @staticmethod
    def container_name(sandbox_id: str, generation: int) -> str:
        return f"{sandbox_id}-g{generation}"

    def channel_dir(self, sandbox_id: str) -> Path:
        """The lineage's channel directory, inside `channel_root` (destroy removes it)."""
        return path_under(self.cfg.channel_root, checked_sandbox_id(sandbox_id))

    def channel_path(self, sandbox_id: str) -> Path:
        return self.channel_dir(sandbox_id) / "supervisor.sock"

    def ensure_host_side(self, sandbox_id: str) -> None:
        """The channel directory of a lineage, owned by the guard's uid as the host sees it."""
        d = self.channel_dir(sandbox_id)
        d.mkdir(parents=True, exist_ok=True)
        os.chown(d, host_id(GUARD_UID), host_id(GUARD_UID))
        os.chmod(d, 0o700)
        with contextlib.suppress(FileNotFoundError):
            (d / "supervisor.sock").unlink()

    # ------------------------------------------------------------------ lifecycle
    def create(
        self, sandbox_id: str, generation: int, labels: dict[str, str], image: str | None = None,
        semantics: ImageSemantics | None = None,
    ) -> str:  # fmt: skip
        self.ensure_host_side(sandbox_id)
        name = self.container_name(sandbox_id, generation)
        c = self.cfg
        memory_mb = semantics.memory_mb if semantics is not None and semantics.memory_mb else c.memory_mb
        # A task's own limits; its CPUs at most this host's (podman refuses more than there are).
        cpus = (
            min(semantics.cpus, os.cpu_count() or 1) if semantics is not None and semantics.cpus else c.cpus
        )
        args = [
            "run", "-d", "--name", name, "--hostname", "sandbox",
            "--label", f"{LABEL_SANDBOX}={sandbox_id}", "--label", f"{LABEL_GENERATION}={generation}",
            f"--uidmap=0:{USERNS_BASE}:{USERNS_SIZE}", f"--gidmap=0:{USERNS_BASE}:{USERNS_SIZE}",
            "--network=none", f"--annotation=org.criu.config={runtime.CRIU_CONFIG}",
            "--cap-drop=ALL", f"--cap-add={CAPS}", "--security-opt=no-new-privileges",
            f"--security-opt=seccomp={self.seccomp_profile()}", "--http-proxy=false",
            f"--memory={memory_mb}m", f"--memory-swap={memory_mb}m", f"--cpus={cpus:g}",
            f"--pids-limit={c.pids_limit}", f"--shm-size={c.shm_mb}m",
            "--tmpfs", f"/run:rw,size={c.run_mb}m,mode=0755",
            "--tmpfs", f"/workspace:rw,exec,size={c.workspace_mb}m,mode=0755",
            "--tmpfs", f"/home/agent:rw,exec,size={c.home_mb}m,mode=0755",
            "--tmpfs", f"/tmp:rw,exec,size={c.tmp_mb}m,mode=1777",
            "--tmpfs", "/var/tmp:rw,size=16m,mode=1777",
            "--tmpfs", "/run/lock:rw,size=1m,mode=1777",
            "--tmpfs", f"/var/lib/belayer:rw,size={c.journal_mb}m,mode=0700",
            "-v", f"{self.channel_dir(sandbox_id)}:/run/belayer",
        ]  # fmt: skip
        if semantics is None:
            args += ["--read-only"] if c.read_only_root else []
        else:
            args += self._semantics_args(image or c.image, semantics)
        args += self._toolchain_args()
        for k, v in labels.items():
            args += ["--label", f"{k}={v}"]
        self.podman(*args, image or c.image, *toolchain.supervisor_argv())
        return name

    def _semantics_args(self, image: str, semantics: ImageSemantics) -> list[str]:
        """A task's own image run as it was built (models.ImageSemantics): PID 1 still root
        (`--user=0:0`, whatever the image's USER), told through its environment whom the
        agent and the verifier are, where the agent works and the environment it starts
        with (the image's, then the task's); the root file system writable."""
        user, image_env = self._image_config(image)
        env = dict(image_env, **semantics.env)
        told = {
            "BELAYER_AGENT_USER": semantics.agent_user or user or "0",
            "BELAYER_VERIFIER_USER": semantics.verifier_user,
            "BELAYER_AGENT_ENV": json.dumps(env, sort_keys=True),
            "BELAYER_WORKSPACE": semantics.workdir,
            "BELAYER_HAND_OVER": "0",
        }
        return ["--user=0:0", *(f"--env={k}={v}" for k, v in told.items())]

    def _image_config(self, image: str) -> tuple[str, dict[str, str]]:
        """The image's USER and ENV, as its build left them."""
        r = self.podman("image", "inspect", "--format", "{{json .Config}}", image)
        config = json.loads(r.stdout.decode() or "{}") or {}
        env = dict(entry.split("=", 1) for entry in config.get("Env") or [] if "=" in entry)
        return config.get("User") or "", env

    def _toolchain_args(self) -> list[str]:
        """Belayer's trusted toolchain read-only at /.belayer, and the environment its
        programs run with (PID 1's and each `podman exec`'s): belayer/sandbox/toolchain.py."""
        source = self.cfg.toolchain_dir or toolchain.installed(self.cache_dir)
        if not source or not Path(source, "supervisor.py").is_file():
            raise RuntimeUnavailable(
                f"no trusted toolchain {'at ' + str(source) if source else 'for this checkout'} "
                f"(sandbox.toolchain_dir): run `bash infra/install/toolchain.sh` as root"
            )
        env = [f"--env={k}={v}" for k, v in toolchain.ENVIRONMENT.items()]
        return ["-v", f"{source}:{toolchain.MOUNT}:ro", *env]

    def image_builder(self) -> ImageBuilder:
        """Builds task images (belayer/sandbox/images.py) into this host's podman storage."""
        return ImageBuilder(self.cfg.base_images, self.state_dir, self.cache_dir)

    def seccomp_profile(self) -> Path:
        """Belayer's profile (belayer/sandbox/seccomp.py), written from this host's default
        once per backend. Restores and forks need no file: the filter travels in the checkpoint."""
        if self._seccomp_profile is None:
            self._seccomp_profile = seccomp.write_profile(runtime.seccomp_profile_path(self.state_dir))
        return self._seccomp_profile

    def is_running(self, container: str) -> bool:
        r = self.podman("container", "inspect", "--format", "{{.State.Running}}", container, check=False)
        return r.returncode == 0 and r.stdout.strip() == b"true"

    def kill(self, container: str) -> None:
        self.podman("kill", container, check=False)

    def exit_state(self, container: str, settle_s: float = 10.0) -> ContainerExit:
        """How `container` ended, once podman has seen it end (up to `settle_s`: its state
        lags the death of PID 1 by tens of milliseconds), and whether anyone on this host
        stopped it: podman logs every `podman kill` and `podman stop` as an event,
        whoever ran it (the host, chaos, an operator)."""
        deadline = time.monotonic() + settle_s
        while True:
            r = self.podman("container", "inspect", "--format",
                            "{{.Id}} {{.State.Status}} {{.State.ExitCode}} {{.State.OOMKilled}}", container,
                            check=False)  # fmt: skip
            fields = r.stdout.decode().split()
            if r.returncode != 0 or len(fields) != 4:
                return ContainerExit(found=False)
            container_id, status, exit_code, oom_killed = fields
            if status not in ("running", "stopping") or time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        events = self.podman("events", "--stream=false", "--filter", f"container={container_id}",
                             "--filter", "event=kill", "--filter", "event=stop", "--format", "{{.Status}}",
                             check=False)  # fmt: skip
        return ContainerExit(found=True, running=status in ("running", "stopping"), exit_code=int(exit_code),
                             oom_killed=oom_killed == "true",
                             stopped_from_outside=tuple(events.stdout.decode().split()))  # fmt: skip

    def memory_cgroup(self, container: str) -> Path | None:
        """The file where the kernel counts the OOM kills in `container`'s memory cgroup
        (cgroup v1 `memory.oom_control`, v2 `memory.events`); None when it cannot be
        found. Read it before the container is cleaned up: podman removes the cgroup
        a fraction of a second after PID 1 dies."""
        r = self.podman("container", "inspect", "--format", "{{.State.Pid}}", container, check=False)
        pid = r.stdout.decode().strip()
        if r.returncode != 0 or not pid.isdigit() or pid == "0":
            return None
        try:
            lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
        except OSError:
            return None
        for line in lines:
            _, controllers, path = line.split(":", 2)
            if "memory" in controllers.split(","):
                candidate = Path("/sys/fs/cgroup/memory", path.lstrip("/"), "memory.oom_control")
                if candidate.exists():
                    return candidate
        unified = next((line.split(":", 2)[2] for line in lines if line.startswith("0::")), None)
        candidate = Path("/sys/fs/cgroup", (unified or "").lstrip("/"), "memory.events")
        return candidate if unified is not None and candidate.exists() else None

    def containers_of(self, sandbox_id: str) -> list[str]:
        r = self.podman(
            "ps", "-a", "--filter", f"label={LABEL_SANDBOX}={sandbox_id}", "--format", "{{.Names}}"
        )
        return r.stdout.decode().split()

    def container_facts(self) -> list[ContainerFacts]:
        listed = self.podman("ps", "-a", "--size", "--filter", f"label={LABEL_SANDBOX}", "--format", "json")
        facts = []
        for container in json.loads(listed.stdout or b"[]"):
            name = container["Names"][0]
            running = container.get("State") == "running"
            facts.append(ContainerFacts(
                name=name, sandbox_id=container.get("Labels", {}).get(LABEL_SANDBOX, ""), running=running,
                created=float(container.get("Created") or 0), disk_bytes=(container.get("Size") or {}).get("rwSize"),
                memory_bytes=self._memory_in_use(name) if running else None,
            ))  # fmt: skip
        return facts

    def disk_used(self, container: str) -> int | None:
        inspected = self.podman(
            "container", "inspect", "--size", "--format", "{{.SizeRw}}", container, check=False
        )
        size = inspected.stdout.decode().strip()
        return int(size) if inspected.returncode == 0 and size.isdigit() else None

    def _memory_in_use(self, container: str) -> int | None:
        """Bytes the container's memory cgroup holds now (cgroup v2 memory.current, v1 usage_in_bytes)."""
        counter = self.memory_cgroup(container)
        if counter is None:
            return None
        name = "memory.current" if counter.name == "memory.events" else "memory.usage_in_bytes"
        try:
            return int((counter.parent / name).read_text())
        except (OSError, ValueError):
            return None

    def lineages(self) -> dict[str, list[str]]:
        r = self.podman("ps", "-a", "--filter", f"label={LABEL_SANDBOX}",
                        "--format", f'{{{{index .Labels "{LABEL_SANDBOX}"}}}} {{{{.Names}}}}')  # fmt: skip
        out: dict[str, list[str]] = {}
        for line in r.stdout.decode().splitlines():
            sandbox_id, _, name = line.partition(" ")
            if sandbox_id and name:
                out.setdefault(sandbox_id, []).append(name)
        return out

    def fence(self, sandbox_id: str) -> list[str]:
        names = self.containers_of(sandbox_id)
        if names:
            self.podman("rm", "-f", "-t", "0", *names, check=False)
        return names

    def destroy(self, sandbox_id: str) -> None:
        self.fence(sandbox_id)
        shutil.rmtree(self.channel_dir(sandbox_id), ignore_errors=True)
        runtime.fork_criu_config(sandbox_id, self.state_dir).unlink(missing_ok=True)

    # ------------------------------------------------------------------ checkpoint / restore
    @contextlib.contextmanager
    def checkpoint_stream(self, container: str, phases: dict[str, float] | None = None
                          ) -> Iterator[Iterator[bytes]]:  # fmt: skip
        """`checkpoint --export=/dev/fd/N` on a pipe: a clean archive stream (docs/design.md §7).

        podman writes it plain; the configured compressor, when there is one, reads the
        pipe and the stream is its output (belayer/sandbox/compression.py says why).
        `phases` gets podman's own figures once the stream has ended (`dump_phases`).
        """
        compress = compression.compressor(self.cfg.checkpoint_compression)
        tmp_dir = self.state_dir / "tmp"
        tmp_dir.mkdir(parents=True, exist_ok=True)
        with contextlib.ExitStack() as files:
            stats, err, compress_err = (
                files.enter_context(tempfile.TemporaryFile(dir=tmp_dir)) for _ in range(3)
            )
            args, procs, reader = self._start_export(container, compress, stats, err, compress_err)
            watchdog = files.enter_context(DumpWatchdog(procs[0].pid, container))
            chunks = iter(lambda: reader.read(CHUNK), b"")
            try:
                yield chunks
                for _ in chunks:  # drain whatever the consumer left
                    pass
                rcs = [p.wait(timeout=self.cfg.podman_timeout_s) for p in procs]
            except BaseException:
                _kill(procs)
                raise
            finally:
                reader.close()
            stats_text, stderr, compress_stderr = (_read_all(f) for f in (stats, err, compress_err))
        watchdog.raise_if_wedged()
        if rcs[0] != 0:
            raise translate_podman_error(args, rcs[0], stderr)
        if compress and rcs[1] != 0:
            raise CheckpointFailed(
                f"`{' '.join(compress)}` failed on the checkpoint of {container} "
                f"(exit {rcs[1]}): {compress_stderr[-300:]}"
            )
        if phases is not None:
            phases.update(dump_phases(stats_text))

    def _start_export(self, container: str, compress: list[str] | None, stats, err, compress_err):
        """podman exporting `container` into a pipe, and the compressor reading it when there
        is one: (podman's args, the processes, the stream's reader). Nothing stays open or
        running when this raises."""
        r, w = os.pipe()
        args = [
            "container", "checkpoint", "--leave-running", "--tcp-established", "--print-stats",
            "-c", "none", f"--export=/dev/fd/{w}", container,
        ]  # fmt: skip
        try:
            podman = subprocess.Popen(self._cmd(*args), env=self._env(), stdin=subprocess.DEVNULL, stdout=stats,
                                      stderr=err, pass_fds=(w,))  # fmt: skip
        except BaseException:
            os.close(r)
            raise
        finally:
            os.close(w)
        if not compress:
            return args, [podman], os.fdopen(r, "rb", buffering=0)
        try:
            compressor = subprocess.Popen(compress, stdin=r, stdout=subprocess.PIPE, stderr=compress_err)
        except BaseException:
            _kill([podman])
            raise
        finally:
            os.close(r)
        return args, [podman, compressor], compressor.stdout

    def export_checkpoint(self, container: str, dest: Path, phases: dict[str, float] | None = None) -> None:
        """`checkpoint --export=dest`, plain: the capture half of a staged checkpoint, which
        is compressed and uploaded later, beside the sandbox's next action (host.py)."""
        args = ["container", "checkpoint", "--leave-running", "--tcp-established", "--print-stats",
                "-c", "none", f"--export={dest}", container]  # fmt: skip
        proc = subprocess.Popen(self._cmd(*args), env=self._env(), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, cwd=self.state_dir)  # fmt: skip
        with DumpWatchdog(proc.pid, container) as watchdog:
            try:
                stdout, stderr = proc.communicate(timeout=self.cfg.podman_timeout_s)
            except BaseException:
                _kill([proc])
                raise
        watchdog.raise_if_wedged()
        if proc.returncode != 0:
            raise translate_podman_error(args, proc.returncode, stderr.decode(errors="replace"))
        if phases is not None:
            phases.update(dump_phases(stdout.decode(errors="replace")))

    def restore(self, archive: Path, sandbox_id: str, generation: int) -> str:
        """Start a plain checkpoint archive as this generation's container."""
        if fork_archive.criu_config_of(archive) != str(runtime.CRIU_CONFIG):
            # A fork that closed connections names a configuration of its own, which another
            # host lacks: its restores read the usual one (the same text, by then).
            usual = archive.with_name(f"{archive.stem}-usual-criu-config.tar")
            try:
                fork_archive.with_criu_config(archive, usual, str(runtime.CRIU_CONFIG))
                return self._restore(usual, sandbox_id, generation)
            finally:
                usual.unlink(missing_ok=True)
        return self._restore(archive, sandbox_id, generation)

    def _restore(self, archive: Path, sandbox_id: str, generation: int) -> str:
        self.ensure_host_side(sandbox_id)
        name = self.container_name(sandbox_id, generation)
        if not holds_established_tcp(archive):
            self.podman("container", "restore", f"--import={archive}", f"--name={name}")
            return name
        # podman 4.3 refuses --name with --tcp-established: restore under the archived
        # name (its container was fenced), then rename to this generation's name (one more
        # podman call, ~0.1 s, so only when a connection needs it).
        r = self.podman("container", "restore", "--tcp-established", f"--import={archive}")
        restored = r.stdout.decode().strip().splitlines()[-1] if r.stdout.strip() else ""
        if self.podman("rename", restored, name, check=False).returncode != 0:
            return self._name_of(restored)
        return name

    def fork(self, plain_archive: Path, parent_id: str, sandbox_id: str, generation: int) -> str:
        """Start another lineage's checkpoint as `sandbox_id` (belayer/sandbox/fork_archive.py):
        its own channel, container id, labels and hostname."""
        self.ensure_host_side(sandbox_id)
        name = self.container_name(sandbox_id, generation)
        identity = fork_archive.ForkIdentity(
            parent_channel_dir=str(self.channel_dir(parent_id)), channel_dir=str(self.channel_dir(sandbox_id)),
            hostname=sandbox_id, labels={LABEL_SANDBOX: sandbox_id, LABEL_GENERATION: str(generation)},
        )  # fmt: skip
        archive = plain_archive.with_name(f"fork-{sandbox_id}.tar")
        # A connection cannot have two owners: each fork starts with the parent's established
        # connections closed (their ends see a reset, as after a network blip); listeners stay.
        # podman 4.3 has no --tcp-close: CRIU's own option, in the configuration runc hands it.
        # A fork of a fork names the usual configuration, never its parent's own (which goes
        # with the parent).
        closing = holds_established_tcp(plain_archive)
        config = runtime.write_fork_criu_config(sandbox_id, self.state_dir, closing=True) if closing else None
        identity = dataclasses.replace(identity, criu_config=str(config or runtime.CRIU_CONFIG))
        try:
            fork_archive.write_fork(plain_archive, archive, identity)
            self.podman("container", "restore", f"--import={archive}", "--name", name)
        finally:
            archive.unlink(missing_ok=True)
            if closing:  # its dumps from now on keep its connections, as any sandbox's
                runtime.write_fork_criu_config(sandbox_id, self.state_dir, closing=False)
        self._set_hostname(name, sandbox_id)
        return name

    def _set_hostname(self, container: str, hostname: str) -> None:
        # CRIU restores the parent's UTS namespace content; the spec's hostname only
        # reaches /etc/hostname. Set the kernel's from outside (the container has no
        # CAP_SYS_ADMIN, so nothing inside can change it back).
        pid = (
            self.podman("container", "inspect", "--format", "{{.State.Pid}}", container)
            .stdout.decode()
            .strip()
        )
        r = subprocess.run(["nsenter", f"--target={pid}", "--uts", "hostname", hostname], capture_output=True)
        if r.returncode != 0:
            raise RestoreFailed(f"could not set the hostname of fork {container}: {r.stderr.decode()[-300:]}")

    def _name_of(self, container: str) -> str:
        return self.podman("container", "inspect", "--format", "{{.Name}}", container).stdout.decode().strip()

    def exec_as_root(self, container: str, argv: list[str], stdin: bytes | None = None) -> bytes:
        # Belayer's own helpers (hash, tar), as the container's root with its capabilities
        # (FOWNER: tar restores the modes and times of the agent's files); they touch only
        # the agent's trees.
        args = ["exec"] + (["-i"] if stdin is not None else []) + [container]
        return self.podman(*args, *argv, input=stdin).stdout

    def image_id(self, image: str | None = None) -> str:
        """Asked of podman each time for a task's image (one may be removed or loaded at any
        time); the base image's, which only an install changes, once."""
        name = image or self.cfg.image
        if name in self._image_ids:
            return self._image_ids[name]
        r = self.podman("image", "inspect", "--format", "{{.Id}}", name, check=False)
        found = r.stdout.decode().strip() if r.returncode == 0 else ""
        if found and name == self.cfg.image:
            self._image_ids[name] = found
        return found

    def established_tcp_sockets(self, plain_archive: Path) -> int:
        return established_tcp_sockets(plain_archive)

    def container_image(self, container: str) -> str | None:
        r = self.podman("container", "inspect", "--format", "{{.ImageName}}", container, check=False)
        return r.stdout.decode().strip() or None if r.returncode == 0 else None

    def save_image(self, image: str, dest: Path) -> None:
        self.podman("save", "--format", "docker-archive", "-o", str(dest), image)

    def load_image(self, src: Path) -> None:
        self.podman("load", "-i", str(src))

    def versions(self) -> dict[str, str]:
        if self._versions is None:
            r = self.podman("version", "--format", "{{.Client.Version}}", check=False)
            criu = ".".join(map(str, runtime.criu_version(runtime.criu_path(self.cache_dir))))
            self._versions = {"podman": r.stdout.decode().strip() or "?", "criu": criu or "?"}
        return self._versions

    def health(self) -> BackendHealth:
        """podman, runc, Belayer's CRIU, the base image and the toolchain (`runtime.check_runtime`)."""
        found = runtime.check_runtime(self.state_dir, self.cache_dir)
        criu = ".".join(map(str, found.criu_version)) or "missing"
        return BackendHealth(
            problems=list(found.problems),
            summary=f"podman {found.podman_version}, CRIU {criu} ({found.criu_route}), image {found.image}",
            storage=f"podman storage {self.state_dir / 'podman'}",
        )

    # ------------------------------------------------------------------ the benchmark's baseline
    def baseline_checkpoint(self, container: str, archive: Path) -> dict[str, float]:
        """`podman container checkpoint --leave-running -c zstd --export=ARCHIVE`, as a podman
        user writes it, with the system's tools: podman's own phases (`dump_phases`)."""
        r = self.podman("container", "checkpoint", "--leave-running", "--tcp-established", "--print-stats",
                        "-c", "zstd", f"--export={archive}", container, env=self._system_tools_env())  # fmt: skip
        return dump_phases(r.stdout.decode(errors="replace"))

    def baseline_restore(self, container: str, archive: Path) -> None:
        """`podman rm -f` the killed container, then `podman container restore --import=ARCHIVE`."""
        self.podman("rm", "-f", "-t", "0", container, check=False)
        self.podman(
            "container", "restore", "--tcp-established", f"--import={archive}", env=self._system_tools_env()
        )

    def _system_tools_env(self) -> dict[str, str]:
        """Belayer's podman environment without its CRIU tools on PATH: CRIU gzips each tmpfs
        itself, as it does for any podman user (infra/podman/criu-tools/tar says why Belayer's
        own dumps do not)."""
        env = self._env()
        env["PATH"] = os.pathsep.join(
            p for p in env["PATH"].split(os.pathsep) if p != str(runtime.CRIU_TOOLS_DIR)
        )
        return env


def host_id(container_id: int) -> int:
    """The host's uid (or gid) of a sandbox's `container_id`."""
    return USERNS_BASE + container_id


def _kill(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        proc.kill()
        proc.wait()


def _read_all(f) -> str:
    f.seek(0)
    return f.read().decode(errors="replace")


def holds_established_tcp(plain_archive: Path) -> bool:
    """Whether the checkpoint dumped an established TCP connection."""
    return established_tcp_sockets(plain_archive) > 0


def established_tcp_sockets(plain_archive: Path) -> int:
    """The established TCP sockets the checkpoint dumped: CRIU writes one
    `tcp-stream-<inode>.img` per socket (`--tcp-established`; a loopback connection is two
    sockets), none for listeners."""
    try:
        with tarfile.open(plain_archive, "r:") as tar:
            return sum(Path(name).name.startswith("tcp-stream-") for name in tar.getnames())
    except tarfile.TarError as exc:
        raise RestoreFailed(f"{plain_archive.name} is not a readable checkpoint archive: {exc}") from exc


def dump_phases(print_stats: str) -> dict[str, float]:
    """Seconds per phase of a dump, from `podman container checkpoint --print-stats`:

    freeze   -- CRIU stopping every process of the container;
    frozen   -- how long they stayed stopped (the pause the agent's processes see:
                memory, file descriptors, each tmpfs's contents);
    dump     -- runc and CRIU in all, freeze and frozen included;
    archive  -- podman writing the archive around that (the rootfs diff, the tar stream,
                waiting on the pipe while the compressor and the upload read it).

    Empty when podman printed nothing readable: the figures are for reports, never for
    a decision."""
    try:
        stats = json.loads(print_stats)
        container = stats["container_statistics"][0]
        criu = container.get("criu_statistics") or {}
        micro = 1e6  # podman reports microseconds
        return {
            "freeze": criu["freezing_time"] / micro,
            "frozen": criu["frozen_time"] / micro,
            "dump": container["runtime_checkpoint_duration"] / micro,
            "archive": (stats["podman_checkpoint_duration"] - container["runtime_checkpoint_duration"])
            / micro,
        }
    except (ValueError, KeyError, IndexError, TypeError):
        return {}
