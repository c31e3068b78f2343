"""Task images: built by `podman build` from a task's own Dockerfile, offline, cached by the
hash of the build context.

A Harbor task (belayer/workloads/harbor.py) brings its environment as a Dockerfile. Belayer
builds it with podman's own builder into Belayer's podman storage, so multi-stage builds,
`ENV`, `USER`, `WORKDIR`, `COPY` and `RUN` mean what Dockerfiles mean; nothing here parses
more of a Dockerfile than its `FROM` lines.

Sandbox hosts reach only the package registries, not image registries, so a `FROM` image
must already be in Belayer's storage or be mapped onto one that is: `sandbox.base_images`
maps a name (`ubuntu:24.04`, `python:3.12-slim`) to a local image (by default Belayer's own
Debian base). The mapping is handed to the builder as named build contexts
(`--build-context NAME=docker-image://LOCAL`), so the Dockerfile is built as written. A
`FROM` that is neither present nor mapped is refused before the build starts, naming the
image and the setting to add; the builder never pulls (`--pull=never`).

An image is tagged `localhost/belayer-task/<task id>:<context hash>` and labelled with the
hash: building the same context again is a lookup, a changed file is a new tag.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import subprocess
import threading
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import psutil

from belayer.errors import BelayerError
from belayer.sandbox import runtime
from belayer.sandbox.errors import SandboxError
from belayer.storage.errors import ObjectNotFound

TASK_IMAGE_REPOSITORY = "localhost/belayer-task"
CONTEXT_LABEL = "org.belayer.context-sha256"
_FROM = re.compile(
    r"^\s*FROM\s+(?:--platform=\S+\s+)?(?P<image>\S+)(?:\s+AS\s+(?P<stage>\S+))?\s*$", re.IGNORECASE
)


_STEP = re.compile(r"^(\[\d+/\d+\] )?STEP \d+/\d+: ")  # "[2/2] STEP 3/6: ENV ..." in a multi-stage build


class ImageBuildError(BelayerError):
    """A task image could not be built; the message names the task, the cause and the fix."""


@dataclass(frozen=True)
class BaseImageUse:
    """One `FROM` of a Dockerfile that names an image (not an earlier stage)."""

    image: str
    line: int


@dataclass(frozen=True)
class TaskImage:
    """A built (or found) task image."""

    tag: str
    image_id: str
    context_sha256: str
    cached: bool  # found under its tag: no build ran


def base_images_of(dockerfile_text: str) -> list[BaseImageUse]:
    """The images a Dockerfile's `FROM` lines start from; a `FROM` naming an earlier stage
    (`FROM build AS final` after `... AS build`) is a stage, not an image. Line
    continuations are joined first, as the builder joins them."""
    stages: set[str] = set()
    uses = []
    for number, line in _logical_lines(dockerfile_text):
        match = _FROM.match(line)
        if match is None:
            continue
        image = match["image"]
        if image.lower() not in stages and image.lower() != "scratch":
            uses.append(BaseImageUse(image=image, line=number))
        if match["stage"]:
            stages.add(match["stage"].lower())
    return uses


def _logical_lines(text: str) -> list[tuple[int, str]]:
    lines, pending, start = [], "", 0
    for number, raw in enumerate(text.splitlines(), 1):
        if not pending:
            start = number
        if raw.rstrip().endswith("\\"):
            pending += raw.rstrip()[:-1] + " "
            continue
        lines.append((start, pending + raw))
        pending = ""
    if pending:
        lines.append((start, pending))
    return lines


def context_sha256(context: Path, dockerfile: Path, base_ids: Sequence[str] = ()) -> str:
    """The hash of everything the build reads: every file of the context (relative path,
    executable bit, content; symlinks by target), the Dockerfile, and the ids of the images
    its `FROM` lines resolve to (a base image rebuilt since makes the task's image anew)."""
    digest = hashlib.sha256()
    for base_id in base_ids:
        digest.update(f"B {base_id}\n".encode())
    for path in sorted(p for p in context.rglob("*") if not p.is_dir() or p.is_symlink()):
        relative = path.relative_to(context).as_posix()
        if path.is_symlink():
            digest.update(f"L {relative} -> {os.readlink(path)}\n".encode())
            continue
        executable = "x" if os.access(path, os.X_OK) else "-"
        digest.update(f"F {relative} {executable} {path.stat().st_size}\n".encode())
        digest.update(path.read_bytes())
    digest.update(b"D " + dockerfile.read_bytes())
    return digest.hexdigest()


def task_image_tag(task_id: str, context_hash: str) -> str:
    return f"{TASK_IMAGE_REPOSITORY}/{task_id.lower()}:{context_hash[:16]}"


class ImageBuilder:
    """Builds task images into the podman storage of `state_dir` (the sandbox host's)."""

    def __init__(self, base_images: Mapping[str, str], state_dir: Path | None = None,
                 cache_dir: Path | None = None, network: bool = True) -> None:  # fmt: skip
        self.base_images = dict(base_images)
        self.state_dir = state_dir
        self.cache_dir = cache_dir
        self.network = network  # RUN lines reach what the machine reaches (package registries)

    def podman(self, *args: str, timeout: float = 120.0) -> subprocess.CompletedProcess:
        return runtime.run_podman(*args, state_dir=self.state_dir, cache_dir=self.cache_dir, timeout=timeout)

    def image_id(self, reference: str) -> str | None:
        found = self.podman("image", "inspect", "--format", "{{.Id}}", reference)
        return (
            found.stdout.strip().splitlines()[0] if found.returncode == 0 and found.stdout.strip() else None
        )

    def base_ids(self, task_id: str, dockerfile: Path) -> list[str]:
        """The ids of the images the Dockerfile's `FROM` lines resolve to (mapped or present);
        refuses an unmapped, absent one (`build_contexts` says how)."""
        self.build_contexts(task_id, dockerfile)
        uses = base_images_of(dockerfile.read_text(encoding="utf-8"))
        return [self.image_id(self.base_images.get(use.image, use.image)) or "" for use in uses]

    def build_contexts(self, task_id: str, dockerfile: Path) -> list[str]:
        """`--build-context` flags for the mapped `FROM` images; refuses an unmapped, absent one."""
        flags = []
        for use in base_images_of(dockerfile.read_text(encoding="utf-8")):
            mapped = self.base_images.get(use.image)
            if mapped is not None:
                if self.image_id(mapped) is None:
                    raise ImageBuildError(
                        f"task {task_id}: sandbox.base_images maps {use.image} to {mapped}, which is not in "
                        f"Belayer's podman storage: build it (`make install` builds the base image) or change the mapping"
                    )
                flags.append(f"--build-context={use.image}=docker-image://{mapped}")
            elif self.image_id(use.image) is None:
                raise ImageBuildError(
                    f"task {task_id}: {dockerfile}:{use.line}: FROM {use.image} is not in Belayer's podman "
                    "storage, and sandboxes build offline (no image registry): map it onto a local image, e.g. "
                    f'`[sandbox.base_images]` `"{use.image}" = "{runtime.base_image_name()}"` in the config file '
                    f'(or BELAYER_SANDBOX__BASE_IMAGES=\'{{"{use.image}": "{runtime.base_image_name()}"}}\')'
                )
        return flags

    def build(self, task_id: str, context: Path, dockerfile: Path, *, timeout_s: float = 600.0,
              progress: Callable[[str], None] | None = None) -> TaskImage:  # fmt: skip
        """The task's image: found by its context hash, or built; each build step goes to `progress`."""
        context_hash = context_sha256(context, dockerfile, self.base_ids(task_id, dockerfile))
        tag = task_image_tag(task_id, context_hash)
        found = self.image_id(tag)
        if found is not None:
            return TaskImage(tag=tag, image_id=found, context_sha256=context_hash, cached=True)
        args = [
            "build", "--pull=never", "--layers", "-f", str(dockerfile), "-t", tag,
            f"--label={CONTEXT_LABEL}={context_hash}", f"--network={'host' if self.network else 'none'}",
            *self.build_contexts(task_id, dockerfile), str(context),
        ]  # fmt: skip
        output = self._stream(task_id, args, timeout_s, progress)
        image_id = self.image_id(tag)
        if image_id is None:
            raise ImageBuildError(
                f"task {task_id}: podman build ended without the image {tag}:\n{output[-2000:]}"
            )
        return TaskImage(tag=tag, image_id=image_id, context_sha256=context_hash, cached=False)

    def _stream(self, task_id: str, args: list[str], timeout_s: float,
                progress: Callable[[str], None] | None) -> str:  # fmt: skip
        """Run the build, handing each `STEP` line to `progress`; the whole output on failure.

        podman logs at debug level so that the working containers and RUN bundles this
        build makes are known by name (`BuildLeftovers`): a build killed at its limit
        cleans up nothing itself, and only this build's are removed, never a concurrent
        one's."""
        command = runtime.podman_command("--log-level=debug", *args, state_dir=self.state_dir,
                                         cache_dir=self.cache_dir)  # fmt: skip
        env = runtime.podman_env(state_dir=self.state_dir, cache_dir=self.cache_dir)
        lines: list[str] = []
        made = BuildLeftovers()
        with subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              stdin=subprocess.DEVNULL, text=True, errors="replace") as build:  # fmt: skip
            logs = threading.Thread(target=made.read, args=(build.stderr, lines), daemon=True)
            logs.start()
            # The clock runs while the output is read: a build that prints nothing for long
            # (one slow RUN) is still killed at its limit.
            timed_out = threading.Event()
            watchdog = threading.Timer(timeout_s, lambda: (timed_out.set(), _kill_tree(build.pid)))
            watchdog.start()
            try:
                for line in build.stdout:
                    lines.append(line.rstrip("\n"))
                    if progress is not None and _STEP.match(line):
                        progress(f"{task_id}: {line.strip()}")
                build.wait()
                logs.join()
            finally:
                watchdog.cancel()
        if timed_out.is_set():
            self._remove(made)
            raise ImageBuildError(
                f"task {task_id}: the image build ran past {timeout_s:g} s ([environment].build_timeout_sec)"
            )
        output = "\n".join(lines)
        if build.returncode != 0:
            raise ImageBuildError(
                f"task {task_id}: podman build failed (exit {build.returncode}):\n{output[-3000:]}"
            )
        return output

    def _remove(self, made: BuildLeftovers) -> None:
        """What a killed build leaves: each RUN step's runc container (its processes, cgroups
        and state under /run/runc: `runc delete --force`) and bundle in /var/tmp, and the
        working containers, which hold their base images in the storage."""
        for bundle in made.bundles:
            subprocess.run(["runc", "delete", "--force", f"buildah-{bundle.name}"], capture_output=True,
                           env=runtime.podman_env(), timeout=60, check=False)  # fmt: skip
            shutil.rmtree(bundle, ignore_errors=True)
        for container in made.containers:
            self.podman("rm", "--force", container)


class BuildLeftovers:
    """The working containers and RUN bundles one `podman build` made, read from its debug
    log (stderr); its warnings and errors join the build's output, its debug and info lines
    do not."""

    _CONTAINER = re.compile(r"Container ID: (?P<id>[0-9a-f]{64})")
    _BUNDLE = re.compile(r'using \\"(?P<path>/[^"\\]+)\\" to hold bundle data')

    def __init__(self) -> None:
        self.containers: list[str] = []
        self.bundles: list[Path] = []

    def read(self, stderr, lines: list[str]) -> None:
        for line in stderr:
            if "level=debug" not in line and "level=info" not in line:
                lines.append(line.rstrip("\n"))
            elif found := self._CONTAINER.search(line):
                self.containers.append(found["id"])
            elif (found := self._BUNDLE.search(line)) and Path(found["path"]).name.startswith("buildah"):
                self.bundles.append(Path(found["path"]))


def _kill_tree(pid: int) -> None:
    """SIGKILL a build and every process under it (a RUN step's processes outlive podman
    otherwise). The tree is stopped first, pass after pass until a pass finds nothing new,
    so no process forks a child after the tree was listed (a stopped one cannot)."""
    try:
        tree = {pid: psutil.Process(pid)}
    except psutil.Error:
        return
    while True:
        for member in list(tree.values()):
            with contextlib.suppress(psutil.Error):
                member.suspend()
        found = {}
        for member in list(tree.values()):
            with contextlib.suppress(psutil.Error):
                found.update((child.pid, child) for child in member.children(recursive=True))
        if found.keys() <= tree.keys():
            break
        tree.update(found)
    for member in tree.values():
        with contextlib.suppress(psutil.Error):
            member.kill()


# ----------------------------------------------------------------------------- hosts share images
#
# A checkpoint restores only onto the image it was taken on, with the same id. A base image
# is imported from the same tarball on every host (infra/install/base-image.sh), so ids
# match by construction; a task image is built once, on one host, and travels through the
# object store instead: the first host to run it saves it there under its id
# (`images/<id>/image.tar`, with the name it carries), and a host that lacks it loads it
# from there, and checks the id it gets. Rebuilding it from the Dockerfile elsewhere would
# give another id (timestamps), and another file system if a `RUN` line reached the network.

IMAGES_PREFIX = "images/"


def _archive_key(image_id: str) -> str:
    return f"{IMAGES_PREFIX}{image_id.removeprefix('sha256:')}/image.tar"


def _name_key(name: str) -> str:
    return f"{IMAGES_PREFIX}names/{hashlib.sha256(name.encode()).hexdigest()}.json"


class ImageUnavailable(SandboxError):
    """A sandbox needs an image this host lacks and the object store does not hold (or
    holds another one under its id): not retried here, the image will not appear."""


def share_image(backend, store, name: str, work_dir: Path) -> str:
    """Put image `name` (present here) in the store once, by id; return its id."""
    image_id = backend.image_id(name)
    if not image_id:
        raise ImageUnavailable(f"image {name} is not on this host: build it first (belayer tasks check)")
    if not store.exists(_archive_key(image_id)):
        archive = _scratch_archive(work_dir, image_id)
        try:
            backend.save_image(name, archive)
            with archive.open("rb") as f:
                store.upload_stream(_archive_key(image_id), f)
        finally:
            archive.unlink(missing_ok=True)
    store.put_bytes(_name_key(name), json.dumps({"name": name, "image_id": image_id}).encode())
    return image_id


def ensure_image(backend, store, name: str, image_id: str | None, work_dir: Path) -> str:
    """Image `name` on this host, with `image_id` when given (a checkpoint's); loaded from the
    store when this host lacks it. Returns its id; refuses another id than the one asked for."""
    here = backend.image_id(name)
    if image_id is None and not here:
        image_id = _shared_id(store, name)
    if image_id is not None and here != image_id:
        _load(backend, store, name, image_id, work_dir)
        here = backend.image_id(name)
    if image_id is not None and here != image_id:
        raise ImageUnavailable(
            f"image {name} loaded from the object store has id {here or 'none'}, the checkpoint needs {image_id}"
        )
    return here


def _shared_id(store, name: str) -> str:
    try:
        return json.loads(store.get_bytes(_name_key(name)))["image_id"]
    except (ObjectNotFound, KeyError, ValueError):
        raise ImageUnavailable(
            f"image {name} is neither on this host nor in the object store: build it on one host "
            "(belayer tasks check) and run a sandbox of it there first"
        ) from None


def _scratch_archive(work_dir: Path, image_id: str) -> Path:
    """A path of its own for one image archive in flight: two sandboxes of one image started
    at once on a host each save or load their own copy, never the other's half-written one."""
    work_dir.mkdir(parents=True, exist_ok=True)
    return (
        work_dir / f"image-{image_id.removeprefix('sha256:')[:16]}-{os.getpid()}-{uuid.uuid4().hex[:8]}.tar"
    )


def _load(backend, store, name: str, image_id: str, work_dir: Path) -> None:
    archive = _scratch_archive(work_dir, image_id)
    try:
        with archive.open("wb") as f:
            store.download_stream(_archive_key(image_id), f)
        backend.load_image(archive)
    except ObjectNotFound:
        raise ImageUnavailable(
            f"image {name} (id {image_id}) is not on this host and not in the object store "
            f"({_archive_key(image_id)})"
        ) from None
    finally:
        archive.unlink(missing_ok=True)
