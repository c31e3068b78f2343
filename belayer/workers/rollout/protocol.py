"""Messages between the node supervisor and its child processes (owner, engines).

Plain frozen dataclasses sent over `multiprocessing` pipes: one type per message, never
dicts, so a field can be added without breaking the other side.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class SamplingSpec:
    """Sampling parameters of one request, as logged for replay."""

    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False


# ------------------------------------------------------------------ owner


@dataclass(frozen=True)
class OwnerSpec:
    node_id: str
    generation: int
    model_dir: Path
    dtype: str
    kv_bytes: int
    verify_interval_s: float


@dataclass(frozen=True)
class OwnerReady:
    pid: int
    weights_path: Path
    arena_path: Path
    load_s: float
    params: int
    weight_bytes: int


@dataclass(frozen=True)
class VerifyWeights:
    pass


@dataclass(frozen=True)
class WeightsVerified:
    ok: bool
    bad_tensors: tuple[str, ...]
    seconds: float


@dataclass(frozen=True)
class Stop:
    pass


@dataclass(frozen=True)
class Failed:
    """A child could not start or hit an error it cannot continue from."""

    message: str


# ------------------------------------------------------------------ engines


@dataclass(frozen=True)
class EngineSpec:
    node_id: str
    role: str  # "primary" | "shadow" | "cold": only for logs and fault targeting
    model_dir: Path
    weights_path: Path
    arena_path: Path
    dtype: str
    weight_mode: str
    kv_bytes: int
    max_model_len: int
    max_num_seqs: int
    heartbeat_interval_s: float
    threads: int


@dataclass(frozen=True)
class EngineReady:
    pid: int
    init_s: float
    device_digest: str
    rss_bytes: int
    private_bytes: int


@dataclass(frozen=True)
class AddRequest:
    engine_request_id: str
    prompt_ids: list[int]
    spec: SamplingSpec
    max_tokens: int  # what is left of spec.max_tokens after a replay
    base_position: int = field(default=0)  # unused by the engine; kept for logs


@dataclass(frozen=True)
class AbortRequest:
    engine_request_id: str


@dataclass(frozen=True)
class TakeLease:
    pass


@dataclass(frozen=True)
class LeaseTaken:
    epoch: int
    seconds: float


@dataclass(frozen=True)
class HealthCheck:
    expected_digest: str


@dataclass(frozen=True)
class HealthResult:
    ok: bool
    digest: str
    seconds: float


@dataclass(frozen=True)
class Heartbeat:
    t: float


@dataclass(frozen=True)
class TokenDelta:
    engine_request_id: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None


@dataclass(frozen=True)
class StepOutput:
    deltas: list[TokenDelta]
    step_s: float


@dataclass(frozen=True)
class Rejected:
    engine_request_id: str
    message: str


@dataclass(frozen=True)
class MemoryReport:
    rss_bytes: int
    private_bytes: int
    shared_bytes: int


@dataclass(frozen=True)
class QueryMemory:
    pass
