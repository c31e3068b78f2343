"""The host's archive cache (belayer/sandbox/archive_cache.py): its bookkeeping on plain
files, then real restores on podman + CRIU that take the host's own copy, survive a
corrupt stored object with it, and drop a copy podman cannot import."""

from __future__ import annotations

import os

import pytest

from belayer.sandbox.archive_cache import ArchiveCache
from belayer.sandbox.models import LoggedAction
from tests.sandbox.test_sandbox import PROBE, PROBE_EXPECTED, SCENARIO, TRAJ, act, run_logged


def admit(cache: ArchiveCache, sandbox_id: str, sha: str, size: int = 10) -> None:
    with cache.staged() as path:
        path.write_bytes(b"x" * size)
        cache.admit(path, sandbox_id, sha)


def test_a_copy_is_taken_as_a_link_and_one_per_sandbox_is_kept(tmp_path):
    cache = ArchiveCache(tmp_path / "cache", max_bytes=1000)
    admit(cache, "sbx-a", "1111")
    admit(cache, "sbx-a", "2222")  # the sandbox's newer checkpoint replaces its older copy
    assert cache.take("1111", tmp_path / "old.tar") is None
    taken = cache.take("2222", tmp_path / "new.tar")
    assert taken == tmp_path / "new.tar" and taken.read_bytes() == b"x" * 10
    cache.forget("sbx-a")
    assert cache.take("2222", tmp_path / "again.tar") is None
    assert taken.read_bytes() == b"x" * 10  # a link taken before stays whole
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == []


def test_the_least_recently_used_goes_over_budget_and_nothing_over_budget_is_kept(tmp_path):
    cache = ArchiveCache(tmp_path / "cache", max_bytes=25)
    admit(cache, "sbx-a", "aaaa")
    admit(cache, "sbx-b", "bbbb")
    past = 1_000_000
    for entry in (tmp_path / "cache").glob("sbx-*.tar"):  # a older, b newer
        os.utime(entry, (past, past + (entry.name.startswith("sbx-b"))))
    cache.take("aaaa", tmp_path / "use.tar")  # a used now: b is the least recently used
    admit(cache, "sbx-c", "cccc")
    assert cache.take("bbbb", tmp_path / "b.tar") is None
    assert cache.take("aaaa", tmp_path / "a.tar") and cache.take("cccc", tmp_path / "c.tar")
    admit(cache, "sbx-d", "dddd", size=26)  # alone over budget: not kept, the others stay
    assert cache.take("dddd", tmp_path / "d.tar") is None and cache.take("cccc", tmp_path / "c2.tar")


def test_staging_files_left_by_a_crash_are_removed_and_zero_budget_keeps_nothing(tmp_path):
    cache = ArchiveCache(tmp_path / "cache", max_bytes=100)
    (tmp_path / "cache" / "staging-dead.tar").write_bytes(b"half a dump")
    assert not any(ArchiveCache(tmp_path / "cache", max_bytes=100).root.glob("staging-*"))
    with cache.staged() as path:
        path.write_bytes(b"never admitted")
    assert not path.exists()
    off = ArchiveCache(tmp_path / "off", max_bytes=0)
    with off.staged() as path:
        assert path is None
    assert off.take("aaaa", tmp_path / "x.tar") is None and not (tmp_path / "off").exists()


@pytest.mark.sandbox
def test_a_restore_here_takes_the_hosts_copy_even_when_the_stored_archive_is_corrupt(sandboxes):
    host = sandboxes.host
    handle = sandboxes.create()
    log: list[LoggedAction] = []
    for step, command in enumerate(SCENARIO, 1):
        obs = host.exec(handle, act(step, command))
        log.append(LoggedAction(trajectory=TRAJ, step=step, command=command, observation_sha256=obs.sha256))
    ref = host.checkpoint(handle)
    meta = host.load_meta(ref)
    host.store.put_bytes(meta.archive_key, b"garbage: only the host's copy can restore this")
    host.kill(handle)
    outcome = host.recover(handle, [ref], log)
    assert outcome.source == f"checkpoint@{ref.step}" and outcome.consistent and outcome.replayed_steps == 0
    assert host.exec(outcome.handle, act(len(SCENARIO) + 1, PROBE)).stdout == PROBE_EXPECTED


@pytest.mark.sandbox
def test_a_copy_podman_cannot_import_is_dropped_and_the_archive_downloaded(sandboxes):
    host = sandboxes.host
    handle = sandboxes.create()
    log: list[LoggedAction] = []
    run_logged(host, handle, range(1, 3), log)
    ref = host.checkpoint(handle)
    [copy] = host.archive_cache.root.glob(f"{handle.sandbox_id}.*.tar")
    os.truncate(copy, copy.stat().st_size // 2)  # the host's disk lost half of it
    host.kill(handle)
    outcome = host.recover(handle, [ref], log)
    assert outcome.source == f"checkpoint@{ref.step}" and outcome.consistent, outcome
    assert not copy.exists() and host.archive_cache.take(ref.archive_sha256, copy.with_name("x.tar")) is None
    assert sandboxes.backend.containers_of(handle.sandbox_id) == [outcome.handle.container]
