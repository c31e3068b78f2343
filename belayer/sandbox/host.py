"""The sandbox host: create, exec, checkpoint, restore, recover, destroy, workspace hash.

One `SandboxHost` per host process (the sandbox worker). It owns no policy about
*when* to checkpoint (belayer/policy) and no Temporal code (belayer/activities): it
turns handles and refs into backend calls, object-store streams and supervisor
requests. Calls on one sandbox are serialised (a checkpoint never overlaps an action:
the supervisor channel must hold no connection while CRIU dumps).

Checkpoint archives and their metadata go to the object store under
`<checkpoint_prefix><sandbox id>/<step>-g<generation>-<nonce>/{archive,meta.json,fs.tar}`,
next to the lineage records (`lineage/g<N>.json`, belayer/sandbox/lineage.py) that let a
host coming back after a recovery elsewhere fence its superseded container.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import logging
import os
import re
import secrets
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, TypeVar

from belayer import faults
from belayer.sandbox import channel, compression, drain, errors, lineage, priority, toolchain
from belayer.sandbox.backend import ContainerExit, SandboxBackend, oom_kills
from belayer.sandbox.backends import open_backend
from belayer.sandbox.config import SandboxConfig
from belayer.sandbox.drain import DrainedSandbox
from belayer.sandbox.errors import (
    CheckpointBlockedByAgent,
    CheckpointCorrupt,
    CheckpointInconsistent,
    HostDraining,
    HostFull,
    InvalidSandboxId,
    JournalMismatch,
    RecoveryImpossible,
    RestoreFailed,
    RuntimeUnavailable,
    SandboxError,
    SandboxNotFound,
    SandboxUnreachable,
    SetupFailed,
    StaleGeneration,
)
from belayer.sandbox.images import ensure_image, share_image
from belayer.sandbox.models import (
    SETUP_TRAJECTORY,
    Action,
    CheckpointMeta,
    CheckpointRef,
    ForkOutcome,
    ForkTarget,
    ImageSemantics,
    LoggedAction,
    Observation,
    RecoverOutcome,
    RecoveryMode,
    SandboxHandle,
    SandboxSpec,
    StagedCheckpoint,
    StoredFiles,
    checked_sandbox_id,
    message_observation,
)
from belayer.sandbox.placement import HostLoad
from belayer.sandbox.reaper import OwnerRecords
from belayer.sandbox.staging import Staging
from belayer.storage.encryption import archive_store
from belayer.storage.errors import CorruptObject, ObjectNotFound, StorageError
from belayer.storage.store import open_store

HASH_SCRIPT = r"""
import hashlib, os, stat, sys
def file_digest(p):
    # Never follow a link, never block on a FIFO or device swapped in after lstat: open
    # without following or waiting, then hash only what is still a regular file.
    try:
        fd = os.open(p, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        return "unreadable:" + type(exc).__name__
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return "not-a-regular-file"
        f = hashlib.sha256()
        for chunk in iter(lambda: os.read(fd, 1 << 20), b""):
            f.update(chunk)
        return f.hexdigest()
    except OSError as exc:
        return "unreadable:" + type(exc).__name__
    finally:
        os.close(fd)
root = sys.argv[1]
h = hashlib.sha256()
for dirpath, dirnames, filenames in os.walk(root):
    dirnames.sort()
    for name in sorted(dirnames + filenames):
        p = os.path.join(dirpath, name)
        rel = os.path.relpath(p, root).encode("utf-8", "surrogateescape")
        st = os.lstat(p)
        mode = stat.S_IMODE(st.st_mode)
        if stat.S_ISLNK(st.st_mode):
            h.update(b"L\0" + rel + b"\0" + os.readlink(p).encode("utf-8", "surrogateescape") + b"\0")
        elif stat.S_ISDIR(st.st_mode):
            h.update(b"D\0" + rel + b"\0" + str(mode).encode() + b"\0")
        elif stat.S_ISREG(st.st_mode):
            digest = file_digest(p)
            h.update(b"F\0" + rel + b"\0" + str(mode).encode() + b"\0" + digest.encode() + b"\0")
        else:
            h.update(b"O\0" + rel + b"\0")
print(h.hexdigest())
"""

# What the fs-only baseline keeps: the agent's writable trees, not processes.
FS_SNAPSHOT_PATHS = ["workspace", "home/agent", "tmp"]
OOM_COUNTERS_KEPT = 1024  # containers whose OOM counter a host remembers (the oldest go first)
T = TypeVar("T")
# One checkpoint's directory under its lineage's prefix, as `_checkpoint_base` names it.
_CHECKPOINT_DIR = re.compile(r"[0-9]{8,}-g[0-9]+-[0-9a-f]{8}/")


@dataclass
class _Archive:
    """An archive as it streamed to the store: its hash, size and when its last byte went."""

    sha256: hashlib._Hash = field(default_factory=hashlib.sha256)
    size: int = 0
    streamed_at: float = field(default_factory=time.monotonic)


class ArchiveStore(Protocol):
    """The slice of belayer.storage.ObjectStore that checkpoints use."""

    def put_bytes(self, key: str, data: bytes, *, if_absent: bool = False): ...
    def get_bytes(self, key: str, *, expected_sha256: str | None = None) -> bytes: ...
    def upload_stream(self, key: str, source, *, if_absent: bool = False, progress=None): ...
    def download_stream(self, key: str, dest, *, expected_sha256: str | None = None, progress=None): ...
    def delete_prefix(self, prefix: str) -> int: ...
    def list(self, prefix: str = ""): ...


logger = logging.getLogger(__name__)


# Where a Harbor task's tests are installed at verify time, and where its verifier writes
# reward.txt / reward.json and whatever else it logs (Harbor's own paths: the tests expect them).
TESTS_DIR = "/tests"
VERIFIER_LOGS = "/logs/verifier"
AGENT_LOGS = "/logs/agent"


@dataclass(frozen=True)
class Collected:
    """Files PID 1 read back from a sandbox: a directory's regular files, or one file."""

    files: dict[str, bytes]
    skipped: list[str]  # entries that were no regular file (never read, never followed)
    directory: bool


@dataclass(frozen=True)
class GradedCheck:
    """What a task's own verifier left: its observation and the files of its logs directory."""

    observation: Observation
    files: dict[str, bytes]
    skipped: list[str]  # entries of the logs directory that were no regular file (never read)
    disk_bytes: int | None  # what the sandbox's writable layer held after the tests


def default_host_queue(cfg: SandboxConfig) -> str:
    return cfg.host_task_queue or f"belayer-sandbox-{socket.gethostname()}"


class SandboxHost:
    """Sandboxes on this host, their checkpoints in `store`."""

    def __init__(
        self,
        cfg: SandboxConfig,
        backend: SandboxBackend,
        store: ArchiveStore,
        *,
        state_dir: Path,
        host_queue: str | None = None,
    ):
        self.cfg = cfg
        self.backend = backend
        self.store = store
        self.state_dir = Path(state_dir)
        self.host_queue = host_queue or default_host_queue(cfg)
        self.staging = Staging(self.state_dir, lambda: self.host_queue, cfg.staging_budget_mb << 20)
        self._locks: dict[str, threading.Lock] = {}
        self._locks_guard = threading.Lock()
        # A drain (belayer/sandbox/drain.py): no new sandboxes; the moved ones answer "moved".
        self.draining = False
        self._moved: dict[str, bool] = {}  # sandbox id -> its trajectory has been told
        # What counts against `max_sandboxes`, published for placement (belayer/sandbox/placement.py).
        self._live: set[str] = set()
        self._owners: OwnerRecords | None = None
        # Sandbox id -> the image it runs (a task's own, or sandbox.image); images this
        # process has put in the store for other hosts (belayer/sandbox/images.py).
        self._images: dict[str, str] = {}
        self._image_ids: dict[str, str] = {}  # task image name -> the id its sandboxes here run
        self._shared_images: set[str] = set()
        self.on_load_change: Callable[[], None] = lambda: None
        # Container -> where the kernel counts its OOM kills, looked up beside its first action.
        self._oom_counters: dict[str, Future[Path | None]] = {}
        self._oom_counter_lookups = ThreadPoolExecutor(max_workers=1, thread_name_prefix="oom-counter")

    @property
    def owners(self) -> OwnerRecords:
        """Which workflow each sandbox here serves, for the reaper (belayer/sandbox/reaper.py):
        kept per host queue, so they follow a host renamed before it serves."""
        if self._owners is None or self._owners.host_queue != self.host_queue:
            self._owners = OwnerRecords(self.state_dir, self.host_queue)
        return self._owners

    # ------------------------------------------------------------------ helpers
    def _lock(self, sandbox_id: str) -> threading.Lock:
        """The sandbox's lock: every call on a sandbox takes it, so an id Belayer never makes
        (`../x`, `/etc`) is refused here, before any file or container is touched."""
        checked_sandbox_id(sandbox_id)
        with self._locks_guard:
            return self._locks.setdefault(sandbox_id, threading.Lock())

    def _sock(self, handle_or_id: SandboxHandle | str) -> Path:
        sid = handle_or_id if isinstance(handle_or_id, str) else handle_or_id.sandbox_id
        return self.backend.channel_path(sid)

    def _handle(self, sandbox_id: str, generation: int, container: str) -> SandboxHandle:
        return SandboxHandle(sandbox_id=sandbox_id, host_queue=self.host_queue, generation=generation,
                             container=container)  # fmt: skip

    def adopt_existing(self) -> None:
        """Count the sandboxes already on this host (a worker restarted beside its containers)."""
        with self._locks_guard:
            self._live = set(self.backend.lineages())
        self.on_load_change()

    def load(self) -> HostLoad:
        with self._locks_guard:
            count = len(self._live)
        return HostLoad(host_queue=self.host_queue, sandboxes=count, capacity=self.cfg.max_sandboxes,
                        draining=self.draining, written_at=time.time())  # fmt: skip

    @contextlib.contextmanager
    def _occupying(self, sandbox_id: str) -> Iterator[None]:
        """The sandbox counts against this host's capacity from here on (a full host refuses
        it: HostFull); if starting it fails, it stops counting."""
        with self._locks_guard:
            full = self.cfg.max_sandboxes and len(self._live) >= self.cfg.max_sandboxes
            if sandbox_id not in self._live and full:
                raise HostFull(f"sandbox host {self.host_queue} is full ({len(self._live)} of sandbox.max_sandboxes="
                               f"{self.cfg.max_sandboxes}); another host will take {sandbox_id}")  # fmt: skip
            self._live.add(sandbox_id)
        self.on_load_change()
        try:
            yield
        except BaseException:
            self._gone(sandbox_id)
            raise

    def _gone(self, sandbox_id: str) -> None:
        with self._locks_guard:
            self._live.discard(sandbox_id)
        self.on_load_change()

    def _refuse_if_draining(self) -> None:
        if self.draining:
            raise HostDraining(f"sandbox host {self.host_queue} is draining: it takes no new sandboxes; "
                               f"another host will")  # fmt: skip

    def _refuse_if_moved(self, sandbox_id: str, *, tells: bool = True) -> None:
        """Called with the sandbox's lock held: a drained sandbox's calls learn where it went.
        A checkpoint refused does not count as told (`tells`): the workflow shrugs it off, and
        only its next action makes it recover."""
        if sandbox_id in self._moved:
            self._moved[sandbox_id] = self._moved[sandbox_id] or tells
            raise SandboxNotFound(
                f"sandbox {sandbox_id} was moved off host {self.host_queue} by a drain: recover it (another "
                f"host restores the drain's checkpoint)"
            )

    def told_moved(self) -> set[str]:
        """The drained sandboxes whose trajectory has called since and been told."""
        return {sid for sid, told in list(self._moved.items()) if told}

    def ping(self, handle: SandboxHandle) -> dict:
        return channel.call(self._sock(handle), {"op": "ping"}, timeout_s=10)

    # ------------------------------------------------------------------ create / destroy
    def create(self, spec: SandboxSpec, sandbox_id: str | None = None, generation: int = 0) -> SandboxHandle:
        """A fresh sandbox from the base image, the task's setup commands already run.

        With an explicit `sandbox_id` (e.g. from the workflow, so a retried create is
        idempotent) any container left by an earlier attempt is removed first.
        """
        explicit = sandbox_id is not None
        sandbox_id = sandbox_id or f"sbx-{uuid.uuid4().hex[:12]}"
        self._refuse_if_draining()
        with self._occupying(sandbox_id), self._lock(sandbox_id):
            if explicit:
                self.backend.fence(sandbox_id)
            if spec.image:
                self._image_ids[spec.image] = ensure_image(self.backend, self.store, spec.image, None,
                                                           self._image_dir())  # fmt: skip
                self._share(spec.image)  # before the container: a failed upload leaves nothing
            container = self.backend.create(sandbox_id, generation, spec.labels, image=spec.image,
                                            semantics=spec.semantics)  # fmt: skip
            self._images[sandbox_id] = spec.image or self.cfg.image
            try:
                self._record_lineage(sandbox_id, generation, container)
                info = channel.wait_ready(self._sock(sandbox_id), self.cfg.start_timeout_s)
                if generation != info["generation"]:
                    channel.call(
                        self._sock(sandbox_id),
                        {"op": "set_generation", "expected": info["generation"], "new": generation},
                    )
                if spec.semantics is not None:
                    self._install_task_files(sandbox_id, spec.semantics)
                for i, command in enumerate(spec.setup_commands, start=1):
                    obs = self._run(sandbox_id, SETUP_TRAJECTORY, i, generation, command, None)
                    if obs.exit_code != 0:
                        raise SetupFailed(
                            f"setup command {i} of sandbox {sandbox_id} failed (exit {obs.exit_code}): "
                            f"{obs.stderr[-2000:] or obs.stdout[-2000:]}"
                        )
            except BaseException:
                self.backend.destroy(sandbox_id)
                raise
        return self._handle(sandbox_id, generation, container)

    def _image_dir(self) -> Path:
        return self.state_dir / "tmp"

    def _share(self, image: str) -> None:
        """A task image this host runs, put in the store (once) for the hosts its sandboxes
        may be restored or forked on."""
        if image not in self._shared_images:
            share_image(self.backend, self.store, image, self._image_dir())
            self._shared_images.add(image)

    def _image_id(self, image: str | None) -> str:
        """The id of the image a checkpoint's sandbox runs (the base image when None)."""
        if image is None or image == self.cfg.image:
            return self.backend.image_id()
        return self._image_ids.get(image) or self.backend.image_id(image)

    def _image_of(self, handle: SandboxHandle) -> str:
        """The image the sandbox runs: remembered since its start here, else asked of podman
        (a worker restarted since)."""
        if handle.sandbox_id not in self._images:
            self._images[handle.sandbox_id] = self.backend.container_image(handle.container) or self.cfg.image
        return self._images[handle.sandbox_id]

    def destroy(self, handle: SandboxHandle) -> None:
        self.remove(handle.sandbox_id)

    def remove(self, sandbox_id: str) -> None:
        """Remove a lineage's containers by its id (benchmarks keep ids, not handles), and
        any checkpoint of it captured here and never published; the host stops counting it
        against `max_sandboxes`."""
        with self._lock(sandbox_id):
            self.backend.destroy(sandbox_id)
            for unpublished in self.staging.staged_of(sandbox_id):
                unpublished.unlink(missing_ok=True)
            self.owners.forget(sandbox_id)
            self._images.pop(sandbox_id, None)
        self._gone(sandbox_id)

    def kill(self, handle: SandboxHandle) -> None:
        """Crash the sandbox (SIGKILL); chaos and tests."""
        self.backend.kill(handle.container)

    # ------------------------------------------------------------------ exec
    def _run(self, sandbox_id: str, trajectory: str, step: int, generation: int, command: str,
             timeout_s: float | None, isolated: bool = False, processes: str = "frozen") -> Observation:  # fmt: skip
        reply = channel.run_action(
            self._sock(sandbox_id), trajectory=trajectory, step=step, generation=generation, command=command,
            timeout_s=timeout_s or self.cfg.action_timeout_s, output_cap=self.cfg.output_cap_bytes,
            isolated=isolated, processes=processes,
        )  # fmt: skip
        return Observation.from_supervisor(reply["observation"], replayed=bool(reply.get("replayed")))

    def exec(self, handle: SandboxHandle, action: Action, *, isolated: bool = False,
             processes: str = "frozen") -> Observation:  # fmt: skip
        """Run one action exactly once (a repeated (trajectory, step) returns the journal's).

        `isolated` (the reward check): a clean process in /workspace with the verifier's
        environment, none of the agent's variables, functions or options; it hands
        nothing on to the agent's later actions. With `processes="frozen"` the agent's
        processes are stopped first and stay stopped until its next action.
        """
        self._refuse_if_superseded(handle)
        if faults.is_on("sandbox_kill_during_exec"):
            threading.Timer(0.2, self.backend.kill, args=(handle.container,)).start()
        with self._lock(handle.sandbox_id):
            self._refuse_if_moved(handle.sandbox_id)
            self._find_oom_counter(handle.container)
            try:
                return self._run(handle.sandbox_id, action.trajectory, action.step, handle.generation,
                                 action.command, action.timeout_s, isolated, processes)  # fmt: skip
            except SandboxUnreachable as lost:
                raise self._why_lost(handle, action.step, lost) from lost

    def _find_oom_counter(self, container: str) -> None:
        """Look up, beside the container's first action, where the kernel counts its OOM
        kills: once PID 1 has died, podman removes the cgroup within a fraction of a second,
        sooner than a lookup that starts then could find it."""
        with self._locks_guard:
            if container not in self._oom_counters:
                self._oom_counters[container] = self._oom_counter_lookups.submit(
                    self.backend.memory_cgroup, container
                )
                while len(self._oom_counters) > OOM_COUNTERS_KEPT:
                    self._oom_counters.pop(next(iter(self._oom_counters)))

    def _why_lost(self, handle: SandboxHandle, step: int, lost: SandboxUnreachable) -> SandboxUnreachable:
        """The sandbox stopped answering during action `step` (its lock held): why, as far as
        this host can tell (`loss_cause`); a cause inside the sandbox makes the loss the
        policy's (errors.CAUSED_BY_AGENT), which the workflow does not recover."""
        with self._locks_guard:
            counter = self._oom_counters.pop(handle.container, None)
        try:
            kills = oom_kills(counter.result(timeout=5) if counter is not None else None)
        except Exception:  # noqa: BLE001 -- a lookup that failed is a count not known
            kills = None
        cause, why = loss_cause(self.backend.exit_state(handle.container), kills)
        return SandboxUnreachable(f"sandbox {handle.sandbox_id} lost during step {step}: {why} ({lost})",
                                  cause=cause, step=step)  # fmt: skip

    def workspace_hash(self, handle: SandboxHandle, path: str = "/workspace") -> str:
        """sha256 over /workspace's paths, modes and contents (no timestamps).

        The agent's processes are frozen first (until its next action), so nothing changes
        the tree while it is read; the hash runs on the trusted toolchain's interpreter, never
        the image's python3, which the agent may have replaced (belayer/sandbox/toolchain.py)."""
        with self._lock(handle.sandbox_id):
            self._refuse_if_moved(handle.sandbox_id)
            channel.call(self._sock(handle.sandbox_id), {"op": "freeze"})
            out = self.backend.exec_as_root(
                handle.container, [*toolchain.python_command(), "-c", HASH_SCRIPT, path]
            )
        return out.decode().strip()

    # ------------------------------------------------------------------ task files, graded checks
    def install(self, sandbox_id: str, path: str, files: StoredFiles | None, owner: str) -> int:
        """Replace `path` in the sandbox by `files` (a tar from the store), or by an empty
        directory, owned by the agent or the verifier; returns how many files. PID 1 unpacks
        it (the supervisor's `install`): the image's tar and rm are the agent's to replace."""
        name = None
        if files is not None:
            name = f"install-{secrets.token_hex(8)}.tar"
            with open(self._sock(sandbox_id).parent / name, "wb") as f:
                self.store.download_stream(files.key, f, expected_sha256=files.sha256)
        try:
            reply = channel.call(self._sock(sandbox_id), {"op": "install", "path": path, "archive": name,
                                                          "owner": owner}, timeout_s=60)  # fmt: skip
        finally:
            if name is not None:
                (self._sock(sandbox_id).parent / name).unlink(missing_ok=True)
        return int(reply["files"])

    def begin_stage(self, handle: SandboxHandle, uploads: dict[str, StoredFiles], setup_commands: list[str],
                    first_setup_step: int) -> str | None:  # fmt: skip
        """A multi-step task's next stage: its files installed, its setup commands run as the
        agent (in the setup journal, from `first_setup_step`: a retry runs none twice). Returns
        why a setup command failed (the task stops there: the sandbox the agent left may be
        why), None when all ran."""
        with self._lock(handle.sandbox_id):
            self._refuse_if_moved(handle.sandbox_id)
            for path, files in uploads.items():
                self.install(handle.sandbox_id, path, files, "agent")
            for step, command in enumerate(setup_commands, start=first_setup_step):
                obs = self._run(handle.sandbox_id, SETUP_TRAJECTORY, step, handle.generation, command, None)
                if obs.exit_code != 0:
                    return (f"the next stage's setup command {command[:80]!r} failed (exit {obs.exit_code}): "
                            f"{obs.stderr[-500:] or obs.stdout[-500:]}")  # fmt: skip
        return None

    def record_message(self, handle: SandboxHandle, trajectory: str, step: int, text: str) -> Observation:
        """`text` journaled as step `step`'s observation (the supervisor's `record`): what a
        multi-step task's boundary step logs, so restores and replays see that."""
        observation = message_observation(text)
        with self._lock(handle.sandbox_id):
            self._refuse_if_moved(handle.sandbox_id)
            channel.call(self._sock(handle), {"op": "record", "trajectory": trajectory, "step": step,
                                              "observation": observation})  # fmt: skip
        return Observation.from_supervisor(observation, replayed=False)

    def _install_task_files(self, sandbox_id: str, semantics: ImageSemantics) -> None:
        """A task image's sandbox as Harbor's start: /logs/agent there for the agent (the
        image's / is not the agent's to write), then the task's uploads (the oracle's
        /solution)."""
        self.install(sandbox_id, AGENT_LOGS, None, "agent")
        for path, files in semantics.uploads.items():
            self.install(sandbox_id, path, files, "agent")

    def verify(self, handle: SandboxHandle, action: Action, tests: StoredFiles, *, processes: str,
               logs_dir: str = VERIFIER_LOGS, max_bytes: int = 1 << 20) -> GradedCheck:  # fmt: skip
        """A task's own tests, run as its verifier (Harbor's): `tests` installed at /tests and
        `logs_dir` emptied (whatever the agent put there), then `action` run isolated as the
        check, then the files it left in `logs_dir` read back (reward.txt / reward.json).

        The check is the journal's action: a retry after it ran installs nothing again (that
        would erase the reward it wrote) and gets the journal's observation."""
        self._refuse_if_superseded(handle)
        with self._lock(handle.sandbox_id):
            self._refuse_if_moved(handle.sandbox_id)
            described = channel.call(self._sock(handle), {"op": "ping"}, timeout_s=10)
            ran = described.get("trajectory") == action.trajectory and described.get("head", 0) >= action.step
            if not ran:
                if processes == "frozen":  # before the tests land: nothing of the agent's may touch them
                    channel.call(self._sock(handle), {"op": "freeze"})
                self.install(handle.sandbox_id, TESTS_DIR, tests, "verifier")
                self.install(handle.sandbox_id, logs_dir, None, "verifier")
        observation = self.exec(handle, action, isolated=True, processes=processes)
        collected = self._collect(handle, logs_dir, max_bytes)
        return GradedCheck(observation=observation, files=collected.files, skipped=collected.skipped,
                           disk_bytes=self.backend.disk_used(handle.container))  # fmt: skip

    def collect_artifacts(self, handle: SandboxHandle, paths: list[str],
                          max_bytes: int = 1 << 20) -> dict[str, bytes]:  # fmt: skip
        """A step's `artifacts` (a file, or the files directly in a directory), read by PID 1
        without following links, each named by its path in the sandbox without the leading /."""
        found: dict[str, bytes] = {}
        for path in paths:
            collected = self._collect(handle, path, max_bytes)
            for name, data in collected.files.items():
                found[f"{path.strip('/')}/{name}" if collected.directory else path.strip("/")] = data
        return found

    def _collect(self, handle: SandboxHandle, path: str, max_bytes: int) -> Collected:
        with self._lock(handle.sandbox_id):
            reply = channel.call(self._sock(handle), {"op": "collect", "path": path, "max_bytes": max_bytes})
        return Collected(files={name: base64.b64decode(data) for name, data in reply["files"].items()},
                         skipped=list(reply.get("skipped") or []), directory=bool(reply.get("directory")))  # fmt: skip

    # ------------------------------------------------------------------ checkpoint
    def checkpoint(
        self,
        handle: SandboxHandle,
        *,
        token_prefix_len: int | None = None,
        token_prefix_sha256: str | None = None,
        fs_snapshot: bool = False,
    ) -> CheckpointRef:
        """Full checkpoint (file system + processes), the sandbox keeps running."""
        self._refuse_if_superseded(handle)
        with self._lock(handle.sandbox_id):
            info = self._idle_info(handle)
            # Overlapped with the next generation: the engine keeps the cores (priority.py).
            return self._resuming_if_blocked(handle, lambda: priority.at_niceness(self.cfg.checkpoint_nice, lambda: (
                self._dump(handle, info, token_prefix_len=token_prefix_len, token_prefix_sha256=token_prefix_sha256,
                           fs_snapshot=fs_snapshot)
            )))  # fmt: skip

    def capture_checkpoint(self, handle: SandboxHandle, *, token_prefix_len: int | None = None,
                           token_prefix_sha256: str | None = None) -> StagedCheckpoint:  # fmt: skip
        """The first half of a checkpoint taken in a trajectory: the sandbox's state, as an
        uncompressed archive on this host's disk. The sandbox may run its next action as
        soon as this returns; `publish_checkpoint` then compresses and uploads the file.

        Why two halves: a checkpoint runs beside the next generation, and on a host that
        shares its cores with the engine every cycle it takes slows that generation, even
        niced (measured on the 2-core dev machine against an engine decoding without a
        pause: the whole streamed checkpoint cost the engine 1.3-1.6 s of its time, the
        export alone 0.2-0.4 s). The compression and upload need no quiet sandbox, so
        they move to the action, when the engine waits and a core is free.
        """
        self._refuse_if_superseded(handle)
        with self._lock(handle.sandbox_id):
            info = self._idle_info(handle)
            base = self._checkpoint_base(handle, info)
            self.staging.make_room(lambda: set(self.backend.lineages()))
            path = self._staged_path(base)
            phases: dict[str, float] = {}
            t0 = time.monotonic()
            try:
                self._resuming_if_blocked(handle, lambda: priority.at_niceness(
                    self.cfg.checkpoint_nice, lambda: self.backend.export_checkpoint(handle.container, path, phases)
                ))  # fmt: skip
            except BaseException:
                path.unlink(missing_ok=True)
                raise
        return StagedCheckpoint(
            sandbox_id=handle.sandbox_id, trajectory=info.get("trajectory"), step=info["head"],
            generation=handle.generation, token_prefix_len=token_prefix_len,
            token_prefix_sha256=token_prefix_sha256, base_key=base, path=str(path),
            capture_s=time.monotonic() - t0, phases=phases, image=self._image_of(handle),
        )  # fmt: skip

    def publish_checkpoint(self, staged: StagedCheckpoint) -> CheckpointRef:
        """The second half: the captured file compressed into the store and its meta.json
        written, niced like the capture; the file is removed once it is stored. A retry
        after a publish that stored everything finds its meta.json and returns the same ref."""
        path = self._staged_file(staged)
        if not path.is_file():
            return self._published_before(staged)
        t0 = time.monotonic()

        def upload() -> _Archive:
            with compression.compressed(path, self.cfg.checkpoint_compression) as chunks:
                return self._upload_archive(staged.base_key, chunks)

        archive = priority.at_niceness(self.cfg.checkpoint_nice, upload)
        phases = staged.phases | {"publish": time.monotonic() - t0}
        ref = self._write_meta(staged.model_copy(update={"phases": phases}), archive,
                               dump_s=staged.capture_s + phases["publish"])  # fmt: skip
        path.unlink(missing_ok=True)
        return ref

    def _published_before(self, staged: StagedCheckpoint) -> CheckpointRef:
        meta_key = staged.base_key + "meta.json"
        try:
            return _ref_of(meta_key, self._meta_at(meta_key))
        except CheckpointCorrupt:
            raise CheckpointCorrupt(
                f"the captured checkpoint {staged.path} of sandbox {staged.sandbox_id} is gone from this host "
                "and was never stored: the step goes unprotected until the next checkpoint"
            ) from None

    def _staged_path(self, base_key: str) -> Path:
        return self.staging.staged_path(
            base_key[len(self.cfg.checkpoint_prefix) :].strip("/").replace("/", "--") + ".tar"
        )

    def _staged_file(self, staged: StagedCheckpoint) -> Path:
        """The file a capture on this host wrote for `staged`: its store key must be under its
        own lineage's prefix, and its path the one this host derives from that key. A staged
        checkpoint crosses Temporal, and publish uploads, then deletes, the file it names."""
        lineage_prefix = f"{self.cfg.checkpoint_prefix}{staged.sandbox_id}/"
        rest = staged.base_key[len(lineage_prefix) :]
        if not staged.base_key.startswith(lineage_prefix) or not _CHECKPOINT_DIR.fullmatch(rest):
            raise CheckpointCorrupt(
                f"staged checkpoint key {staged.base_key!r} is not under sandbox "
                f"{staged.sandbox_id}'s checkpoints ({lineage_prefix}<step>/): refused"
            )
        path = self._staged_path(staged.base_key)
        if Path(staged.path) != path:
            raise CheckpointCorrupt(
                f"staged checkpoint names file {staged.path}, not {path}, the file its capture wrote: refused"
            )
        return path

    def _idle_info(self, handle: SandboxHandle) -> dict:
        """The supervisor's state of an idle sandbox at the handle's generation (its lock held),
        every stopped process resumed for the checkpoint that follows (the supervisor's
        `quiesce`: CRIU would wait forever on one)."""
        self._refuse_if_moved(handle.sandbox_id, tells=False)
        info = channel.call(self._sock(handle), {"op": "quiesce"}, timeout_s=10)
        if info["generation"] != handle.generation:
            raise StaleGeneration(
                f"sandbox {handle.sandbox_id} is at generation {info['generation']}, the handle at "
                f"{handle.generation}: a restore superseded this handle"
            )
        if info["busy"]:
            raise SandboxError(f"sandbox {handle.sandbox_id} is running an action; checkpoint after it")
        return info

    def _resuming_if_blocked(self, handle: SandboxHandle, dump: Callable[[], T]) -> T:
        """`dump()`; when the agent blocked it (a process kept stopped, dump_watchdog.py), the
        tasks CRIU had seized before it was ended are left stopped: resume them (the
        supervisor's `quiesce`), so the sandbox runs on as it was, then raise."""
        try:
            return dump()
        except CheckpointBlockedByAgent:
            channel.call(self._sock(handle), {"op": "quiesce"}, timeout_s=10)
            raise

    def _checkpoint_base(self, handle: SandboxHandle, info: dict) -> str:
        return (f"{self.cfg.checkpoint_prefix}{handle.sandbox_id}/"
                f"{info['head']:08d}-g{handle.generation}-{secrets.token_hex(4)}/")  # fmt: skip

    def _dump(self, handle: SandboxHandle, info: dict, *, token_prefix_len: int | None = None,
              token_prefix_sha256: str | None = None, fs_snapshot: bool = False) -> CheckpointRef:  # fmt: skip
        """Stream the checkpoint of an idle sandbox (its lock held) into the store."""
        base = self._checkpoint_base(handle, info)
        t0 = time.monotonic()
        phases: dict[str, float] = {}
        with self.backend.checkpoint_stream(handle.container, phases) as chunks:
            archive = self._upload_archive(base, chunks)
        dump_s = time.monotonic() - t0
        phases["upload_tail"] = time.monotonic() - archive.streamed_at
        fs_key = fs_sha = None
        if fs_snapshot:
            data = self.backend.exec_as_root(
                handle.container, ["tar", "-C", "/", "--ignore-failed-read", "-cf", "-", *FS_SNAPSHOT_PATHS]
            )
            fs_key = base + "fs.tar"
            fs_sha = self.store.put_bytes(fs_key, data).sha256
        origin = StagedCheckpoint(
            sandbox_id=handle.sandbox_id, trajectory=info.get("trajectory"), step=info["head"],
            generation=handle.generation, token_prefix_len=token_prefix_len,
            token_prefix_sha256=token_prefix_sha256, base_key=base, path="", capture_s=dump_s, phases=phases,
            image=self._image_of(handle),
        )  # fmt: skip
        return self._write_meta(origin, archive, dump_s=dump_s, fs_key=fs_key, fs_sha256=fs_sha)

    def _upload_archive(self, base_key: str, chunks: Iterator[bytes]) -> _Archive:
        """Stream the archive's bytes to `base_key`archive, hashing and counting them."""
        archive = _Archive()

        def counted() -> Iterator[bytes]:
            for chunk in chunks:
                archive.sha256.update(chunk)
                archive.size += len(chunk)
                yield chunk
            archive.streamed_at = time.monotonic()

        self.store.upload_stream(base_key + "archive", counted())
        return archive

    def _write_meta(self, origin: StagedCheckpoint, archive: _Archive, *, dump_s: float,
                    fs_key: str | None = None, fs_sha256: str | None = None) -> CheckpointRef:  # fmt: skip
        """meta.json beside the stored archive: what makes the checkpoint restorable."""
        versions = self.backend.versions()
        meta = CheckpointMeta(
            sandbox_id=origin.sandbox_id, trajectory=origin.trajectory, step=origin.step,
            generation=origin.generation, token_prefix_len=origin.token_prefix_len,
            token_prefix_sha256=origin.token_prefix_sha256, archive_key=origin.base_key + "archive",
            archive_sha256=archive.sha256.hexdigest(), archive_bytes=archive.size, fs_key=fs_key,
            fs_sha256=fs_sha256, image=origin.image or self.cfg.image, image_id=self._image_id(origin.image),
            criu_version=versions["criu"], podman_version=versions["podman"],
            compression=self.cfg.checkpoint_compression,
            channel_dir=str(self._sock(origin.sandbox_id).parent), created_at=time.time(), dump_s=dump_s,
            phases=origin.phases,
        )  # fmt: skip
        self.store.put_bytes(origin.base_key + "meta.json", meta.model_dump_json().encode())
        return _ref_of(origin.base_key + "meta.json", meta)

    def load_meta(self, ref: CheckpointRef) -> CheckpointMeta:
        return self._meta_at(ref.meta_key)

    def _meta_at(self, meta_key: str) -> CheckpointMeta:
        try:
            return CheckpointMeta.model_validate_json(self.store.get_bytes(meta_key))
        except StorageError as exc:
            raise CheckpointCorrupt(f"checkpoint metadata {meta_key} unreadable: {exc}") from exc
        except ValueError as exc:
            raise CheckpointCorrupt(f"checkpoint metadata {meta_key} is not valid: {exc}") from exc

    # ------------------------------------------------------------------ restore
    def restore(self, ref: CheckpointRef, new_generation: int, log: list[LoggedAction] | None = None, *,
                sandbox_id: str | None = None, trajectory: str | None = None,
                phases: dict[str, float] | None = None,
                ) -> tuple[SandboxHandle, CheckpointMeta]:  # fmt: skip
        """Full restore on this host; fences any older container of the lineage first.

        With the trajectory's `log`, the checkpoint must belong to it: its recorded token
        prefix must be the context the log has after that step (`_check_prefix`, before any
        download), and the restored journal's observations for the steps up to it must be
        the log's (`_check_journal`); otherwise `CheckpointInconsistent` / `JournalMismatch`,
        and nothing is left running.

        A checkpoint of another lineage than `sandbox_id` (a group's set-up sandbox, the
        trajectory a branch starts from) is started as a fork serving `trajectory`.

        `phases` (for reports) gets the seconds of a lineage's own restore: `fetch` (the
        metadata, then the archive downloaded and decompressed while the old containers
        are fenced), `podman` (podman and CRIU restoring it), `ready` (until the
        supervisor answers with the checkpoint's journal, at the new generation, checked).
        """
        clock = _PhaseClock(phases)
        self._refuse_if_draining()
        meta = self._restorable_meta(ref, log)
        if sandbox_id is not None and sandbox_id != meta.sandbox_id:
            trajectory = trajectory or next((a.trajectory for a in log or []), None)
            if not trajectory:
                raise SandboxError(
                    f"restoring {ref.meta_key} as fork {sandbox_id} needs the trajectory it serves"
                )
            with self._unpacked(meta) as plain:
                handle = self._fork_one(ref, meta, plain, ForkTarget(sandbox_id=sandbox_id, trajectory=trajectory),
                                        new_generation, log)  # fmt: skip
            return handle, meta
        sid = meta.sandbox_id
        with self._occupying(sid), self._lock(sid):
            with self._unpacked(meta, meanwhile=lambda: self.backend.fence(sid)) as plain:
                clock.lap("fetch")
                try:
                    container = self.backend.restore(plain, sid, new_generation)
                    self._images[sid] = meta.image
                except SandboxError:
                    self.backend.fence(sid)  # a failed restore can leave a created container
                    raise
                clock.lap("podman")
            try:
                self._record_lineage(sid, new_generation, container)
                info = channel.wait_ready(self._sock(sid), self.cfg.start_timeout_s)
                if info["head"] != meta.step:
                    raise JournalMismatch(
                        f"restored sandbox {sid} has journal head {info['head']}, its checkpoint says {meta.step}"
                    )
                channel.call(
                    self._sock(sid),
                    {"op": "set_generation", "expected": info["generation"], "new": new_generation},
                )
                if log is not None:
                    self._check_journal(ref, sid, new_generation, meta.step, log)
            except BaseException:
                self.backend.fence(sid)
                raise
            clock.lap("ready")
        return self._handle(sid, new_generation, container), meta

    def _restorable_meta(self, ref: CheckpointRef, log: list[LoggedAction] | None) -> CheckpointMeta:
        meta = self.load_meta(ref)
        if meta.archive_sha256 != ref.archive_sha256:
            raise CheckpointCorrupt(
                f"{ref.meta_key}: metadata names another archive than the workflow recorded"
            )
        if log is not None:
            _check_prefix(ref, meta, log)
        if meta.image != self.cfg.image:  # a task's image: loaded from the store if this host lacks it
            self._image_ids[meta.image] = ensure_image(self.backend, self.store, meta.image, meta.image_id,
                                                       self._image_dir())  # fmt: skip
            return meta
        image_id = self.backend.image_id()
        if image_id != meta.image_id:
            raise RuntimeUnavailable(
                f"checkpoint {ref.meta_key} needs base image id {meta.image_id}, this host has {image_id} for "
                f"{self.cfg.image}: run infra/install/base-image.sh from the same revision"
            )
        return meta

    # ------------------------------------------------------------------ fork
    def fork(self, ref: CheckpointRef, targets: list[ForkTarget], *, generation: int = 1,
             log: list[LoggedAction] | None = None) -> list[ForkOutcome]:  # fmt: skip
        """Start one sandbox per target from `ref`, each its own lineage at `generation`.

        The archive is downloaded, checked and unpacked once; the forks restore from it
        `sandbox.fork_concurrency` at a time. They start identical (file system and
        processes) and share nothing writable (belayer/sandbox/fork_archive.py). A target
        that fails is an outcome with its error and leaves nothing behind; a checkpoint
        that cannot be used at all (corrupt, another base image) raises.
        """
        self._refuse_if_draining()
        meta = self._restorable_meta(ref, log)
        t0 = time.monotonic()

        def one(target: ForkTarget) -> ForkOutcome:
            try:
                handle = self._fork_one(ref, meta, plain, target, generation, log)
            except SandboxError as exc:
                return ForkOutcome(sandbox_id=target.sandbox_id, error=f"{type(exc).__name__}: {exc}",
                                   ready_s=time.monotonic() - t0)  # fmt: skip
            return ForkOutcome(sandbox_id=target.sandbox_id, handle=handle, ready_s=time.monotonic() - t0,
                               closed_tcp_connections=closed)  # fmt: skip

        with self._fork_archive(meta) as plain:
            try:
                closed = self.backend.established_tcp_sockets(plain)
            except SandboxError:
                closed = 0  # an unreadable archive: each fork fails on it below, with its own error
            with ThreadPoolExecutor(max_workers=max(1, min(len(targets), self.cfg.fork_concurrency))) as pool:
                outcomes = list(pool.map(one, targets))
        if not any(o.handle for o in outcomes):
            self.staging.forget_fork_archive(meta.archive_sha256)  # never a damaged copy twice
        return outcomes

    def _fork_archive(self, meta: CheckpointMeta):
        """The checkpoint's unpacked archive for forks: this host's cached copy, or
        downloaded (sha256-checked), unpacked and then cached (belayer/sandbox/staging.py)."""

        def fetch(dest: Path) -> None:
            compression.unpack(lambda f: self._download_archive(meta, f), meta.compression, dest)
            if faults.is_on("sandbox_restore_damaged_archive"):
                _damage(dest)

        return self.staging.fork_archive(meta.sandbox_id, meta.archive_sha256, fetch)

    def _fork_one(self, ref: CheckpointRef, meta: CheckpointMeta, plain: Path, target: ForkTarget,
                  generation: int, log: list[LoggedAction] | None) -> SandboxHandle:  # fmt: skip
        sid = target.sandbox_id
        with self._occupying(sid), self._lock(sid):
            self.backend.fence(sid)
            try:
                container = self.backend.fork(plain, meta.sandbox_id, sid, generation)
                self._images[sid] = meta.image
                self._record_lineage(sid, generation, container)
                info = channel.wait_ready(self._sock(sid), self.cfg.start_timeout_s)
                if info["head"] != meta.step:
                    raise JournalMismatch(
                        f"fork {sid} of {ref.meta_key} has journal head {info['head']}, its checkpoint says {meta.step}"
                    )
                channel.call(self._sock(sid), {"op": "fork", "expected": info["generation"], "new": generation,
                                               "trajectory": target.trajectory})  # fmt: skip
                if log is not None:
                    self._check_journal(ref, sid, generation, meta.step, log)
            except BaseException:
                self.backend.destroy(sid)  # a fork owns its channel: nothing of it stays
                raise
        return self._handle(sid, generation, container)

    @contextlib.contextmanager
    def _unpacked(self, meta: CheckpointMeta, meanwhile: Callable[[], None] | None = None) -> Iterator[Path]:
        """The checkpoint's archive, downloaded (sha256-checked) and uncompressed, in a
        private directory removed afterwards. `meanwhile` (a restore's fence: podman calls,
        ~0.2 s) runs in a thread beside the download and must have finished before the
        archive is handed over."""
        with self.staging.importing(meta.sandbox_id) as d, ThreadPoolExecutor(max_workers=1) as pool:
            beside = pool.submit(meanwhile or (lambda: None))
            plain = compression.unpack(lambda f: self._download_archive(meta, f), meta.compression,
                                       d / "plain.tar")  # fmt: skip
            beside.result()
            if faults.is_on("sandbox_restore_damaged_archive"):
                _damage(plain)
            yield plain

    def _download_archive(self, meta: CheckpointMeta, f) -> None:
        try:
            self.store.download_stream(meta.archive_key, f, expected_sha256=meta.archive_sha256)
        except (CorruptObject, ObjectNotFound) as exc:
            raise CheckpointCorrupt(f"archive {meta.archive_key}: {exc}") from exc
        f.flush()

    def _check_journal(self, ref: CheckpointRef, sid: str, generation: int, head: int,
                       log: list[LoggedAction]) -> None:  # fmt: skip
        """The restored journal's observation hashes for steps 1..head equal the log's.

        Re-submitting a logged (trajectory, step) that the journal holds returns the
        journaled observation and runs nothing; one the journal lacks at or below its head
        is refused (OutOfOrder), never run. So this costs one local socket round trip per
        step, needs no new supervisor operation, and compares exactly what a replay would:
        `Observation.sha256` (a compacted entry keeps its hash).
        """
        for action in sorted((a for a in log if a.step <= head), key=lambda a: a.step):
            try:
                obs = self._run(sid, action.trajectory, action.step, generation, action.command, None)
            except SandboxError as exc:
                raise JournalMismatch(
                    f"{ref.meta_key}: step {action.step} is not in the restored journal: {exc}"
                ) from exc
            if not obs.replayed_from_journal or obs.sha256 != action.observation_sha256:
                raise JournalMismatch(
                    f"{ref.meta_key}: the restored journal's observation of step {action.step} is not the "
                    f"trajectory's (a checkpoint of another branch)"
                )

    # ------------------------------------------------------------------ recover
    def recover(
        self,
        handle: SandboxHandle,
        checkpoints: list[CheckpointRef],
        actions: list[LoggedAction],
        *,
        mode: RecoveryMode = "full",
        spec: SandboxSpec | None = None,
        trajectory: str | None = None,
        earliest_step: int = 0,
    ) -> RecoverOutcome:
        """Bring the sandbox back at the log's last step and check every replayed observation.

        `checkpoints` newest first; a corrupt or missing one, or (mode "full") one that
        does not belong to the log (`restore`'s checks), falls back to the previous one,
        then to a fresh sandbox replaying from the start; each skip is in the outcome's
        notes. `actions` is the log from step 1 (or at least from the oldest checkpoint's
        step + 1). A failure past that carries the notes in its message.

        A checkpoint of another lineage (a fork's origin: its group's set-up sandbox, the
        trajectory it branched from) is restored as a fork serving `trajectory`.

        `earliest_step`: no checkpoint from before it, nor a replay from the start, may serve
        (a multi-step task's stage boundary: its check and the next stage's files are in no
        replayable action); with none left, `RecoveryImpossible`.
        """
        spec = spec or SandboxSpec()
        new_gen = handle.generation + 1
        notes: list[str] = []
        t0 = time.monotonic()
        new_handle: SandboxHandle | None = None
        start_step = 0
        source = "replay-from-start"
        last_logged = max((a.step for a in actions), default=0)
        drained = self.drained_checkpoint(handle) if mode == "full" else None
        if drained is not None:
            notes.append(f"starting from the checkpoint a drain took at step {drained.step}")
            checkpoints = [drained, *checkpoints]
        restored_from: CheckpointRef | None = None
        usable = []
        for ref in checkpoints:
            if ref.step > last_logged:
                # Taken on a timeline the log no longer has (the context was cut before it):
                # its journal would answer the new steps with the old observations.
                notes.append(f"checkpoint {ref.meta_key} (step {ref.step}) is past the log's last step "
                             f"{last_logged}: skipped")  # fmt: skip
            elif ref.step < earliest_step:
                notes.append(f"checkpoint {ref.meta_key} (step {ref.step}) is before step {earliest_step}, "
                             "a stage boundary no replay crosses: skipped")  # fmt: skip
            else:
                usable.append(ref)
        checkpoints = usable
        if mode == "full":
            for ref in checkpoints:
                try:
                    new_handle, meta = self.restore(ref, new_gen, log=actions, sandbox_id=handle.sandbox_id,
                                                    trajectory=trajectory)  # fmt: skip
                    start_step, source, restored_from = meta.step, f"checkpoint@{meta.step}", ref
                    break
                except (CheckpointCorrupt, CheckpointInconsistent, JournalMismatch, RestoreFailed) as exc:
                    notes.append(f"checkpoint {ref.meta_key} (step {ref.step}) unusable: {exc}")
        elif mode == "fs-only":
            for ref in checkpoints:
                try:
                    new_handle, start_step = self._restore_fs_only(handle, ref, new_gen, spec)
                    source = f"fs@{start_step}"
                    break
                except CheckpointCorrupt as exc:
                    notes.append(f"file-system snapshot of {ref.meta_key} unusable: {exc}")
        try:
            if new_handle is None and earliest_step > 0:
                raise RecoveryImpossible(
                    f"sandbox {handle.sandbox_id}: no usable checkpoint at or after step {earliest_step}, the "
                    "stage boundary of a multi-step task, and a replay from the start cannot cross it"
                )
            if new_handle is None:
                if mode != "replay":
                    notes.append("falling back to replay from the start in a fresh sandbox")
                with self._lock(handle.sandbox_id):
                    self.backend.fence(handle.sandbox_id)
                new_handle = self.create(spec, sandbox_id=handle.sandbox_id, generation=new_gen)
            restore_s = time.monotonic() - t0
            outcome = self._replay_and_compare(
                new_handle, actions, start_step, mode, source, notes, restore_s
            )
            if drained is not None and restored_from == drained:
                outcome = outcome.model_copy(update={"drained_checkpoint": drained})
            return outcome
        except SandboxError as exc:
            if notes:
                exc.args = (f"{exc} (recovery notes: {'; '.join(notes)})", *exc.args[1:])
            raise

    def _restore_fs_only(self, handle: SandboxHandle, ref: CheckpointRef, new_gen: int,
                         spec: SandboxSpec) -> tuple[SandboxHandle, int]:  # fmt: skip
        meta = self.load_meta(ref)
        if not meta.fs_key or not meta.fs_sha256:
            raise CheckpointCorrupt(f"{ref.meta_key} has no file-system snapshot")
        if meta.fs_sha256 != ref.fs_sha256:
            raise CheckpointCorrupt(
                f"{ref.meta_key}: metadata names another file-system snapshot than the workflow recorded"
            )

        try:
            data = self.store.get_bytes(meta.fs_key, expected_sha256=meta.fs_sha256)
        except StorageError as exc:
            raise CheckpointCorrupt(f"file-system snapshot {meta.fs_key}: {exc}") from exc
        with self._lock(handle.sandbox_id):
            self.backend.fence(handle.sandbox_id)
        # Processes are lost by design: a fresh sandbox (no setup: the files carry it).
        new_handle = self.create(
            SandboxSpec(labels=spec.labels, image=spec.image, semantics=spec.semantics),
            sandbox_id=handle.sandbox_id,
            generation=new_gen,
        )
        self.backend.exec_as_root(new_handle.container, ["tar", "-C", "/", "-xf", "-"], stdin=data)
        return new_handle, meta.step

    def _replay_and_compare(self, handle: SandboxHandle, actions: list[LoggedAction], start_step: int,
                            mode: RecoveryMode, source: str, notes: list[str],
                            restore_s: float) -> RecoverOutcome:  # fmt: skip
        t1 = time.monotonic()
        todo = sorted((a for a in actions if a.step > start_step), key=lambda a: a.step)
        last_ok = start_step
        replayed = 0
        mismatch_step = None
        mismatch_obs = None
        for a in todo:
            obs = self.exec(handle, a)
            replayed += 1
            if obs.sha256 != a.observation_sha256:
                mismatch_step, mismatch_obs = a.step, obs
                break
            last_ok = a.step
        return RecoverOutcome(
            handle=handle, mode=mode, source=source, restored_step=start_step, replayed_steps=replayed,
            consistent=mismatch_step is None, consistent_at=last_ok, mismatch_step=mismatch_step,
            mismatch_observation=mismatch_obs, notes=notes, restore_s=restore_s,
            replay_s=time.monotonic() - t1,
        )  # fmt: skip

    def delete_checkpoints(self, sandbox_id: str) -> int:
        """Delete the lineage's checkpoints; its lineage records stay (belayer/sandbox/lineage.py)."""
        prefix = f"{self.cfg.checkpoint_prefix}{checked_sandbox_id(sandbox_id)}/"
        dirs = {key[len(prefix) :].split("/", 1)[0] + "/" for key in self.store.list(prefix)}
        return sum(self.store.delete_prefix(prefix + d) for d in sorted(dirs - {lineage.DIR}))

    # ------------------------------------------------------------------ drain
    def move_out(self, sandbox_id: str, deadline: float) -> DrainedSandbox:
        """Checkpoint one sandbox at its next safe point (no action running) and remove it,
        recording the checkpoint for the recovery on another host (belayer/sandbox/drain.py).
        Not idle by `deadline` (time.monotonic()), or not checkpointable: killed, "fell-back"."""
        t0 = time.monotonic()
        lock = self._lock(sandbox_id)
        if not lock.acquire(timeout=max(0.0, deadline - t0)):
            self.backend.destroy(sandbox_id)  # the action in flight dies with it
            self._gone(sandbox_id)
            return DrainedSandbox(sandbox_id=sandbox_id, outcome="fell-back", waited_s=time.monotonic() - t0,
                                  detail="still running an action at the deadline: killed")  # fmt: skip
        try:
            waited = time.monotonic() - t0
            newest = lineage.newest(self.store, self.cfg.checkpoint_prefix, sandbox_id)
            if newest is not None and newest.host_queue != self.host_queue:
                self.backend.destroy(sandbox_id)
                return DrainedSandbox(
                    sandbox_id=sandbox_id,
                    outcome="gone",
                    waited_s=waited,
                    detail=f"superseded by generation {newest.generation} on {newest.host_queue}",
                )
            self._moved[sandbox_id] = False  # from here on its calls are told it moved
            try:
                info = channel.call(self._sock(sandbox_id), {"op": "quiesce"}, timeout_s=10)
                container = self.backend.container_name(sandbox_id, info["generation"])
                handle = self._handle(sandbox_id, info["generation"], container)
                ref = self._dump(handle, info)
                drain.write_record(
                    self.store,
                    self.cfg.checkpoint_prefix,
                    drain.DrainRecord(
                        sandbox_id=sandbox_id,
                        generation=handle.generation,
                        host_queue=self.host_queue,
                        checkpoint=ref,
                    ),
                )
            except Exception as exc:  # noqa: BLE001 -- any failure: the last checkpoint is the fallback
                self.backend.destroy(sandbox_id)
                return DrainedSandbox(sandbox_id=sandbox_id, outcome="fell-back", waited_s=waited,
                                      paused_s=time.monotonic() - t0 - waited,
                                      detail=f"checkpoint failed, killed: {type(exc).__name__}: {exc}")  # fmt: skip
            self.backend.destroy(sandbox_id)
            return DrainedSandbox(sandbox_id=sandbox_id, outcome="moved", step=ref.step, waited_s=waited,
                                  paused_s=time.monotonic() - t0 - waited)  # fmt: skip
        finally:
            lock.release()
            self._gone(sandbox_id)

    def drained_checkpoint(self, handle: SandboxHandle) -> CheckpointRef | None:
        """The checkpoint a drain took of exactly this generation, if one did."""
        checked_sandbox_id(handle.sandbox_id)
        record = drain.find_record(
            self.store, self.cfg.checkpoint_prefix, handle.sandbox_id, handle.generation
        )
        return record.checkpoint if record is not None else None

    # ------------------------------------------------------------------ lineage fencing
    def _record_lineage(self, sandbox_id: str, generation: int, container: str) -> None:
        lineage.write(
            self.store, self.cfg.checkpoint_prefix, sandbox_id, generation, self.host_queue, container
        )

    def _refuse_if_superseded(self, handle: SandboxHandle) -> None:
        """Refuse a handle whose lineage has a newer generation, and fence it if it lives elsewhere.

        The supervisor refuses a stale generation only inside the newest container; a
        container left on a host that lost contact (its worker died, the lineage was
        restored on another host) still carries the old generation and would run the
        action. So every action and checkpoint first lists the lineage's records: one
        LIST request. Measured on the 2-core dev machine against local SeaweedFS
        (200 calls): 4.4 ms median, 8 ms p90, while the cheapest action (`true`) takes
        160-230 ms median through the supervisor -- 2-3 %, paid on every call. A
        per-sandbox cache would miss exactly the case that matters: a host that never
        restarted (cut off, not dead), whose cached generation equals the stale
        handle's. A store error propagates (fail closed): the translator makes a
        transient one retryable.
        """
        checked_sandbox_id(handle.sandbox_id)
        newest = lineage.newest_generation(self.store, self.cfg.checkpoint_prefix, handle.sandbox_id)
        if newest is None or newest <= handle.generation:
            return
        rec = lineage.newest(self.store, self.cfg.checkpoint_prefix, handle.sandbox_id)
        where = f"{rec.host_queue} (container {rec.container})" if rec else "another host"
        if rec is not None and rec.host_queue != self.host_queue:
            self._fence_superseded(handle.sandbox_id, rec)
        raise StaleGeneration(
            f"sandbox {handle.sandbox_id} is at generation {newest} on {where}, the handle at "
            f"{handle.generation}: a restore superseded this handle; use the newer one"
        )

    def sweep_stale(self) -> list[str]:
        """Fence every local container whose lineage moved to another host; returns their names.

        Run by the sandbox worker before it serves (a host coming back after a recovery
        elsewhere). Lineages without records (older Belayer, another store) are left alone,
        and so are containers whose sandbox label is no id Belayer makes (with a log line):
        no store key or path is built from it.
        """
        fenced: list[str] = []
        for sandbox_id, names in self.backend.lineages().items():
            try:
                checked_sandbox_id(sandbox_id)
            except InvalidSandboxId as exc:
                logger.warning("sweep skipped container(s) %s: %s", ", ".join(names), exc)
                continue
            rec = lineage.newest(self.store, self.cfg.checkpoint_prefix, sandbox_id)
            if rec is not None and rec.host_queue != self.host_queue:
                fenced += self._fence_superseded(sandbox_id, rec, names)
        return fenced

    def _fence_superseded(self, sandbox_id: str, rec: lineage.LineageRecord,
                          names: list[str] | None = None) -> list[str]:  # fmt: skip
        with self._lock(sandbox_id):
            names = self.backend.lineages().get(sandbox_id, []) if names is None else names
            self.backend.destroy(sandbox_id)
        self._gone(sandbox_id)
        if names:
            logger.warning("fenced %s of sandbox %s on %s: its lineage is at generation %d on %s (container %s)",
                        ", ".join(names), sandbox_id, self.host_queue, rec.generation, rec.host_queue,
                        rec.container)  # fmt: skip
        return names


def loss_cause(ended: ContainerExit, oom_kills: int | None) -> tuple[str, str]:
    """Why a sandbox was lost, from how its container ended and the OOM kills counted in its
    memory cgroup: (an errors.LOST_* cause, the reason in words).

    Inside the container nothing can SIGKILL PID 1 (the kernel drops signals to a pid
    namespace's init that it has no handler for) and PID 1 handles every other signal by
    doing nothing, so: a container removed, or killed or stopped by anyone on the host
    (podman records each `kill` / `stop`), was lost from outside; PID 1 SIGKILLed while
    OOM kills are counted in its cgroup was killed by the sandbox's own memory limit; PID 1
    that exited with a status of its own ended by itself. Anything else -- a SIGKILL with no
    OOM kill counted, another signal, a container still running but not answering -- has
    no cause found: the workflow recovers it, and the same action losing the sandbox again
    after the restore makes it the policy's."""

    if not ended.found:
        return (
            errors.LOST_FROM_OUTSIDE,
            "its container is gone from this host (removed: a fence, a drain, a destroy)",
        )
    if ended.stopped_from_outside:
        stopped = ", ".join(ended.stopped_from_outside)
        return errors.LOST_FROM_OUTSIDE, f"its container was stopped from outside (podman {stopped})"
    if ended.running:
        return errors.LOST_UNEXPLAINED, "its container still runs but its supervisor does not answer"
    if ended.exit_code == 128 + 9 and (oom_kills or ended.oom_killed):
        return errors.LOST_TO_OOM, (
            f"PID 1 was killed by the OOM killer of the sandbox's own memory limit "
            f"({oom_kills or 'some'} OOM kills in its memory cgroup)"
        )
    if ended.exit_code is not None and ended.exit_code > 128:
        return errors.LOST_UNEXPLAINED, (
            f"PID 1 was ended by signal {ended.exit_code - 128} with no OOM kill counted "
            "and no kill or stop on record from outside"
        )
    return (
        errors.LOST_PID1_EXITED,
        f"PID 1 exited by itself (status {ended.exit_code}); nothing outside stopped it",
    )


def _ref_of(meta_key: str, meta: CheckpointMeta) -> CheckpointRef:
    """What the workflow keeps of the checkpoint whose meta.json is `meta` at `meta_key`."""
    return CheckpointRef(meta_key=meta_key, step=meta.step, archive_sha256=meta.archive_sha256,
                         archive_bytes=meta.archive_bytes, fs_sha256=meta.fs_sha256)  # fmt: skip


def _check_prefix(ref: CheckpointRef, meta: CheckpointMeta, log: list[LoggedAction]) -> None:
    """The checkpoint's recorded token prefix is the context the log has after its step,
    hence a prefix of the trajectory's current context; else it is from a discarded branch."""
    at = next((a for a in log if a.step == meta.step), None)
    if at is None or at.token_prefix_len is None:
        return  # a log that records no contexts (the benchmarks) or starts later: nothing to compare
    if meta.token_prefix_len is None:
        return  # a drain's checkpoint (belayer/sandbox/drain.py): its generation pins it to this branch
    if (meta.token_prefix_len, meta.token_prefix_sha256) != (at.token_prefix_len, at.token_prefix_sha256):
        raise CheckpointInconsistent(
            f"{ref.meta_key} (step {meta.step}) recorded a context of {meta.token_prefix_len} tokens "
            f"(sha256 {str(meta.token_prefix_sha256)[:12]}), the trajectory has {at.token_prefix_len} "
            f"(sha256 {at.token_prefix_sha256[:12]}) there: a checkpoint of a discarded branch"
        )


class _PhaseClock:
    """Seconds between laps, into `phases` when the caller asked for them."""

    def __init__(self, phases: dict[str, float] | None):
        self.phases = phases
        self.last = time.monotonic()

    def lap(self, name: str) -> None:
        now = time.monotonic()
        if self.phases is not None:
            self.phases[name] = now - self.last
        self.last = now


def _damage(archive: Path) -> None:
    """Cut a checked, unpacked archive in half (fault point). A flipped byte is not enough:
    it can land in a page image and restore silently wrong memory -- which is why the
    sha256 of every archive is checked before podman sees it."""
    os.truncate(archive, archive.stat().st_size // 2)


def make_host(config, *, store=None, host_queue: str | None = None) -> SandboxHost:
    """A SandboxHost for the effective BelayerConfig (the backend `sandbox.backend` names,
    its object store)."""

    # checkpoints hold process memory: encrypted at rest when a key is configured
    if store is None:
        store = open_store(config.storage)
    else:
        store = archive_store(store, config.storage.encryption_key)
    backend = open_backend(config.sandbox, config.state_dir, config.cache_dir)
    return SandboxHost(config.sandbox, backend, store, state_dir=config.state_dir, host_queue=host_queue)
