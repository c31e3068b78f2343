"""Publishing a new weights version into a running node, in place.

1. stage: the owner creates an empty segment for the version (loop thread, one message);
2. write: the publisher's thread copies the trainer's tensors into it (vLLM layout, the
   engines' dtype) and hashes what it meant to write; no disk round trip;
3. seal: the owner re-hashes the segment; only if every tensor matches does it mark the
   segment OK, and the node makes it the version the engines move to. A torn or corrupt
   write is refused and its segment unlinked: nothing is ever served from it. A publish
   that fails before that (a write that raises, an owner reply that does not come in
   time) unstages its segment, so the version can be published again at once; a late
   reply is matched to its request by (request id, version) and dropped;
4. switch (loop thread, at step boundaries): each engine gets SwitchWeights once nothing
   of the old version is scheduled on it. In-flight requests follow the policy:
   - `continue_on_new`: they are aborted on the leader, which switches at once, then sent
     again (prompt + tokens so far): the KV is rebuilt by re-prefill on the new weights;
   - `finish_on_old`: they finish on the old version; new requests wait until the last
     old one is done, then both engines switch. A takeover meanwhile may use a shadow
     still on the old version, and a shadow started meanwhile starts on it, so the drain
     goes on after any number of failures.
   Either way every token carries the version of the step that produced it.
5. release: once both engines are on the new version, versions older than the previous
   one are dropped; the previous one stays until `release_weights`.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import time
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from belayer.rollout import children, recovery, shm
from belayer.rollout.children import Child
from belayer.rollout.errors import BadRequestError, RolloutError
from belayer.rollout.owner import vllm_parts
from belayer.rollout.protocol import (
    AbortRequest,
    DropWeights,
    Sealed,
    SealRefused,
    SealWeights,
    Staged,
    StageWeights,
    SwitchWeights,
    UnstageWeights,
    WeightsSwitched,
)

if TYPE_CHECKING:
    from belayer.rollout.node import RolloutNode

log = logging.getLogger("belayer.rollout")

Policy = Literal["finish_on_old", "continue_on_new"]
POLICIES = ("finish_on_old", "continue_on_new")


class PublishRefusedError(RolloutError):
    """The owner refused the new version (torn or corrupt write): nothing was served from it."""


@dataclass(frozen=True)
class PublishReport:
    version: int
    previous_version: int
    policy: str
    staged_s: float  # seconds from the call: segment created
    written_s: float  # tensors copied into it
    sealed_s: float  # checksums verified, version flipped in the owner
    switched_s: float  # both engines compute with it
    paused_requests: int  # continue_on_new: requests re-prefilled on the new version
    drained_requests: int  # finish_on_old: requests that finished on the old version


@dataclass
class Publish:
    """A publish in progress, advanced by the node's loop."""

    version: int
    previous_version: int
    policy: str
    started: float
    done: Future = field(default_factory=Future)
    marks: dict[str, float] = field(default_factory=dict)
    paused_requests: int = 0
    drained_requests: int = 0

    def mark(self, phase: str) -> None:
        self.marks[phase] = time.perf_counter() - self.started

    def report(self) -> PublishReport:
        return PublishReport(
            version=self.version,
            previous_version=self.previous_version,
            policy=self.policy,
            staged_s=self.marks.get("staged", 0.0),
            written_s=self.marks.get("written", 0.0),
            sealed_s=self.marks.get("sealed", 0.0),
            switched_s=self.marks.get("switched", 0.0),
            paused_requests=self.paused_requests,
            drained_requests=self.drained_requests,
        )


def check_policy(policy: str) -> str:
    if policy not in POLICIES:
        raise BadRequestError(f"unknown in-flight policy {policy!r}; use one of {', '.join(POLICIES)}")
    return policy


def write_staged(path, tensors: Mapping[str, object], dtype: str) -> dict[str, str]:
    """Copy the trainer's tensors into the staged segment; return the sha256 of each tensor
    as the publisher meant it (the owner compares against the segment's bytes).

    One copy per tensor, straight into the mapping (a fused vLLM parameter is written part
    after part), hashing the source's own buffers, two tensors at a time (torch's copy and
    hashlib release the GIL)."""
    import torch  # import cost: torch, ~2.5 s; only an in-process weight source needs it

    parts = vllm_parts(dict(tensors), dtype)
    mm = shm.map_readwrite(path)
    try:
        header, entries = shm.read_manifest(mm)
        _check_layout(entries, parts)

        def copy_and_hash(entry: shm.TensorEntry) -> str:
            digest, start = hashlib.sha256(), header.data_offset + entry.offset
            for part in parts[entry.name]:
                source = part.reshape(-1).view(torch.uint8)
                target = torch.frombuffer(mm, dtype=torch.uint8, count=source.numel(), offset=start)
                target.copy_(source)
                del target  # the mapping cannot close while a tensor exports it
                digest.update(source.numpy())
                start += source.numel()
            return digest.hexdigest()

        with ThreadPoolExecutor(max_workers=2) as pool:
            digests = list(pool.map(copy_and_hash, entries))
        return {entry.name: digest for entry, digest in zip(entries, digests, strict=True)}
    finally:
        mm.close()


def _check_layout(entries: list[shm.TensorEntry], parts: dict[str, list]) -> None:
    names = {e.name for e in entries}
    missing, unknown = names - set(parts), set(parts) - names
    if missing or unknown:
        raise BadRequestError(
            f"published tensors do not match the served model: missing {sorted(missing)[:3]}, "
            f"unknown {sorted(unknown)[:3]} (send the model's full state dict, HF or vLLM names)"
        )
    for entry in entries:
        shapes = [tuple(p.shape) for p in parts[entry.name]]
        rows = sum(shape[0] for shape in shapes)
        if any(shape[1:] != entry.shape[1:] for shape in shapes) or rows != entry.shape[0]:
            raise BadRequestError(f"{entry.name}: published shapes {shapes}, served {entry.shape}")


class PublishCoordinator:
    """The publishing state machine of one node (steps 1-5 above): it stages, writes and
    seals with the owner from the publisher's thread, and moves the engines on the loop.

    It owns the publish in progress, the owner requests waiting for their replies, and the
    finish_on_old pins; the node's `target_version` is what it moves the engines to. A
    recovery reads `pinned_versions()` to know which versions a new leader may serve."""

    def __init__(self, node: RolloutNode):
        self._node = node
        self.publishing: Publish | None = None
        # (request id, version) -> the future its reply resolves: see `_owner_request`
        self._owner_replies: dict[tuple[int, int], Future] = {}
        self._owner_request_ids = itertools.count(1)

    def publish(
        self,
        version: int,
        tensors: Mapping[str, Any],
        policy: str | None = None,
        timeout: float | None = None,
    ) -> PublishReport:
        """Make `version` what both engines compute with, in place; returns once both serve it."""
        node = self._node
        policy = check_policy(policy or node.config.publish_policy)
        timeout = timeout or node.config.publish_timeout_s
        pub = self._begin(version, policy)
        try:
            path = self.stage_write_seal(version, tensors, timeout, pub)
            node.in_loop(lambda: self._switch_to(pub, version, path)).result(timeout)
            pub.done.result(timeout)
            return pub.report()
        except FutureTimeout:
            raise RolloutError(
                f"publish of weights version {version} not done after {timeout} s (rollout.publish_timeout_s)"
            ) from None
        finally:
            with node.lock:
                if self.publishing is pub:
                    self.publishing = None

    def release_weights(self, version: int) -> None:
        """The trainer no longer needs `version`: the owner drops it unless an engine or an
        in-flight request still uses it (then it goes with the next publish)."""
        node = self._node
        node.in_loop(lambda: self.drop_unused(keep=set(node.owner_role.versions) - {version})).result(
            node.config.control_timeout_s
        )

    def _begin(self, version: int, policy: str) -> Publish:
        node = self._node
        with node.lock:
            if node.broken is not None:
                raise RolloutError(f"rollout node {node.config.node_id} cannot serve ({node.broken})")
            if node.owner_role.restoring is not None:
                raise RolloutError(
                    f"weights version {node.owner_role.restoring} is being restored after the memory owner "
                    "was replaced; publish again shortly"
                )
            if self.publishing is not None:
                raise BadRequestError(
                    f"weights version {self.publishing.version} is still being published; "
                    "publish one at a time"
                )
            newest = max([node.target_version, *node.owner_role.versions])
            if version <= newest:
                raise BadRequestError(
                    f"weights version {version} is not newer than {newest}; versions only grow"
                )
            self.publishing = Publish(version, node.target_version, policy, time.perf_counter())
            return self.publishing

    def fail(self, error: Exception) -> None:
        """(node lock held) The node closes: a publish in progress fails with `error`."""
        if self.publishing is not None and not self.publishing.done.done():
            self.publishing.done.set_exception(error)

    # -- with the owner (the publisher's thread) ----------------------------------------

    def stage_write_seal(
        self, version: int, tensors: Mapping[str, Any], timeout: float, pub: Publish | None = None
    ) -> Path:
        """Have the owner stage `version`, write `tensors` into its segment and have the owner
        seal it; returns the segment. Any failure on the way (a write that raises, an owner
        that does not answer in time) unstages the version, so it can be published again at
        once instead of existing half-made on the owner until the owner is replaced."""
        mark = pub.mark if pub is not None else lambda phase: None
        try:
            staged = self._owner_request(StageWeights(version), timeout)
            mark("staged")
            expected = write_staged(staged.path, tensors, self._node.config.dtype)
            mark("written")
            self._owner_request(SealWeights(version, expected), timeout)
            mark("sealed")
            return staged.path
        except BaseException:
            self._node.in_loop(lambda: self._unstage(version))
            raise

    def _unstage(self, version: int) -> None:
        """(loop) The owner discards what it holds of `version` unless the node took it as
        sealed. Sent after the failed request, so the owner handles it after that request even
        when it answers late; a dead or failed owner's segments go with its replacement."""
        node = self._node
        owner = node.holders.owner
        if version in node.owner_role.versions or owner is None or node.owner_role.failure is not None:
            return
        children.send(owner, UnstageWeights(version))

    def _owner_request(self, msg, timeout: float):
        """Send `msg` (numbered here) to the owner from the loop; the reply with the same
        request id and version resolves the future in `on_owner_reply`, so the loop never
        blocks while the owner hashes, and a reply that comes after its request timed out is
        dropped instead of answering a later request."""
        node = self._node
        msg = replace(msg, request_id=next(self._owner_request_ids))
        key = (msg.request_id, msg.version)
        reply: Future = Future()

        def send() -> None:
            with node.lock:
                if reply.cancelled():  # its caller gave up before the loop came to it
                    return
                owner = node.holders.owner
                if owner is None or owner.ready is None or node.owner_role.failure is not None:
                    reply.set_exception(
                        RolloutError("the memory owner is being replaced; publish again shortly")
                    )
                    return
                self._owner_replies[key] = reply
            children.send(node.holders.owner, msg)

        node.in_loop(send)
        try:
            result = reply.result(timeout)
        except FutureTimeout:
            with node.lock:  # the loop resolves and registers under it: answered now, or never
                self._owner_replies.pop(key, None)
                if reply.cancel():
                    raise
            result = reply.result(0)
        if isinstance(result, SealRefused):
            error = PublishRefusedError if isinstance(msg, SealWeights) else BadRequestError
            raise error(result.message)
        return result

    def on_owner_reply(self, msg: Staged | Sealed | SealRefused) -> None:
        """(node lock held) Resolve the request `msg` answers. A reply nobody waits for any
        more (its request timed out; the failure unstages its version) is dropped: a late
        `Sealed` never makes a version the node holds."""
        node = self._node
        reply = self._owner_replies.pop((msg.request_id, msg.version), None)
        if reply is None:
            log.warning(
                "rollout node %s: the memory owner's %s of weights version %d came after its "
                "request timed out; ignored",
                node.config.node_id,
                type(msg).__name__,
                msg.version,
            )
            return
        if isinstance(msg, Sealed):
            node.owner_role.versions[msg.version] = shm.weights_path(
                node.config.node_id, node.holders.generation, msg.version
            )
        reply.set_result(msg)

    def fail_owner_requests(self, error: Exception) -> None:
        """The owner died: no request to it will be answered."""
        with self._node.lock:
            for reply in self._owner_replies.values():
                reply.set_exception(error)
            self._owner_replies = {}

    # -- moving the engines (the loop) --------------------------------------------------

    def _switch_to(self, pub: Publish, version: int, path: Path) -> None:
        """The owner sealed `version`: from now on the engines must move to it."""
        node = self._node
        with node.lock:
            node.owner_role.versions[version] = path
            if pub.policy == "finish_on_old":
                for record in node.inflight.on_leader():
                    record.pinned_version = node.holders.leader.version
                    pub.drained_requests += 1
            node.target_version = version
        node.notify_state()

    def pinned_versions(self) -> set[int]:
        """The versions finish_on_old drains keep requests on."""
        node = self._node
        with node.lock:  # submits add records from other threads
            return {r.pinned_version for r in node.inflight.open() if r.pinned_version is not None}

    def advance(self) -> None:
        """(loop) Switch each engine once nothing of the old version is scheduled on it;
        finish the publish once both compute with the target."""
        node = self._node
        leader, shadow, target = node.holders.leader, node.holders.shadow, node.target_version
        if (
            leader is not None
            and leader.ready is not None
            and leader.version != target
            and leader.switching_to is None
        ):
            if not self.pinned_versions() & {leader.version}:
                self._pause_leader_requests()
                self._send_switch(leader)
        leader_moving = leader is not None and (leader.switching_to == target or leader.version == target)
        if (
            shadow is not None
            and shadow.ready is not None
            and shadow.version != target
            and shadow.switching_to is None
        ):
            # finish_on_old: the shadow stays on the old version while the leader drains, so a
            # takeover meanwhile can still finish the old requests.
            if leader_moving or not self.pinned_versions():
                self._send_switch(shadow)
        pub = self.publishing
        settled = (
            leader is not None and leader.version == target and (shadow is None or shadow.version == target)
        )
        if pub is not None and pub.version == target and settled and not pub.done.done():
            pub.mark("switched")
            self.drop_unused(keep={target, pub.previous_version})
            pub.done.set_result(None)
            node.notify_state()

    def _pause_leader_requests(self) -> None:
        """continue_on_new: abort what the leader is decoding; the records are re-sent (prompt
        + tokens so far) once it computes with the new version."""
        node = self._node
        with node.lock:
            for record in node.inflight.on_leader():
                children.send(node.holders.leader, AbortRequest(record.engine_request_id))
                node.inflight.detach(record)
                if self.publishing is not None:
                    self.publishing.paused_requests += 1

    def _send_switch(self, engine: Child) -> None:
        node = self._node
        path = node.owner_role.versions.get(node.target_version)
        if path is None:
            return  # not sealed here (an owner replacement is adopting it): next iteration
        engine.switching_to = node.target_version
        children.send(engine, SwitchWeights(node.target_version, path))

    def on_switched(self, engine: Child, msg) -> None:
        """(node lock held) An engine answered its SwitchWeights."""
        node = self._node
        engine.switching_to = None
        if isinstance(msg, WeightsSwitched):
            engine.version = msg.version
            log.info(
                "rollout node %s: %s (pid %s) on weights version %d in %.3f s",
                node.config.node_id,
                engine.role,
                engine.pid,
                msg.version,
                msg.seconds,
            )
            node.notify_state()
            return
        log.error(
            "rollout node %s: %s (pid %s) could not switch to version %d: %s",
            node.config.node_id,
            engine.role,
            engine.pid,
            msg.version,
            msg.message,
        )
        engine.switch_failed = True
        if engine is node.holders.shadow:  # never keep a shadow behind: replace it by one on the target
            node.in_loop(lambda: node.shadow_role.replace_behind(engine))
        elif engine is node.holders.leader:
            node.in_loop(
                lambda: recovery.recover(
                    node, f"leader could not switch to weights version {msg.version}: {msg.message}"
                )
            )

    def drop_unused(self, keep: set[int]) -> None:
        """(loop) The owner drops every version not in `keep` that no engine, pinned request
        or the target uses."""
        node = self._node
        in_use = node.holders.engine_versions() | self.pinned_versions() | {node.target_version}
        drop = tuple(v for v in node.owner_role.versions if v not in keep | in_use)
        owner = node.holders.owner
        if drop and owner is not None and node.owner_role.failure is None:
            children.send(owner, DropWeights(drop))
            for version in drop:
                node.owner_role.versions.pop(version, None)
