"""Recovery onto another host fences the original container when its host comes back.

Two sandbox hosts, A and B, simulated on this machine: two `SandboxHost`s with their own
task queues over one object store, each seeing only the containers it started
(`HostView`). Host A loses contact while its container keeps running, the lineage is
recovered on B (generation 1), and A's worker comes back: A's old container must be
removed -- at A's start (`sweep_stale`) or at the first action sent to it -- and no
action sent with A's stale handle may run anywhere.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

from belayer.sandbox import channel, lineage, runtime
from belayer.sandbox.errors import StaleGeneration
from belayer.sandbox.host import SandboxHost
from belayer.sandbox.models import Action, LoggedAction, SandboxHandle, SandboxSpec
from belayer.storage.store import open_store
from tests.sandbox.conftest import TEST_LABEL, Sandboxes, TrackingBackend, small_config

TRAJ = "traj-fence"
HOST_A, HOST_B = "belayer-sandbox-test-host-a", "belayer-sandbox-test-host-b"
STEP1 = "echo one > /workspace/one; echo one"


class HostView(TrackingBackend):
    """One simulated host on this machine's shared podman storage.

    Two machines would keep apart what two hosts here share: container names and the
    lineage's channel directory path. A view lists only the containers it started, and
    `lose_contact` moves its container and channel directory out of the shared names
    (as if they were on another machine), so the other host can restore the lineage
    under those names while this one's container keeps running and stays reachable by
    its own host. `destroy` notes each container's journal head before removing it,
    so a test can tell which actions ran there.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.mine: set[str] = set()
        self.aside: dict[str, Path] = {}
        self.heads_when_fenced: dict[str, int] = {}

    def create(self, sandbox_id, generation, labels, image=None, semantics=None):
        name = super().create(sandbox_id, generation, labels, image=image, semantics=semantics)
        self.mine.add(name)
        return name

    def restore(self, archive, sandbox_id, generation):
        # The archive carries the container's id, which the other host's container still
        # holds in this shared storage (a second machine would not have it): restore under
        # a new name, which gives a new id. podman 4.3 refuses --name with
        # --tcp-established; these tests hold no TCP connections across the checkpoint.
        self.seen.add(sandbox_id)
        self.ensure_host_side(sandbox_id)
        name = self.container_name(sandbox_id, generation)
        self.podman("container", "restore", f"--import={archive}", f"--name={name}")
        self.mine.add(name)
        return name

    def lineages(self) -> dict[str, list[str]]:
        mine = {sid: [n for n in names if n in self.mine] for sid, names in super().lineages().items()}
        return {sid: names for sid, names in mine.items() if names}

    def containers_of(self, sandbox_id: str) -> list[str]:
        return [n for n in super().containers_of(sandbox_id) if n in self.mine]

    def channel_dir(self, sandbox_id: str) -> Path:
        return self.aside.get(sandbox_id) or super().channel_dir(sandbox_id)

    def destroy(self, sandbox_id: str) -> None:
        for name in self.containers_of(sandbox_id):
            if self.is_running(name):
                self.heads_when_fenced[name] = channel.call(self.channel_path(sandbox_id), {"op": "ping"})[
                    "head"
                ]
        super().destroy(sandbox_id)

    def lose_contact(self, handle: SandboxHandle) -> str:
        away = f"{handle.container}-away"
        self.podman("rename", handle.container, away)
        self.mine = (self.mine - {handle.container}) | {away}
        shared = super().channel_dir(handle.sandbox_id)
        aside = shared.parent.parent / f"away-{handle.sandbox_id}"  # same file system: a rename
        os.rename(shared, aside)
        self.aside[handle.sandbox_id] = aside
        return away


class TwoHosts:
    def __init__(self, storage_config):
        self.cfg = small_config()
        self.state_dir = runtime.default_state_dir()
        self.store = open_store(storage_config, encrypted=False)
        self.token = uuid.uuid4().hex[:12]
        self.a = HostView(self.cfg, self.state_dir)
        self.b = HostView(self.cfg, self.state_dir)
        self.host_a = self.start(HOST_A, self.a)
        self.host_b = self.start(HOST_B, self.b)

    def start(self, queue: str, view: HostView) -> SandboxHost:
        """A host's worker (re)started: a new SandboxHost over what the host still has."""
        return SandboxHost(self.cfg, view, self.store, state_dir=self.state_dir, host_queue=queue)

    def spec(self) -> SandboxSpec:
        return SandboxSpec(labels={TEST_LABEL: self.token})

    def cleanup(self) -> list[str]:
        """Each host removes its own, then whatever either lost track of (a failed rename)."""
        Sandboxes(self.host_a, self.a, self.token).cleanup()
        Sandboxes(self.host_b, self.b, self.token).cleanup()
        everything = TrackingBackend(self.cfg, self.state_dir)
        everything.seen = self.a.seen | self.b.seen
        leaked = Sandboxes(self.host_a, everything, self.token).cleanup()
        return leaked + [f"channel dir {d}" for d in self.a.aside.values() if d.exists()]


@pytest.fixture
def two_hosts(sandbox_runtime, storage_config):
    hosts = TwoHosts(storage_config)
    try:
        yield hosts
    finally:
        leaked = hosts.cleanup()
        hosts.store.close()
    assert not leaked, f"test leaked: {leaked}"


def act(step: int, command: str) -> Action:
    return Action(trajectory=TRAJ, step=step, command=command, timeout_s=30)


def recovered_on_b(hosts: TwoHosts) -> tuple[SandboxHandle, SandboxHandle, str]:
    """A runs step 1 and checkpoints; A loses contact (its container keeps running); the
    lineage is recovered on B. Returns A's stale handle, B's handle, A's container name."""
    old = hosts.host_a.create(hosts.spec())
    obs = hosts.host_a.exec(old, act(1, STEP1))
    ref = hosts.host_a.checkpoint(old)
    away = hosts.a.lose_contact(old)
    log = [LoggedAction(trajectory=TRAJ, step=1, command=STEP1, observation_sha256=obs.sha256)]
    outcome = hosts.host_b.recover(old, [ref], log)
    assert outcome.consistent and outcome.source == f"checkpoint@{ref.step}", outcome
    new = outcome.handle
    assert (new.host_queue, new.generation) == (HOST_B, old.generation + 1)
    assert hosts.a.lineages()[old.sandbox_id] == [away] and hosts.a.is_running(away)  # left running on A
    return old, new, away


def test_host_coming_back_fences_its_superseded_container_at_start(two_hosts):
    hosts = two_hosts
    keep = hosts.host_a.create(hosts.spec())  # a sandbox A still rightly holds
    old, new, away = recovered_on_b(hosts)
    # The trajectory ends on B before A comes back: its checkpoints go, its lineage records stay.
    hosts.host_b.destroy(new)
    assert hosts.host_b.delete_checkpoints(new.sandbox_id) >= 2
    assert lineage.newest_generation(hosts.store, hosts.cfg.checkpoint_prefix, new.sandbox_id) == 1

    fenced = hosts.start(HOST_A, hosts.a).sweep_stale()

    assert fenced == [away]
    assert not hosts.a.is_running(away) and hosts.a.lineages() == {keep.sandbox_id: [keep.container]}
    assert not hosts.a.channel_dir(old.sandbox_id).exists()
    assert hosts.host_a.exec(keep, act(1, "echo kept")).stdout == "kept\n"


def test_stale_handle_sent_to_a_host_coming_back_is_refused_and_runs_nothing(two_hosts):
    hosts = two_hosts
    old, new, away = recovered_on_b(hosts)
    host_a = hosts.start(HOST_A, hosts.a)  # back, and an action with A's old handle arrives first

    with pytest.raises(StaleGeneration) as err:
        host_a.exec(old, act(2, "echo stale > /workspace/marker; echo ran"))

    assert f"generation {new.generation} on {HOST_B}" in str(err.value), err.value
    assert not hosts.a.is_running(away) and hosts.a.lineages() == {}  # fenced on the attempt
    assert hosts.a.heads_when_fenced == {away: 1}  # step 2 never ran in A's container
    with pytest.raises(StaleGeneration):
        host_a.checkpoint(old)
    on_b = hosts.host_b.exec(new, act(2, "ls /workspace"))
    assert on_b.stdout == "one\n" and not on_b.replayed_from_journal  # nor in B's


def test_lineage_record_of_an_older_generation_never_wins(storage_config):
    with open_store(storage_config, encrypted=False) as store:
        sid, prefix = f"sbx-{uuid.uuid4().hex[:12]}", "sandboxes/"
        lineage.write(store, prefix, sid, 1, HOST_B, f"{sid}-g1")
        lineage.write(store, prefix, sid, 0, HOST_A, f"{sid}-g0")  # a host writing late
        assert lineage.newest(store, prefix, sid).host_queue == HOST_B
        lineage.write(store, prefix, sid, 1, HOST_A, f"{sid}-g1")  # same generation, retried elsewhere
        rec = lineage.newest(store, prefix, sid)
        assert (rec.generation, rec.host_queue) == (1, HOST_A)
