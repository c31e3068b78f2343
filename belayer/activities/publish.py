"""`rollout.publish_weights`: publish a new weights version into one rollout node.

Served on the node's own task queue only (never the shared one): a training workflow
publishes to every node by calling it once per node queue. The weights travel as a
pointer (an object-store key and its sha256) to a safetensors file a trainer wrote with
`store_weights`; the activity streams it into the node's owner, which checksums it and
flips the version. Retrying a publish that already took effect returns its result.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

from temporalio.exceptions import ApplicationError

from belayer.activities.runtime import FailsAs, Failures, heartbeating, implements
from belayer.contracts.errors import BAD_REQUEST, CORRUPT_WEIGHTS, MODEL_NOT_BUILT, STALE_WEIGHTS_VERSION
from belayer.contracts.publish import (
    PUBLISH_WEIGHTS,
    STACK_WEIGHTS_KEY,
    WEIGHTS_VERSION,
    PublishedWeights,
    PublishWeightsArgs,
    PublishWeightsResult,
)
from belayer.model.build import MANIFEST, model_dir_name
from belayer.rollout.errors import BadRequestError
from belayer.storage.errors import CorruptObject, ObjectNotFound
from belayer.storage.store import ObjectRef
from belayer.storage.weights import load_weights

HEARTBEAT_EVERY_S = 1.0
# Weights that do not verify and a bad request are final; the rest follows its `retryable`.
FAILURES = Failures(
    {
        CorruptObject: FailsAs(CORRUPT_WEIGHTS, "weights object does not verify"),
        BadRequestError: FailsAs(BAD_REQUEST),
    }
)


class PublishActivities:
    """Publishing into one node; `remember` (a file) keeps the latest version across restarts,
    and every publish records the stack's weights in the object store (`STACK_WEIGHTS_KEY`)."""

    def __init__(self, node, store, remember: Path | None = None):
        self.node, self.store, self.remember = node, store, remember

    def restore(self) -> PublishedWeights | None:
        """Publish into the freshly started node (before it serves) the newest of what it
        remembers serving and what the stack serves; None when it already serves that."""
        known = [w for w in (self._remembered(), self.stack_weights()) if w is not None]
        latest = max(known, key=lambda w: w.version, default=None)
        if latest is None or latest.version <= self.node.roles().weights_version:
            return None
        self.node.publish(latest.version, self._tensors(latest.weights, latest.model))
        self._remember_locally(latest)
        return latest

    def stack_weights(self) -> PublishedWeights | None:
        """The weights the stack's last publish put into its nodes (None before any)."""
        try:
            return PublishedWeights.model_validate_json(self.store.get_bytes(STACK_WEIGHTS_KEY))
        except ObjectNotFound:
            return None

    def _remembered(self) -> PublishedWeights | None:
        if self.remember is None or not self.remember.is_file():
            return None
        return PublishedWeights.model_validate_json(self.remember.read_text())

    def tensors_of(self, version: int) -> dict | None:
        """The tensors of `version` if it is the one last published here (the node's weight
        source when a new memory owner could not adopt its segment); None otherwise."""
        published = self._remembered()
        if published is None or published.version != version:
            return None
        return self._tensors(published.weights, published.model)

    def _remember(self, args: PublishWeightsArgs) -> None:
        published = PublishedWeights(version=args.version, weights=args.weights, model=args.model)
        self._remember_locally(published)
        recorded = self.stack_weights()
        if recorded is None or recorded.version < published.version:  # a late, older publish never wins
            self.store.put_bytes(STACK_WEIGHTS_KEY, published.model_dump_json().encode())

    def _remember_locally(self, published: PublishedWeights) -> None:
        if self.remember is None:
            return
        self.remember.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.remember.with_suffix(".tmp")
        tmp.write_text(published.model_dump_json())
        os.replace(tmp, self.remember)

    @implements(PUBLISH_WEIGHTS, FAILURES)
    async def publish_weights(self, args: PublishWeightsArgs) -> PublishWeightsResult:
        if self._took_effect(args.version):
            settled = await self._settled(args.version)
            await asyncio.to_thread(self._remember, args)  # the first attempt may have died before it did
            return settled
        started = time.perf_counter()
        tensors = await asyncio.to_thread(self._tensors, args.weights, args.model)
        fetch_s = time.perf_counter() - started
        report = await heartbeating(
            asyncio.to_thread(self.node.publish, args.version, tensors, args.policy),
            every_s=HEARTBEAT_EVERY_S,
            details=lambda: {"version": args.version},
        )
        await asyncio.to_thread(self._remember, args)
        return PublishWeightsResult(node_id=self.node.config.node_id, fetch_s=fetch_s, **report.__dict__)

    @implements(WEIGHTS_VERSION)
    async def weights_version(self) -> int:
        """The version the node serves now (1: the model it was built from)."""
        return self.node.roles().weights_version

    def all(self) -> list:
        return [self.publish_weights, self.weights_version]

    def _tensors(self, ref: ObjectRef | None, model: str | None = None) -> dict:
        if ref is None:
            from safetensors.torch import (
                load_file,  # import cost: torch, ~2.5 s; the rollout worker reads a checkpoint only on a publish
            )

            return load_file(str(self._built_model_dir(model) / "model.safetensors"))
        return load_weights(self.store, ref)

    def _built_model_dir(self, model: str | None) -> Path:
        """The node's own model, or the named project-built model beside it in the model cache."""

        if model is None:
            return self.node.model_dir
        path = self.node.model_dir.parent / model_dir_name(model)
        if not (path / MANIFEST).is_file():
            raise ApplicationError(
                f"model {model!r} is not built on node {self.node.config.node_id}'s host (no {path}); "
                f"build it there with `belayer model build --size {model}`",
                type=MODEL_NOT_BUILT,
                non_retryable=True,
            )
        return path

    def _took_effect(self, version: int) -> bool:
        """Has an earlier attempt (whose reply was lost) sealed this version already?"""
        roles = self.node.roles()
        if version < roles.weights_version:
            raise ApplicationError(
                f"node {roles.node_id} already serves weights version {roles.weights_version}; "
                "versions only grow",
                type=STALE_WEIGHTS_VERSION,
                non_retryable=True,
            )
        return version == roles.weights_version and version > 1

    async def _switched(self, version: int) -> None:
        """Once the node serves `version` on its leader, with no publish of it under way."""
        while self.node.roles().publishing == version or self.node.roles().leader_version != version:
            await asyncio.sleep(HEARTBEAT_EVERY_S / 4)

    async def _settled(self, version: int) -> PublishWeightsResult:
        """Wait for the earlier attempt's switch to finish, then report it as done."""
        waiting = {"version": version, "waiting_for": "an earlier attempt"}
        await heartbeating(
            self._switched(version), every_s=HEARTBEAT_EVERY_S, details=lambda: waiting, at_start=True
        )
        roles = self.node.roles()
        zero = dict.fromkeys(("fetch_s", "staged_s", "written_s", "sealed_s", "switched_s"), 0.0)
        return PublishWeightsResult(
            node_id=roles.node_id,
            version=version,
            previous_version=version,
            policy="",
            paused_requests=0,
            drained_requests=0,
            already_published=True,
            **zero,
        )
