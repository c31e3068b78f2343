"""`belayer bench fork`: G sandboxes ready for a GRPO group, forked vs set up one by one.

The task's setup is the heavy kind every member of a group repeats: a venv with a
package installed from a local wheel (offline, `--no-index`), a git history of
generated files, an indexed data set, and a running HTTP server holding state. Per
repetition, on the same host and store, modes in rotated order:

  fork         -- create and set up one sandbox, checkpoint it, `SandboxHost.fork` G
                  sandboxes from the checkpoint (a group's first iteration in Belayer);
  fork_reused  -- a later group of the same task (the next training iteration): the
                  set-up checkpoint an earlier group made and forked on this host is
                  forked again, no setup, from the host's cached archive (no download);
  independent  -- G sandboxes each created and set up from scratch, `--concurrency`
                  at a time (what a user does without forking, with the parallelism
                  the forks get);
  baked        -- the strongest simple alternative to a reused fork: the set-up baked
                  into an image once (the setup run in a plain container of the base
                  image, `podman commit`; not timed, like the reused fork's origin), then
                  G plain containers started from it, `--concurrency` at a time, each
                  starting the server again (an image holds files, not processes) and
                  ready when it answers. Plain podman, no Belayer: no tmpfs workspace, no
                  capability drop, no supervisor.

The clock runs from the start until all G sandboxes are ready to take the members'
first actions (the group's first generation can start). `cpu_ratio`: host CPU seconds
(every process, the containers' included) of independent over fork. Peak host memory
in use and peak disk use of Belayer's state directory (podman storage, restore
scratch), above their level when the mode started, are sampled every 0.1 s.
`identical_start`: in every repetition, the forks of one checkpoint all have the
/workspace hash of the sandbox it was taken of (`independent_identical` asks it of the
independently set-up ones: git's index records file times, so it is false). Nothing is
simulated; the setup needs no network. Every sandbox and checkpoint is removed.
"""

from __future__ import annotations

import os
import shutil
import statistics
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import click
import psutil

from belayer.bench.env_recovery import INSTALL, build_wheel, wheel_setup
from belayer.measure import spread
from belayer.sandbox.host import make_host
from belayer.sandbox.models import ForkTarget, SandboxSpec

# The set-up's last part: a server holding state, started and asked once.
SERVE = "python3 -m benchpkg.serve db.sqlite 8500 >/tmp/serve.log 2>&1 &"
ASK = "python3 -m benchpkg.client 8500 /stats"
# A container of the baked image: the server started again, in the set-up's directory and venv.
BAKED_ENV = "cd /workspace/repo && . $HOME/venv/bin/activate"


def setup_commands(scale: float) -> list[str]:
    """The set-up a group's members share (deterministic, offline)."""
    rows = max(1000, int(100_000 * scale))
    files = max(4, int(40 * scale))
    return [
        *wheel_setup(build_wheel()),
        "mkdir -p /workspace/repo && cd /workspace/repo && git init -q -b main && "
        "export GIT_AUTHOR_NAME=setup GIT_AUTHOR_EMAIL=s@b GIT_COMMITTER_NAME=setup GIT_COMMITTER_EMAIL=s@b "
        "GIT_AUTHOR_DATE=2024-01-01T00:00:00Z GIT_COMMITTER_DATE=2024-01-01T00:00:00Z",
        *INSTALL,
        f'for i in $(seq {files}); do python3 -c "import benchpkg; '
        f'[print(*r) for r in benchpkg.rows(400, seed=$i)]" > f$i.txt; git add f$i.txt; '
        'git commit -qm "file $i"; done; git log --oneline | wc -l',
        f"python3 -m benchpkg.gen {rows} data.csv && python3 -m benchpkg.index data.csv db.sqlite >/dev/null && ls",
        f"{SERVE}\n{ASK}",
    ]


class PeakSampler:
    """Peak host memory in use and peak disk use of one directory, above their start, and
    the host's busy CPU seconds (every process, the containers' included) meanwhile."""

    def __init__(self, directory):
        self.directory = directory
        self._stop = threading.Event()

    def __enter__(self):
        self.mem0, self.disk0, self.cpu0 = self._mem(), self._disk(), self._busy_cpu_s()
        self.mem_peak, self.disk_peak = self.mem0, self.disk0
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.cpu_s = round(self._busy_cpu_s() - self.cpu0, 2)

    @staticmethod
    def _busy_cpu_s() -> float:
        t = psutil.cpu_times()
        return t.user + t.nice + t.system + getattr(t, "irq", 0.0) + getattr(t, "softirq", 0.0)

    def _run(self):
        while not self._stop.wait(0.1):
            self.mem_peak = max(self.mem_peak, self._mem())
            self.disk_peak = max(self.disk_peak, self._disk())

    @staticmethod
    def _mem() -> int:
        vm = psutil.virtual_memory()
        return vm.total - vm.available

    def _disk(self) -> int:
        return shutil.disk_usage(self.directory).used

    def peaks_mb(self) -> tuple[float, float]:
        return round((self.mem_peak - self.mem0) / 2**20, 1), round((self.disk_peak - self.disk0) / 2**20, 1)


def run_fork(host, spec, group_size: int, token: str) -> dict:
    t0 = time.monotonic()
    parent = host.create(spec)
    setup_s = time.monotonic() - t0
    origin = host.checkpoint(parent)
    checkpoint_s = time.monotonic() - t0 - setup_s
    targets = [
        ForkTarget(sandbox_id=f"sbx-bf{i}-{token}", trajectory=f"bench-fork-{i}") for i in range(group_size)
    ]
    outcomes = host.fork(origin, targets)
    ready_s = time.monotonic() - t0
    hashes = _hashes_of_forks(host, outcomes) | {host.workspace_hash(parent)}
    host.destroy(parent)
    return {"ready_s": ready_s, "setup_s": setup_s, "checkpoint_s": checkpoint_s,
            "fork_s": ready_s - setup_s - checkpoint_s, "archive_mb": round(origin.archive_bytes / 2**20, 1),
            "hashes": hashes, "origin": origin, "origin_sandbox": parent.sandbox_id}  # fmt: skip


def make_origin(host, spec):
    """The earlier group's set-up checkpoint, forked once here as that group did (so its
    archive is in this host's cache, as in a training run's later iteration)."""
    parent = host.create(spec)
    try:
        origin = host.checkpoint(parent)
    finally:
        host.destroy(parent)
    warm = ForkTarget(sandbox_id=f"sbx-bw-{uuid.uuid4().hex[:8]}", trajectory="bench-fork-earlier")
    host.fork(origin, [warm])
    host.remove(warm.sandbox_id)
    return origin, parent.sandbox_id


def run_fork_reused(host, origin, group_size: int, token: str) -> dict:
    """A later group of the same task: the set-up checkpoint forked again, no setup."""

    t0 = time.monotonic()
    targets = [
        ForkTarget(sandbox_id=f"sbx-br{i}-{token}", trajectory=f"bench-fork-{i}") for i in range(group_size)
    ]
    outcomes = host.fork(origin, targets)
    return {"ready_s": time.monotonic() - t0, "hashes": _hashes_of_forks(host, outcomes)}


def _hashes_of_forks(host, outcomes) -> set[str]:
    failed = [o.error for o in outcomes if o.handle is None]
    try:
        if failed:
            raise click.ClickException(f"a fork failed: {failed[0]}")
        return {host.workspace_hash(o.handle) for o in outcomes}
    finally:
        for o in outcomes:  # through the host, so it stops counting them against its capacity
            host.remove(o.sandbox_id)


def run_independent(host, spec, group_size: int, concurrency: int) -> dict:
    t0 = time.monotonic()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        handles = list(pool.map(lambda _: host.create(spec), range(group_size)))
    ready_s = time.monotonic() - t0
    hashes = {host.workspace_hash(h) for h in handles}
    for h in handles:
        host.destroy(h)
    return {"ready_s": ready_s, "hashes": hashes}


def bake_image(host, base_image: str, spec, token: str) -> str:
    """The set-up baked into an image: run (all but its server) in a plain container of the
    base image, as one shell, then `podman commit`; the image's name."""
    name, image = f"belayer-bench-bake-{token}", f"localhost/belayer-bench-baked:{token}"
    host.backend.podman("run", "-d", "--name", name, "--network=none", base_image, "sleep", "infinity")
    try:
        script = "\n".join(["set -e", "export HOME=/root", *spec.setup_commands[:-1]])
        host.backend.podman("exec", name, "bash", "-c", script)
        host.backend.podman("commit", "-q", name, image)
        return image
    finally:
        host.backend.podman("rm", "-f", "-t", "0", name)


def run_baked(host, image: str, group_size: int, concurrency: int, token: str) -> dict:
    """G plain containers of the baked image, each ready when its restarted server answers."""
    cfg = host.cfg

    def start(i: int) -> str:
        name = f"belayer-bench-baked-{token}-{i}"
        host.backend.podman("run", "-d", "--name", name, "--network=none", "--label", "belayer.bench=fork",
                            f"--memory={cfg.memory_mb}m", f"--cpus={cfg.cpus:g}", image,
                            "bash", "-c", f"{BAKED_ENV} && {SERVE} exec sleep infinity")  # fmt: skip
        host.backend.podman("exec", name, "bash", "-c", f"{BAKED_ENV} && {ASK}")
        return name

    t0 = time.monotonic()
    names = []
    try:
        with ThreadPoolExecutor(max_workers=concurrency) as pool:
            names = list(pool.map(start, range(group_size)))
        return {"ready_s": time.monotonic() - t0, "hashes": set()}
    finally:
        started = names or [f"belayer-bench-baked-{token}-{i}" for i in range(group_size)]
        host.backend.podman("rm", "-f", "-t", "0", "--ignore", *started, check=False)


def run_bench(config, *, group_size: int, repetitions: int, scale: float, concurrency: int | None, store=None,
              log_fn=lambda m: None) -> dict:  # fmt: skip

    concurrency = concurrency or config.sandbox.fork_concurrency
    host = make_host(config, store=store)
    host.cfg = host.cfg.model_copy(update={"fork_concurrency": concurrency})
    spec = SandboxSpec(setup_commands=setup_commands(scale), labels={"belayer.bench": "fork"})
    modes = ["fork", "fork_reused", "independent", "baked"]
    runs: dict[str, list[dict]] = {mode: [] for mode in modes}
    independent_hashes: set[str] = set()
    token = uuid.uuid4().hex[:8]
    t0 = time.monotonic()
    baked_image = bake_image(host, config.sandbox.image, spec, token)  # once, like a reused origin
    bake_s = time.monotonic() - t0
    log_fn(f"baked the set-up into {baked_image} in {bake_s:.1f}s (not timed)")
    try:
        for rep in range(repetitions):
            origins = []  # (checkpoint, its sandbox id): a reused fork takes this repetition's
            for mode in modes[rep % len(modes) :] + modes[: rep % len(modes)]:
                if mode == "fork_reused" and not origins:
                    origins.append(make_origin(host, spec))  # the earlier group's setup: not timed
                with PeakSampler(config.state_dir) as peaks:
                    if mode == "independent":
                        row = run_independent(host, spec, group_size, concurrency)
                    elif mode == "baked":
                        row = run_baked(host, baked_image, group_size, concurrency, uuid.uuid4().hex[:8])
                    elif mode == "fork":
                        row = run_fork(host, spec, group_size, uuid.uuid4().hex[:8])
                        origins.append((row.pop("origin"), row.pop("origin_sandbox")))
                    else:
                        row = run_fork_reused(host, origins[0][0], group_size, uuid.uuid4().hex[:8])
                row["peak_memory_mb"], row["peak_disk_mb"] = peaks.peaks_mb()
                row["cpu_s"] = peaks.cpu_s
                hashes = row.pop("hashes")
                if mode == "independent":
                    independent_hashes |= hashes
                elif mode != "baked":
                    row["identical"] = len(hashes) == 1  # the forks of one checkpoint (and its sandbox)
                runs[mode].append(row)
                log_fn(
                    f"repetition {rep + 1}/{repetitions} {mode:11s}: {group_size} sandboxes ready in "
                    f"{row['ready_s']:.2f}s, host CPU {row['cpu_s']:.1f}s, peak memory +{row['peak_memory_mb']} MiB, "
                    f"disk +{row['peak_disk_mb']} MiB"
                )
            for _, sandbox_id in origins:
                host.delete_checkpoints(sandbox_id)
    finally:
        host.backend.podman("rmi", "-f", baked_image, check=False)
        host.staging.drop_cache()
    median = {mode: statistics.median(r["ready_s"] for r in runs[mode]) for mode in modes}
    cpu = {mode: statistics.median(r["cpu_s"] for r in runs[mode]) for mode in modes}
    load1, load5, _ = os.getloadavg()
    return {
        "group_size": group_size,
        "repetitions": repetitions,
        "concurrency": concurrency,
        "speedup_reused_vs_baked": round(median["baked"] / median["fork_reused"], 2),
        "fork_reused_ready_s": round(median["fork_reused"], 3),
        "baked_ready_s": round(median["baked"], 3),
        "bake_s": round(bake_s, 2),
        "fork_ready_s": round(median["fork"], 3),
        "independent_ready_s": round(median["independent"], 3),
        "speedup": round(median["independent"] / median["fork"], 2),
        "speedup_reused": round(median["independent"] / median["fork_reused"], 2),
        "cpu_ratio": round(cpu["independent"] / cpu["fork"], 2),
        "cpu_ratio_baked_vs_reused": round(cpu["baked"] / cpu["fork_reused"], 2),
        "identical_start": all(r["identical"] for mode in ("fork", "fork_reused") for r in runs[mode]),
        "independent_identical": len(independent_hashes) == 1,
        **{mode: _summary(runs[mode]) for mode in modes},
        "machine": {"cpus": os.cpu_count(), "load_avg_1m": round(load1, 2), "load_avg_5m": round(load5, 2)},
        "sandbox": {"cpus": config.sandbox.cpus, "memory_mb": config.sandbox.memory_mb},
    }  # fmt: skip


def _summary(rows: list[dict]) -> dict:
    keys = [k for k, v in rows[0].items() if isinstance(v, float) and k != "archive_mb"]
    return {k: spread([r[k] for r in rows]) for k in keys} | (
        {"archive_mb": rows[0]["archive_mb"]} if "archive_mb" in rows[0] else {}
    )
