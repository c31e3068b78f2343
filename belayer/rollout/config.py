"""Rollout node settings: model, engines, shared memory and failure detection."""

from typing import Literal

from pydantic import Field

from belayer.model.build import ModelSize
from belayer.section import Section


class RolloutConfig(Section):
    """One rollout node: memory owner, primary and shadow engine, node supervisor."""

    node_id: str = Field(
        "node0",
        pattern=r"^[A-Za-z0-9_.-]{1,40}$",
        description="Names the node's task queue and its shared-memory segments (/dev/shm/belayer-<node_id>-*); "
        "unique per node: a node whose id a live node has (on this machine or another host) is refused.",
    )
    model: ModelSize = Field(
        "tiny",
        description="Which project-built model to serve (tiny-warm, tiny-agent: tiny after a warm start).",
    )
    dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="Engine dtype; fp32 keeps takeover replay token-identical."
    )
    weight_mode: Literal["private", "shared"] = Field(
        "private",
        description=(
            "Engines use the owner's weights mapped without copying (shared: less memory, slower CPU "
            "decode) or their own prepacked copy made at init (private: faster decode). Default from "
            "the bench model (116M, fp32, 2 cores): private 150 tok/s batched, +445 MiB per engine; "
            "shared 36 tok/s batched. On GPUs weights are used as loaded and shared costs nothing."
        ),
    )
    kv_cache_mb: int = Field(256, ge=16, le=1 << 20, description="Size of the shared KV arena (MiB).")
    max_model_len: int = Field(2048, ge=64, le=1 << 20, description="Context length served.")
    max_num_seqs: int = Field(
        32, ge=1, le=4096, description="Requests batched together by the leader engine."
    )
    heartbeat_interval_s: float = Field(
        0.25, gt=0, le=60, description="How often an engine reports it is alive from its serving loop."
    )
    heartbeat_timeout_s: float = Field(
        60.0,
        gt=0,
        le=600,
        description=(
            "Upper bound of the leader's hang deadline. The deadline itself follows the engine's step "
            "times (4x the slowest recent decode step plus the prefill its pending prompts need, at "
            "least hang_floor_s), so the tiny model, the bench model and a loaded machine need no setting; "
            "until steps are seen, it is this."
        ),
    )
    hang_floor_s: float = Field(
        2.0,
        gt=0,
        le=600,
        description="The hang deadline never goes below this (scheduler stalls and GC pauses of a healthy engine).",
    )
    engine_start_timeout_s: float = Field(
        180.0, gt=0, le=3600, description="How long an engine (or the owner) may take to become ready."
    )
    control_timeout_s: float = Field(
        10.0, gt=0, le=600, description="How long a control call to an engine (lease, health check) may take."
    )
    weights_verify_interval_s: float = Field(
        60.0,
        ge=0,
        le=86400,
        description="Background re-check of weight checksums by the owner; 0 disables it.",
    )
    publish_policy: Literal["finish_on_old", "continue_on_new"] = Field(
        "continue_on_new",
        description=(
            "What requests in flight during a weights publish do: continue_on_new pauses them and "
            "continues on the new version (KV rebuilt by re-prefill; the fresher policy, the default); "
            "finish_on_old lets them finish on the old version while new requests wait. Every token "
            "carries the version that produced it either way."
        ),
    )
    publish_timeout_s: float = Field(
        600.0, gt=0, le=86400, description="How long a publish (stage, seal, both engines switched) may take."
    )
    shadow: bool = Field(True, description="Keep a pre-initialized shadow engine for takeover.")
    engine_threads: int = Field(
        0, ge=0, le=1024, description="Torch threads per engine process; 0 lets vLLM decide."
    )
