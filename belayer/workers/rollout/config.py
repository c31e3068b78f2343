"""Rollout node settings: model, engines and failure detection."""

from typing import Literal

from belayer.section import Section
from pydantic import Field


class RolloutConfig(Section):
    """One rollout node: memory owner, primary and shadow engine, node supervisor."""

    model: Literal["tiny", "bench"] = Field("tiny", description="Which project-built model to serve.")
    dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="Engine dtype; fp32 keeps takeover replay token-identical."
    )
    weight_mode: Literal["private", "shared"] = Field(
        "private", description="Engines use the owner's weights mapped (shared) or a prepacked copy."
    )
    kv_cache_mb: int = Field(256, ge=16, description="Size of the shared KV arena (MiB).")
    max_model_len: int = Field(2048, ge=64, description="Context length served.")
    heartbeat_timeout_s: float = Field(
        2.0, gt=0, description="An engine silent this long is declared hung and replaced."
    )
    shadow: bool = Field(True, description="Keep a pre-initialized shadow engine for takeover.")
