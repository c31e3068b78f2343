"""Belayer's trusted toolchain: the interpreter Belayer's own helpers run in every sandbox.

PID 1 (infra/sandbox/supervisor.py), the capability-holding helper that starts each
action, and the workspace hash the reward trusts are Python programs Belayer runs inside
the agent's container. They must not come from the image: with a writable root file
system (a Harbor task's own image) the agent can replace `/usr/bin/python3`, plant a
`sitecustomize` in its standard library or name a library in `/etc/ld.so.preload`, and
the next helper -- holding PID 1's capabilities, or computing the hash -- would run the
agent's code.

So the install step (infra/install/toolchain.sh) copies, from Belayer's own base rootfs
(the cached `base-rootfs-<release>-v<N>.tar` of infra/install/base-image.sh, or, when that
tarball is gone, the imported base image), into one host directory:

    lib/ld-linux-x86-64.so.2   the dynamic loader, which never reads /etc/ld.so.preload
                               (that path in it is replaced by one under the mount point,
                               which never exists: the mount is read-only)
    lib/<name>                 every shared library the interpreter and its extension
                               modules need (DT_NEEDED, transitively), as regular files
    usr/bin/python3            the interpreter (python3.11 on bookworm)
    usr/lib/python3.X/         its standard library, byte-compiled (unchecked-hash .pyc:
                               nothing can change a source under a read-only mount)
    supervisor.py              infra/sandbox/supervisor.py
    drop_caps_exec.py          infra/sandbox/drop_caps_exec.py (the helper starting each action)

The directory is named by the hash of its contents (`<cache>/toolchain/<hash>`): the same
path on every host built from the same rootfs and supervisor, which a restore needs
(podman re-creates the bind mount at the recorded source path, and CRIU maps the same
files again), and never two contents at one path. `<cache>/toolchain/for-<input key>`
links to the one built for this checkout's supervisor and rootfs (`installed`).

Every sandbox mounts it read-only at /.belayer (belayer/sandbox/podman.py), and Belayer's
helpers run its interpreter through its own loader, with its own libraries only
(`python_command`): `--inhibit-cache` keeps the loader off the image's ld.so.cache, `-I -S`
keeps Python off the environment, the user site and `site`, and its prefix is found next
to the executable (/.belayer/usr), so `sys.path` holds the toolchain's standard library
alone. `LC_ALL=C` (`ENVIRONMENT`) keeps glibc from loading the image's locale files.

Stdlib only: the install step runs it with the system python3
(`python3 -m belayer.sandbox.toolchain build`).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import shutil
import stat
import struct
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Iterator
from pathlib import Path, PurePosixPath

from belayer.sandbox import runtime

MOUNT = "/.belayer"  # where every sandbox sees the toolchain (read-only)
LOADER = "ld-linux-x86-64.so.2"
# Bump when what `build` puts in the directory changes (the input key names it).
LAYOUT_VERSION = "2"
SUPERVISOR = runtime.INFRA_DIR / "sandbox" / "supervisor.py"
# Copied beside the supervisor, which runs it to start each action.
HELPERS = (SUPERVISOR, runtime.INFRA_DIR / "sandbox" / "drop_caps_exec.py")
# The environment of every toolchain process: the C locale is glibc's own, so no locale
# file of the image is read (a UTF-8 locale would be, and Python coerces "C" to one
# unless LC_ALL is set).
ENVIRONMENT = {"LC_ALL": "C"}
# The loader reads this file at every start, however it is invoked: in a sandbox whose
# root is writable it would be the agent's. Replaced in the toolchain's copy by a path of
# the same length or shorter under the (read-only) mount point, which never exists.
PRELOAD_FILE = b"/etc/ld.so.preload\0"
NO_PRELOAD_FILE = (MOUNT + "/-").encode().ljust(len(PRELOAD_FILE), b"\0")
EPOCH = 1704067200  # every file's mtime (infra/install/base-image.sh's)
LIBRARY_DIRS = ("lib/x86_64-linux-gnu", "usr/lib/x86_64-linux-gnu", "lib", "usr/lib")


def python_command(root: str = MOUNT) -> list[str]:
    """The toolchain's interpreter, with its own loader and libraries, isolated from the
    environment and without `site`; append a script or `-c CODE` and its arguments."""
    return [f"{root}/lib/{LOADER}", "--inhibit-cache", "--library-path", f"{root}/lib",
            f"{root}/usr/bin/python3", "-I", "-S"]  # fmt: skip


def supervisor_argv() -> list[str]:
    """PID 1 of a sandbox: the toolchain's supervisor, told the interpreter command its
    capability-holding helper must be started with (never the image's python3)."""
    return [*python_command(), f"{MOUNT}/supervisor.py", "--interpreter", *python_command()]


# ----------------------------------------------------------------------------- where


def _cache(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    return (Path(cache_dir).expanduser() if cache_dir is not None else runtime.default_cache_dir()).absolute()


def toolchain_root(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    return _cache(cache_dir) / "toolchain"


def rootfs_tar(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """The base rootfs tarball infra/install/base-image.sh caches for this host's release."""
    release = _os_release().get("VERSION_CODENAME", "")
    version = runtime._versions().get("BASE_IMAGE_VERSION", "1")
    return _cache(cache_dir) / f"base-rootfs-{release}-v{version}.tar"


def input_key(cache_dir: str | os.PathLike[str] | None = None) -> str:
    """What a toolchain is built from: the rootfs (by name: release and image version), the
    supervisor's and its helper's bytes and this module's layout."""
    h = hashlib.sha256()
    parts = (
        rootfs_tar(cache_dir).name.encode(),
        *(helper.read_bytes() for helper in HELPERS),
        LAYOUT_VERSION.encode(),
    )
    for part in parts:
        h.update(hashlib.sha256(part).digest())
    return h.hexdigest()[:16]


def installed(cache_dir: str | os.PathLike[str] | None = None) -> Path | None:
    """The toolchain built for this checkout (its content-hash directory), or None."""
    link = toolchain_root(cache_dir) / f"for-{input_key(cache_dir)}"
    target = Path(os.path.realpath(link))
    complete = all((target / helper.name).is_file() for helper in HELPERS)
    return target if link.is_symlink() and complete else None


# ----------------------------------------------------------------------------- build


def build(cache_dir: str | os.PathLike[str] | None = None, state_dir: str | os.PathLike[str] | None = None,
          log=print) -> Path:  # fmt: skip
    """The toolchain for this checkout, built when missing (idempotent); its directory."""
    done = installed(cache_dir)
    if done is not None:
        return done
    root = toolchain_root(cache_dir)
    root.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".build-", dir=root))
    try:
        with _source_rootfs(cache_dir, state_dir, log) as source:
            _copy_runtime(source, work)
        for helper in HELPERS:
            shutil.copyfile(helper, work / helper.name)
        _compile_stdlib(work)
        _normalize(work)
        digest = content_hash(work)
        final = root / digest
        if final.exists():
            shutil.rmtree(work)
        else:
            work.rename(final)
        link = root / f"for-{input_key(cache_dir)}"
        tmp_link = root / f".{link.name}.tmp"
        tmp_link.unlink(missing_ok=True)
        tmp_link.symlink_to(digest)
        tmp_link.replace(link)
        log(f"[toolchain] {final} ({_size_mb(final):.0f} MB) for input {link.name}")
        return final
    finally:
        shutil.rmtree(work, ignore_errors=True)


class _Rootfs:
    """Files of a rootfs tarball by path, symbolic links followed inside it."""

    def __init__(self, tar: tarfile.TarFile):
        self.tar = tar
        self.members = {_norm(m.name): m for m in tar.getmembers()}

    def resolve(self, path: str) -> str:
        """`path` with every symbolic link along it followed, inside the rootfs."""
        todo = list(PurePosixPath(_norm(path)).parts)
        done: list[str] = []
        for _ in range(1024):
            if not todo:
                return "/".join(done)
            name = todo.pop(0)
            if name == "..":
                done = done[:-1]
                continue
            member = self.members.get("/".join([*done, name]))
            if member is None or not member.issym():
                done.append(name)
                continue
            target = PurePosixPath(member.linkname)
            if target.is_absolute():
                done, target = [], target.relative_to("/")
            todo = [*target.parts, *todo]
        raise ValueError(f"too many symbolic links under {path}")

    def read(self, path: str) -> bytes:
        member = self.members[self.resolve(path)]
        f = self.tar.extractfile(member)
        if f is None:
            raise ValueError(f"{path} is not a regular file in the rootfs")
        return f.read()

    def exists(self, path: str) -> bool:
        return self.resolve(path) in self.members

    def files_under(self, directory: str) -> Iterator[tuple[str, tarfile.TarInfo]]:
        """(path relative to `directory`, member) of every regular file below it."""
        base = self.resolve(directory) + "/"
        for name, member in sorted(self.members.items()):
            if name.startswith(base) and (member.isreg() or member.islnk()):
                yield name[len(base) :], member


def _copy_runtime(rootfs: _Rootfs, dest: Path) -> None:
    """The interpreter, its standard library, the libraries they need and the loader."""
    python = rootfs.resolve("usr/bin/python3")  # usr/bin/python3.11
    version = PurePosixPath(python).name.removeprefix("python")
    stdlib = f"usr/lib/python{version}"
    interpreter = rootfs.read(python)
    _write(dest / "usr/bin/python3", interpreter, 0o755)
    extensions = []
    for rel, member in rootfs.files_under(stdlib):
        if "/__pycache__/" in f"/{rel}" or rel.startswith(("site-packages/", "dist-packages/")):
            continue
        data = rootfs.tar.extractfile(member).read()
        _write(dest / stdlib / rel, data, 0o644)
        if rel.endswith(".so"):
            extensions.append(data)
    loader = elf_interpreter(interpreter)
    if PurePosixPath(loader).name != LOADER:
        raise ValueError(f"the rootfs's python3 asks for the loader {loader}, this toolchain knows {LOADER}")
    _write(dest / "lib" / LOADER, without_preload_file(rootfs.read(loader)), 0o755)
    for name, data in _libraries(rootfs, [interpreter, *extensions]).items():
        _write(dest / "lib" / name, data, 0o644)


def _libraries(rootfs: _Rootfs, objects: list[bytes]) -> dict[str, bytes]:
    """Every shared library `objects` need, by the name they ask for, transitively."""
    found: dict[str, bytes] = {}
    todo = [name for obj in objects for name in elf_needed(obj)]
    while todo:
        name = todo.pop()
        if name in found or name == LOADER:
            continue
        path = next((f"{d}/{name}" for d in LIBRARY_DIRS if rootfs.exists(f"{d}/{name}")), None)
        if path is None:
            raise ValueError(f"shared library {name} is not in the rootfs")
        found[name] = rootfs.read(path)
        todo.extend(elf_needed(found[name]))
    return found


def without_preload_file(loader: bytes) -> bytes:
    """The loader with its /etc/ld.so.preload replaced by a path that never exists."""
    if loader.count(PRELOAD_FILE) != 1:
        raise ValueError(
            f"the loader names {PRELOAD_FILE!r} {loader.count(PRELOAD_FILE)} times, expected once"
        )
    return loader.replace(PRELOAD_FILE, NO_PRELOAD_FILE)


def _compile_stdlib(work: Path) -> None:
    """Byte-compile the standard library with the toolchain's own interpreter, recording
    the paths it has in a sandbox. Unchecked-hash .pyc files (no source mtime in them) and
    a fixed hash seed make the bytes the same on every build; files that do not compile
    (test data with deliberate syntax errors) stay source only."""
    stdlib = next((work / "usr/lib").glob("python3*"))
    code = ("import compileall, py_compile, sys; compileall.compile_dir(sys.argv[1], ddir=sys.argv[2], quiet=2, "
            "force=True, workers=1, invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH)")  # fmt: skip
    argv = python_command(str(work))
    # -I would ignore PYTHONHASHSEED, so the environment is given whole instead; -P keeps the
    # working directory off sys.path, -B keeps the compiler's own imports from writing .pyc.
    argv[argv.index("-I")] = "-PB"
    subprocess.run([*argv, "-c", code, str(stdlib), f"{MOUNT}/{stdlib.relative_to(work)}"],
                   env={**ENVIRONMENT, "PYTHONHASHSEED": "0"}, check=True, stdin=subprocess.DEVNULL)  # fmt: skip


def _normalize(work: Path) -> None:
    """Owner root, fixed modes (executables 0755) and one mtime, so the tree depends on its
    contents only."""
    executables = {work / "lib" / LOADER, work / "usr/bin/python3"}
    for path in [*sorted(work.rglob("*")), work]:
        if os.geteuid() == 0:
            os.chown(path, 0, 0)
        os.chmod(path, 0o755 if path.is_dir() or path in executables else 0o644)
        os.utime(path, (EPOCH, EPOCH))


def content_hash(directory: Path) -> str:
    """sha256 over every path, type, mode and content below `directory` (16 hex digits)."""
    h = hashlib.sha256()
    for path in sorted(directory.rglob("*")):
        st = path.lstat()
        rel = path.relative_to(directory).as_posix().encode()
        if stat.S_ISDIR(st.st_mode):
            h.update(b"D\0" + rel + b"\0" + oct(stat.S_IMODE(st.st_mode)).encode() + b"\0")
        elif stat.S_ISREG(st.st_mode):
            digest = hashlib.sha256(path.read_bytes()).hexdigest().encode()
            h.update(b"F\0" + rel + b"\0" + oct(stat.S_IMODE(st.st_mode)).encode() + b"\0" + digest + b"\0")
        else:
            raise ValueError(f"{path}: only directories and regular files belong in a toolchain")
    return h.hexdigest()[:16]


@contextlib.contextmanager
def _source_rootfs(cache_dir, state_dir, log) -> Iterator[_Rootfs]:
    """The cached base rootfs tarball, or an export of the imported base image when the
    tarball is gone (base-image.sh made the image from it: the same files)."""
    path = rootfs_tar(cache_dir)
    exported = None
    if not path.is_file():
        log(f"[toolchain] {path.name} is not cached: exporting {runtime.base_image_name()}")
        path = exported = _export_base_image(cache_dir, state_dir)
    log(f"[toolchain] building from {path}")
    try:
        with tarfile.open(path, "r:") as tar:
            yield _Rootfs(tar)
    finally:
        if exported is not None:
            exported.unlink(missing_ok=True)


def _export_base_image(cache_dir, state_dir) -> Path:
    image = runtime.base_image_name()
    dest = toolchain_root(cache_dir) / f".export-{os.getpid()}.tar"
    name = f"belayer-toolchain-source-{os.getpid()}"
    podman = {"state_dir": state_dir, "cache_dir": cache_dir, "timeout": 600}
    try:
        runtime.run_podman("create", "--name", name, image, "true", check=True, **podman)
        runtime.run_podman("export", "-o", str(dest), name, check=True, **podman)
    except subprocess.CalledProcessError as exc:
        dest.unlink(missing_ok=True)
        raise RuntimeError(
            f"cannot export {image} ({exc.stderr.strip()}): run infra/install/base-image.sh"
        ) from exc
    finally:
        runtime.run_podman("rm", "-f", name, **podman)
    return dest


# ----------------------------------------------------------------------------- ELF


def _elf(data: bytes) -> tuple[list[tuple[int, int, int, int]], dict[int, list[int]]]:
    """(program headers as (type, offset, vaddr, filesz), dynamic entries by tag) of a
    64-bit little-endian ELF file."""
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ValueError("not a 64-bit little-endian ELF file")
    (phoff,) = struct.unpack_from("<Q", data, 0x20)
    phentsize, phnum = struct.unpack_from("<HH", data, 0x36)
    headers = []
    for i in range(phnum):
        p_type, _, offset, vaddr, _, filesz = struct.unpack_from("<IIQQQQ", data, phoff + i * phentsize)
        headers.append((p_type, offset, vaddr, filesz))
    dynamic: dict[int, list[int]] = {}
    for p_type, offset, _, filesz in headers:
        if p_type == 2:  # PT_DYNAMIC
            for at in range(offset, offset + filesz, 16):
                tag, value = struct.unpack_from("<qQ", data, at)
                if tag == 0:
                    break
                dynamic.setdefault(tag, []).append(value)
    return headers, dynamic


def elf_needed(data: bytes) -> list[str]:
    """The DT_NEEDED names of an ELF object (the libraries it asks the loader for)."""
    headers, dynamic = _elf(data)
    if not dynamic.get(1):
        return []
    strtab = dynamic[5][0]  # DT_STRTAB, a virtual address: find it in its PT_LOAD segment
    base = next(offset - vaddr for p_type, offset, vaddr, filesz in headers
                if p_type == 1 and vaddr <= strtab < vaddr + filesz)  # fmt: skip
    return [data[base + strtab + i : data.index(b"\0", base + strtab + i)].decode() for i in dynamic[1]]


def elf_interpreter(data: bytes) -> str:
    """The PT_INTERP path of an executable (its dynamic loader)."""
    headers, _ = _elf(data)
    for p_type, offset, _, filesz in headers:
        if p_type == 3:
            return data[offset : offset + filesz].rstrip(b"\0").decode()
    raise ValueError("no PT_INTERP: not a dynamically linked executable")


# ----------------------------------------------------------------------------- helpers


def _norm(name: str) -> str:
    return name[2:] if name.startswith("./") else name.lstrip("/")


def _write(path: Path, data: bytes, mode: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    path.chmod(mode)


def _os_release() -> dict[str, str]:
    values = {}
    for line in Path("/etc/os-release").read_text().splitlines():
        key, sep, value = line.partition("=")
        if sep:
            values[key] = value.strip("\"'")
    return values


def _size_mb(directory: Path) -> float:
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file()) / 1e6


def _main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="python3 -m belayer.sandbox.toolchain", description=__doc__.split("\n")[0]
    )
    p.add_argument("what", choices=["build", "path"])
    p.add_argument("--cache-dir", default=None)
    p.add_argument("--state-dir", default=None)
    a = p.parse_args(argv)
    if a.what == "build":
        print(build(a.cache_dir, a.state_dir))
        return 0
    found = installed(a.cache_dir)
    print(
        found
        or f"no toolchain for this checkout under {toolchain_root(a.cache_dir)}: run infra/install/toolchain.sh"
    )
    return 0 if found else 1


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
