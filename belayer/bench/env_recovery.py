"""`belayer bench env-recovery`: full restore vs `replay` vs `fs-only`, same run, real sandboxes.

Each workload is an action log that builds real state in a sandbox: a Python package
pip-installed from a wheel built here into a venv the agent creates and activates
(offline: `--no-index`), generated data and a compiled/indexed artefact, a
`make` build, a git history, a background HTTP server holding in-memory state that
later actions query and change, and shell cwd / exported variables / functions.

Per workload, one unfailed run executes all n actions, takes a full checkpoint (with a
file-system snapshot for the fs-only baseline) at a late step k, runs to n, records
the /workspace hash and every observation hash, then the sandbox is killed. Then,
in the same run, on the same host, `--repetitions` times with the methods' order
rotated each repetition (every recovery starts from the same checkpoint and log):
  belayer  -- restore the checkpoint, replay k+1..n, compare observations;
  replay   -- fresh sandbox + the task's setup, replay 1..n;
  fs-only  -- fresh sandbox, unpack the files of step k (processes lost), replay k+1..n.
A method's seconds are the median of its repetitions, `NAME_spread` beside them their
min / median / max; `speedup_vs_replay` is of the medians. `state_identical`: every
Belayer recovery matched every replayed observation and the unfailed run's /workspace
hash. `fs_only_consistent`: every fs-only replay matched every observation (it cannot
when a process held state). The realistic case (env_recovery_realistic.py) repeats by
its own means: `--failures` failures per workload.

Heavy modules (podman backend, storage) are imported inside the command only.
"""

from __future__ import annotations

import base64
import hashlib
import io
import time
import zipfile
from dataclasses import dataclass, field

import click
from rich.console import Console
from rich.table import Table

from belayer.bench.env_recovery_realistic import METHODS, MODE, run_realistic
from belayer.measure import rotated, spread, spread_cells
from belayer.sandbox.host import make_host
from belayer.sandbox.models import Action, LoggedAction, SandboxSpec

# ----------------------------------------------------------------------------- the wheel

PKG_INIT = '''"""benchpkg: a tiny library the benchmark's agent installs from a local wheel."""
__version__ = "1.0.0"
import hashlib, random

def rows(n, seed=7):
    rng = random.Random(seed)
    words = ["alpha", "beta", "gamma", "delta", "eps", "zeta", "eta", "theta"]
    for i in range(n):
        yield i, rng.choice(words), rng.randint(0, 10**6), hashlib.sha1(str(i).encode()).hexdigest()[:12]
'''
PKG_GEN = """import csv, sys
from benchpkg import rows
n, out = int(sys.argv[1]), sys.argv[2]
with open(out, "w", newline="") as f:
    w = csv.writer(f)
    for r in rows(n):
        w.writerow(r)
print("rows", n)
"""
PKG_INDEX = """import csv, sqlite3, sys
src, db = sys.argv[1], sys.argv[2]
con = sqlite3.connect(db)
con.execute("create table t (id integer, word text, value integer, tag text)")
with open(src) as f:
    con.executemany("insert into t values (?,?,?,?)", csv.reader(f))
con.execute("create index ix_word on t(word)")
con.commit()
print(con.execute("select word, count(*), sum(value) from t group by word order by word").fetchall())
"""
PKG_SERVE = """import json, sqlite3, sys
from http.server import BaseHTTPRequestHandler, HTTPServer
from urllib.parse import urlparse, parse_qs
db, port = sys.argv[1], int(sys.argv[2])
con = sqlite3.connect(db)
totals = dict(con.execute("select word, sum(value) from t group by word"))
counters = {}
class H(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass
    def do_GET(self):
        u = urlparse(self.path); q = {k: v[0] for k, v in parse_qs(u.query).items()}
        if u.path == "/stats":
            body = {"words": len(totals), "total": sum(totals.values())}
        elif u.path == "/add":
            counters[q["key"]] = counters.get(q["key"], 0) + int(q.get("n", 1)); body = counters
        elif u.path == "/get":
            body = {"key": q["key"], "value": counters.get(q["key"], 0), "total": totals.get(q["key"])}
        else:
            body = {"error": u.path}
        data = json.dumps(body, sort_keys=True).encode()
        self.send_response(200); self.send_header("Content-Length", str(len(data))); self.end_headers()
        self.wfile.write(data)
HTTPServer(("127.0.0.1", port), H).serve_forever()
"""
PKG_CLIENT = """import sys, time, urllib.request
port, path = sys.argv[1], sys.argv[2]
for i in range(100):
    try:
        print(urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5).read().decode()); break
    except OSError:
        time.sleep(0.05)
else:
    sys.exit("server not answering")
"""
PKG_SELFTEST = """import sqlite3, sys, hashlib
con = sqlite3.connect(sys.argv[1])
h = hashlib.sha256()
for rounds in range(int(sys.argv[2])):
    for row in con.execute("select id, word, value from t where value % 7 = ? order by id", (rounds % 7,)):
        h.update(repr(row).encode())
print("selftest ok", h.hexdigest()[:16])
"""
PKG_FIT = """import json, sqlite3, sys
con = sqlite3.connect(sys.argv[1])
xs = [v for (v,) in con.execute("select value from t order by id")]
k, iters = 8, int(sys.argv[2])
centers = [xs[i * len(xs) // k] for i in range(k)]
for _ in range(iters):
    sums, counts = [0.0] * k, [0] * k
    for x in xs:
        best = min(range(k), key=lambda j: abs(x - centers[j]))
        sums[best] += x; counts[best] += 1
    centers = [sums[j] / counts[j] if counts[j] else centers[j] for j in range(k)]
json.dump({"centers": [round(c, 3) for c in sorted(centers)]}, open(sys.argv[3], "w"))
print("model", [round(c) for c in sorted(centers)])
"""


def build_wheel() -> bytes:
    """A pure-Python wheel of `benchpkg`, built in memory (deterministic bytes)."""
    files = {
        "benchpkg/__init__.py": PKG_INIT, "benchpkg/gen.py": PKG_GEN, "benchpkg/index.py": PKG_INDEX,
        "benchpkg/serve.py": PKG_SERVE, "benchpkg/client.py": PKG_CLIENT, "benchpkg/selftest.py": PKG_SELFTEST,
        "benchpkg/fit.py": PKG_FIT,
        "benchpkg-1.0.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: benchpkg\nVersion: 1.0.0\n",
        "benchpkg-1.0.0.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: belayer\nRoot-Is-Purelib: true\n"
                                          "Tag: py3-none-any\n",
    }  # fmt: skip

    record = []
    for name, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{name},sha256={digest},{len(text.encode())}")
    record.append("benchpkg-1.0.0.dist-info/RECORD,,")
    files["benchpkg-1.0.0.dist-info/RECORD"] = "\n".join(record) + "\n"
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        for name, text in files.items():
            info = zipfile.ZipInfo(name, date_time=(2024, 1, 1, 0, 0, 0))
            info.compress_type = zipfile.ZIP_DEFLATED
            z.writestr(info, text)
    return buf.getvalue()


def wheel_setup(wheel: bytes) -> list[str]:
    """Task setup: the wheel lands in /workspace/dist (as a task's files would)."""
    b64 = base64.b64encode(wheel).decode()
    return [f"mkdir -p /workspace/dist && base64 -d > /workspace/dist/benchpkg-1.0.0-py3-none-any.whl <<'EOF'\n"
            f"{b64}\nEOF"]  # fmt: skip


# Two actions: the venv lives in the agent's home; activating it is shell state (PATH,
# VIRTUAL_ENV) that only a full restore brings back.
INSTALL = [
    "python3 -m venv $HOME/venv && . $HOME/venv/bin/activate && echo $VIRTUAL_ENV",
    "pip install --no-index --no-deps --disable-pip-version-check -q "
    "/workspace/dist/benchpkg-1.0.0-py3-none-any.whl && python3 -c 'import benchpkg; print(benchpkg.__version__)'",
]


@dataclass
class Workload:
    name: str
    actions: list[str]
    checkpoint_after: int  # k: the late step the last checkpoint was taken at
    setup: list[str] = field(default_factory=list)


def workloads(scale: float = 1.0) -> list[Workload]:
    rows = max(1000, int(300_000 * scale))
    rounds = max(1, int(6 * scale))
    targets = max(4, int(60 * scale))
    iters = max(1, int(12 * scale))
    wheel = wheel_setup(build_wheel())
    data_server = Workload(
        name="package-data-server",
        setup=wheel,
        actions=[
            "mkdir -p /workspace/app/data && cd /workspace/app && export APP_ENV=bench DATA=/workspace/app/data",
            *INSTALL,
            f"python3 -m benchpkg.gen {rows} $DATA/rows.csv",
            "python3 -m benchpkg.index $DATA/rows.csv $DATA/index.sqlite && ls -l $DATA | wc -l",
            "python3 -m benchpkg.serve $DATA/index.sqlite 8200 >/tmp/serve.log 2>&1 &\n"
            "python3 -m benchpkg.client 8200 /stats",
            "python3 -m benchpkg.client 8200 '/add?key=alpha&n=5'",
            f"python3 -m benchpkg.fit $DATA/index.sqlite {iters} $DATA/model.json && "
            f"python3 -m benchpkg.selftest $DATA/index.sqlite {rounds} | tee $DATA/selftest.txt",
            "python3 -m benchpkg.client 8200 '/add?key=beta&n=2'; report() { echo \"report:$1\"; }",
            "mkdir -p reports && cd reports && export STAGE=report && python3 -m benchpkg.client 8200 '/get?key=alpha'",
            "report $STAGE; pwd; python3 -m benchpkg.client 8200 '/get?key=beta' | tee beta.json",
        ],
        checkpoint_after=9,
    )
    make_rules = (
        "all: $(patsubst src/%.txt,out/%.sum,$(wildcard src/*.txt))\n"
        "out/%.sum: src/%.txt\n"
        "\t@mkdir -p out && python3 -c \"import hashlib,sys; d=open(sys.argv[1],'rb').read(); "
        'print(hashlib.sha256(d*200).hexdigest())" $< > $@\n'
    )
    make_build = Workload(
        name="make-build-and-kv-server",
        setup=wheel,
        actions=[
            "mkdir -p /workspace/proj/src && cd /workspace/proj && export BUILD=release JOBS=1",
            *INSTALL,
            f'for i in $(seq {targets}); do python3 -c "import benchpkg; '
            f'[print(*r) for r in benchpkg.rows(2000, seed=$i)]" > src/m$i.txt; done; ls src | wc -l',
            f"cat > Makefile <<'EOF'\n{make_rules}EOF\nmake -j$JOBS all && ls out | wc -l",
            "tar --sort=name --mtime=@0 --owner=0 --group=0 -czf /workspace/proj/artefact.tgz out && "
            "python3 -c \"import hashlib; print(hashlib.sha256(open('artefact.tgz','rb').read()).hexdigest())\"",
            "python3 -m http.server 8300 --bind 127.0.0.1 >/tmp/http.log 2>&1 &\n"
            "python3 -m benchpkg.client 8300 /out/m1.sum",
            "python3 -m benchpkg.index <(cat src/*.txt | tr ' ' ',') /workspace/proj/all.sqlite",
            "cd out && export STAGE=verify && ls | head -3",
            "python3 -m benchpkg.client 8300 /out/m2.sum; echo $BUILD $STAGE; pwd",
        ],
        checkpoint_after=8,
    )
    git_session = Workload(
        name="git-history-and-tests",
        setup=wheel,
        actions=[
            "mkdir -p /workspace/repo && cd /workspace/repo && git init -q -b main && "
            "export GIT_AUTHOR_NAME=agent GIT_AUTHOR_EMAIL=a@b GIT_COMMITTER_NAME=agent GIT_COMMITTER_EMAIL=a@b "
            "GIT_AUTHOR_DATE=2024-01-01T00:00:00Z GIT_COMMITTER_DATE=2024-01-01T00:00:00Z",
            *INSTALL,
            f'for i in $(seq {targets * 3}); do python3 -c "import benchpkg; '
            f'[print(*r) for r in benchpkg.rows(500, seed=$i)]" > f$i.txt; done; git add -A && '
            "git commit -qm initial && git rev-parse HEAD",
            f"python3 -m benchpkg.gen {rows // 2} data.csv && python3 -m benchpkg.index data.csv db.sqlite && "
            "git add data.csv && git commit -qm data && git log --oneline | wc -l",
            "python3 -m benchpkg.serve db.sqlite 8400 >/tmp/serve.log 2>&1 &\n"
            "python3 -m benchpkg.client 8400 '/add?key=gamma&n=9'",
            f"python3 -m benchpkg.selftest db.sqlite {rounds} > selftest.log && git add selftest.log && "
            "git commit -qm tests && git rev-parse --short HEAD",
            "git checkout -q -b feature && sed -i 's/alpha/ALPHA/' f1.txt && git commit -qam edit && git branch",
            # After the checkpoint: nothing that rewrites .git/index (it stores inode times).
            "python3 -m benchpkg.client 8400 '/add?key=gamma&n=1'; git log --oneline | wc -l",
            "python3 -m benchpkg.client 8400 '/get?key=gamma'; git rev-parse --short HEAD; echo $GIT_AUTHOR_NAME",
        ],
        checkpoint_after=8,
    )
    return [data_server, make_build, git_session]


# ----------------------------------------------------------------------------- running


@dataclass
class Recovery:
    """One recovery of the killed sandbox: its time, what `SandboxHost.recover` said, and
    whether the recovered /workspace hashed as the unfailed run's did."""

    seconds: float
    outcome: object  # RecoverOutcome
    same_workspace: bool


def schedule(repetitions: int) -> list[tuple[int, str]]:
    """(repetition, method), the order rotated each repetition."""
    return rotated(METHODS, repetitions)


def run_workload(host, wl: Workload, trajectory: str, *, repetitions: int, log_fn=lambda m: None) -> dict:
    spec = SandboxSpec(setup_commands=wl.setup, labels={"belayer.bench": "env-recovery"})
    handle = host.create(spec)
    sandbox_ids = {handle.sandbox_id}
    try:
        log: list[LoggedAction] = []
        ckpt = None
        durations: list[float] = []
        t0 = time.monotonic()
        for step, command in enumerate(wl.actions, start=1):
            obs = host.exec(handle, Action(trajectory=trajectory, step=step, command=command, timeout_s=600))
            if obs.exit_code != 0:
                raise click.ClickException(
                    f"workload {wl.name} step {step} failed (exit {obs.exit_code}): {obs.stderr[-1500:]}"
                )
            log.append(LoggedAction(trajectory=trajectory, step=step, command=command, timeout_s=600,
                                    observation_sha256=obs.sha256))  # fmt: skip
            durations.append(round(obs.duration_s, 3))
            if step == wl.checkpoint_after:
                tc = time.monotonic()
                ckpt = host.checkpoint(handle, fs_snapshot=True)
                checkpoint_s = time.monotonic() - tc
        unfailed_s = time.monotonic() - t0
        assert ckpt is not None
        meta = host.load_meta(ckpt)
        expected_hash = host.workspace_hash(handle)
        log_fn(f"{wl.name}: unfailed run {unfailed_s:.1f}s, checkpoint at step {ckpt.step} "
               f"({checkpoint_s:.2f}s, {ckpt.archive_bytes / 2**20:.1f} MiB), action seconds {durations}; "
               "killing the sandbox")  # fmt: skip
        host.kill(handle)

        recoveries: dict[str, list[Recovery]] = {method: [] for method in METHODS}
        for rep, method in schedule(repetitions):
            t = time.monotonic()
            outcome = host.recover(handle, [ckpt], log, mode=MODE[method], spec=spec)
            elapsed = time.monotonic() - t
            handle = outcome.handle
            recovery = Recovery(elapsed, outcome, host.workspace_hash(handle) == expected_hash)
            recoveries[method].append(recovery)
            log_fn(f"{wl.name}: repetition {rep + 1}/{repetitions} {method:8s} {elapsed:6.2f}s from "
                   f"{outcome.source}, consistent={outcome.consistent} at {outcome.consistent_at}, "
                   f"workspace identical={recovery.same_workspace}")  # fmt: skip
            host.kill(handle)
        return {
            "name": wl.name,
            **recovery_figures(recoveries, steps=len(wl.actions)),
            "steps": len(wl.actions),
            "checkpoint_step": ckpt.step,
            "checkpoint_s": round(checkpoint_s, 3),
            "checkpoint_dump_s": round(meta.dump_s, 3),
            "archive_bytes": ckpt.archive_bytes,
            "unfailed_run_s": round(unfailed_s, 3),
            "action_s": durations,
        }
    finally:
        for sid in sandbox_ids:
            host.remove(sid)
        host.delete_checkpoints(handle.sandbox_id)


def recovery_figures(recoveries: dict[str, list[Recovery]], *, steps: int) -> dict:
    """A workload's best-case figures from its repetitions: each method's seconds as the
    median (the single figure of one-repetition runs) with its spread beside it; a
    consistency verdict holds only when it held in every repetition."""
    seconds = {method: [r.seconds for r in recoveries[method]] for method in METHODS}
    median = {method: spread(seconds[method])["median"] for method in METHODS}
    belayer = recoveries["belayer"]
    mismatches = [
        r.outcome.mismatch_step for r in recoveries["fs_only"] if r.outcome.mismatch_step is not None
    ]
    return {
        "repetitions": len(belayer),
        **{f"{method}_s": median[method] for method in METHODS},
        "speedup_vs_replay": round(median["replay"] / median["belayer"], 2),
        "state_identical": all(
            r.outcome.consistent and r.outcome.consistent_at == steps and r.same_workspace for r in belayer
        ),
        "fs_only_consistent": all(r.outcome.consistent for r in recoveries["fs_only"]),
        "belayer_restore_s": spread(r.outcome.restore_s for r in belayer)["median"],
        "belayer_replayed_steps": max(r.outcome.replayed_steps for r in belayer),
        "replay_consistent": all(r.outcome.consistent for r in recoveries["replay"]),
        "fs_only_mismatch_step": min(mismatches, default=None),
        **{f"{method}_s_spread": spread(seconds[method]) for method in METHODS},
        "belayer_restore_s_spread": spread(r.outcome.restore_s for r in belayer),
    }


@dataclass(frozen=True)
class Realistic:
    """Settings of the realistic case (env_recovery_realistic.py); None skips it."""

    failures: int = 5
    seed: int = 0
    decode_s_per_token: float = 0.02
    sweep_max: int = 4


def run_bench(config, *, store=None, names: list[str] | None = None, scale: float = 1.0, repetitions: int,
              realistic: Realistic | None = None, log_fn=lambda m: None) -> dict:  # fmt: skip

    host = make_host(config, store=store)
    selected = [w for w in workloads(scale) if not names or w.name in names]
    rows = [
        run_workload(host, w, trajectory=f"bench-{w.name}", repetitions=repetitions, log_fn=log_fn)
        for w in selected
    ]
    speedups = [r["speedup_vs_replay"] for r in rows]
    report = {}
    if realistic is not None:
        report["realistic"] = run_realistic(
            host,
            selected,
            config.policy,
            failures=realistic.failures,
            seed=realistic.seed,
            decode_s_per_token=realistic.decode_s_per_token,
            sweep_max=realistic.sweep_max,
            log_fn=log_fn,
        )
        report["realistic_median_speedup_vs_replay"] = report["realistic"]["median_speedup_vs_replay"]
    return report | {
        "best_case": "the `workloads` rows: one checkpoint at a late step, the failure after the last action",
        "repetitions": repetitions,
        "workloads": rows,
        "speedup_vs_replay_min": min(speedups) if speedups else None,
        "speedup_vs_replay_max": max(speedups) if speedups else None,
        "sandbox": {
            "cpus": config.sandbox.cpus,
            "memory_mb": config.sandbox.memory_mb,
            "image": config.sandbox.image,
        },  # fmt: skip
    }


def print_report(result: dict) -> None:
    out = Console()
    table = Table(
        title="environment recovery, best case: checkpoint at a late step, failure at the end; "
        f"seconds over {result['repetitions']} repetitions"
    )
    for col in ("workload", "method", "min", "median", "max", "consistent", "speedup"):
        table.add_column(col)
    for r in result["workloads"]:
        verdicts = {
            "belayer": r["state_identical"],
            "replay": r["replay_consistent"],
            "fs_only": r["fs_only_consistent"],
        }
        for method in METHODS:
            table.add_row(
                r["name"] if method == METHODS[0] else "",
                method.replace("_", "-"),
                *spread_cells(r[f"{method}_s_spread"]),
                "yes" if verdicts[method] else "no",
                f"{r['speedup_vs_replay']:.1f}x" if method == "belayer" else "",
            )
    out.print(table)
    out.print(
        "consistent: every recovery matched every replayed observation (belayer: and the /workspace "
        "hash); speedup: replay's median over belayer's"
    )
    real = result.get("realistic")
    if real:
        table = Table(
            title=f"realistic: the adaptive policy's checkpoints, {real['failures']} failures at random "
            "steps; seconds"
        )
        for col in ("method", "min", "median", "max", "consistent"):
            table.add_column(col)
        for method, figures in real["recovery_s"].items():
            table.add_row(
                method.replace("_", "-"), *spread_cells(figures), f"{real['consistent_share'][method]:.0%}"
            )
        out.print(table)
        if real["speedup_vs_replay"]:
            speedup = real["speedup_vs_replay"]
            out.print(
                f"speedup vs replay per failure: {speedup['min']:.1f}x / {speedup['median']:.1f}x / "
                f"{speedup['max']:.1f}x (min / median / max)"
            )
    machine = result["machine"]
    out.print(
        f"machine: {machine['cores']} cores, load average {machine['load_avg']} before, "
        f"{machine['after']} after"
    )
