"""A server in a network namespace of its own, with one TCP port relayed to the host.

`python -m belayer.stack.private_net HOST:PORT -- SERVER...` binds HOST:PORT in the
host's network, moves itself into a new network namespace with only a loopback, starts
SERVER there and relays every connection to HOST:PORT to the same address inside. Every
other port SERVER opens exists only in that namespace: no process outside it, a
sandbox or another user's, can connect to it.

Used for SeaweedFS (belayer/stack/services.py): of `weed mini`'s ports only the S3 API,
which checks credentials, is meant for clients; its master's HTTP port checks none, its
gRPC ports only mutual TLS.

The launcher is the server's parent and lives exactly as long as it: a signal to it
(SIGTERM, SIGINT, SIGHUP) is passed on, it exits with the server's status, and the
server gets SIGKILL if the launcher dies first (`PR_SET_PDEATHSIG`), so neither outlives
the other. The namespace has no name (nothing under /run/netns): it goes with its last
process. As root it is a plain network namespace; another user gets one inside a user
namespace of its own (mapped to the same uid and gid), which the kernel must allow.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time

CLONE_NEWNET = 0x40000000
CLONE_NEWUSER = 0x10000000
PR_SET_PDEATHSIG = 1
SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1
RELAY_CHUNK = 1024 * 1024
F_SETPIPE_SZ = 1031
PASSED_ON = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)

_libc = ctypes.CDLL(None, use_errno=True)


class PrivateNetworkError(RuntimeError):
    """The namespace could not be made; says what the kernel refused and the way out."""


def launcher(host: str, port: int, argv: list[str]) -> list[str]:
    """`argv` as a server whose only port on the host is `host:port`."""
    return [sys.executable, "-m", "belayer.stack.private_net", f"{host}:{port}", "--", *argv]


def enter_private_network() -> None:
    """This process into a new network namespace, its loopback up. Before any thread
    starts: unshare(2) refuses a user namespace to a multithreaded process."""
    uid, gid = os.geteuid(), os.getegid()
    flags = CLONE_NEWNET if uid == 0 else CLONE_NEWUSER | CLONE_NEWNET
    if _libc.unshare(flags) != 0:
        reason = os.strerror(ctypes.get_errno())
        raise PrivateNetworkError(
            f"cannot make a private network namespace ({reason}): run as root, or allow unprivileged "
            "user namespaces (sysctl kernel.unprivileged_userns_clone=1, and on Ubuntu "
            "kernel.apparmor_restrict_unprivileged_userns=0)"
        )
    if uid != 0:
        _write("/proc/self/setgroups", "deny")
        _write("/proc/self/uid_map", f"{uid} {uid} 1")
        _write("/proc/self/gid_map", f"{gid} {gid} 1")
    _loopback_up()


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _loopback_up() -> None:
    """`ip link set lo up`, without needing iproute2."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        request = struct.pack("16sH14x", b"lo", 0)
        flags = struct.unpack("16sH14x", fcntl.ioctl(sock, SIOCGIFFLAGS, request))[1]
        fcntl.ioctl(sock, SIOCSIFFLAGS, struct.pack("16sH14x", b"lo", flags | IFF_UP))


def _die_with_parent(parent: int) -> None:
    """In the server, before exec: SIGKILL when the launcher goes (also if it already has)."""
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:
        os._exit(1)


def relay(listener: socket.socket, address: tuple[str, int]) -> None:
    """Each connection accepted on `listener` joined to a new one to `address`."""
    while True:
        try:
            client, _ = listener.accept()
        except OSError as exc:  # out of file descriptors, say: refuse this one, not all later ones
            print(f"belayer: relay cannot accept a connection: {exc}", file=sys.stderr, flush=True)
            time.sleep(0.1)
            continue
        threading.Thread(target=_join, args=(client, address), daemon=True).start()


def _join(client: socket.socket, address: tuple[str, int]) -> None:
    with client:
        try:
            upstream = socket.create_connection(address, timeout=10)
        except OSError:
            return  # the server is not listening yet (or no more): the client sees the close
        with upstream:
            upstream.settimeout(None)
            for sock in (client, upstream):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            back = threading.Thread(target=_pump, args=(upstream, client), daemon=True)
            back.start()
            _pump(client, upstream)
            back.join()


def _pump(source: socket.socket, sink: socket.socket) -> None:
    """Bytes from `source` to `sink` until `source` ends (then `sink` is told) or either
    fails (then both are shut, which ends the other direction too). Through a pipe with
    splice(2): the bytes never enter this process."""
    pipe_out, pipe_in = os.pipe()
    with contextlib.suppress(OSError):  # above fs.pipe-max-size, unprivileged: the default 64 KiB
        fcntl.fcntl(pipe_in, F_SETPIPE_SZ, RELAY_CHUNK)
    try:
        while received := os.splice(source.fileno(), pipe_in, RELAY_CHUNK):
            while received:
                received -= os.splice(pipe_out, sink.fileno(), received)
        sink.shutdown(socket.SHUT_WR)
    except OSError:
        for sock in (source, sink):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
    finally:
        os.close(pipe_in)
        os.close(pipe_out)


def serve(host: str, port: int, argv: list[str]) -> int:
    """Run `argv` in a private network with `host:port` relayed; its exit status."""
    listener = socket.create_server((host, port), backlog=128)  # in the host's network
    enter_private_network()
    parent = os.getpid()
    server = subprocess.Popen(argv, preexec_fn=lambda: _die_with_parent(parent))
    for sig in PASSED_ON:
        signal.signal(sig, lambda received, _frame: server.send_signal(received))
    print(
        f"belayer: {argv[0]} (pid {server.pid}) in a private network namespace; only "
        f"{host}:{port} is relayed to it",
        flush=True,
    )
    threading.Thread(target=relay, args=(listener, (host, port)), daemon=True).start()
    status = server.wait()
    return status if status >= 0 else 128 - status


def main(args: list[str]) -> int:
    if len(args) < 3 or args[1] != "--":
        print("usage: python -m belayer.stack.private_net HOST:PORT -- SERVER [ARGS...]", file=sys.stderr)
        return 2
    host, _, port = args[0].rpartition(":")
    try:
        return serve(host, int(port), args[2:])
    except (PrivateNetworkError, OSError) as exc:
        print(f"belayer: cannot start {args[2]} behind {args[0]}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
