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
    # A replacement owner adopts its predecessor's segments (version -> path) and arena
    # when they verify, instead of reloading from disk: published versions exist nowhere else.
    adopt_weights: dict[int, Path] = field(default_factory=dict)
    adopt_arena: Path | None = None
    current_version: int = 1


@dataclass(frozen=True)
class OwnerReady:
    pid: int
    versions: dict[int, Path]  # every sealed version the owner holds
    current_version: int
    arena_path: Path
    load_s: float
    params: int
    weight_bytes: int
    # versions of the predecessor's that failed verification (missing, unsealed or a
    # checksum mismatch) and were not adopted: version 1 is rebuilt from the model files, a
    # published one is staged again by the node from its weight source
    rejected: tuple[int, ...] = ()

    @property
    def weights_path(self) -> Path:
        return self.versions[self.current_version]


# The node numbers every request it sends the owner, and the owner's reply carries the number
# and the version back: a reply is matched to the request it answers, so the late reply of a
# request that timed out is never taken for a later request's.


@dataclass(frozen=True)
class StageWeights:
    """Create an empty segment for `version` in the current layout (the publisher fills it)."""

    version: int
    request_id: int = 0  # set by the node when it sends the request


@dataclass(frozen=True)
class Staged:
    version: int
    path: Path
    request_id: int


@dataclass(frozen=True)
class SealWeights:
    """Checksum the staged segment against what the publisher wrote; if it matches, mark it
    OK (the node then decides when the engines move to it)."""

    version: int
    sha256: dict[str, str]
    request_id: int = 0  # set by the node when it sends the request


@dataclass(frozen=True)
class Sealed:
    version: int
    seconds: float
    request_id: int


@dataclass(frozen=True)
class SealRefused:
    version: int
    message: str
    request_id: int


@dataclass(frozen=True)
class UnstageWeights:
    """A publish of `version` failed before the node took it: discard its segment, staged or
    (when the seal answered too late) sealed, so that the version can be published again."""

    version: int


@dataclass(frozen=True)
class DropWeights:
    """Unlink these versions' segments (engines that still map one keep their pages)."""

    versions: tuple[int, ...]


@dataclass(frozen=True)
class VerifyWeights:
    pass


@dataclass(frozen=True)
class WeightsVerified:
    """Every sealed segment the owner holds re-hashed: what the engines serve, a version a
    finish-on-old drain is pinned to, the previous one kept for the trainer."""

    ok: bool
    bad_tensors: tuple[str, ...]
    seconds: float
    bad_versions: tuple[int, ...] = ()


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
    weights_version: int = 1
    niceness: int = 0  # the node's: a shadow runs at the lowest priority until it leads


@dataclass(frozen=True)
class EngineReady:
    pid: int
    init_s: float
    device_digest: str
    rss_bytes: int
    private_bytes: int
    weights_version: int = 1


@dataclass(frozen=True)
class SwitchWeights:
    """At the next step boundary (no request scheduled): compute with `weights_path` from now."""

    version: int
    weights_path: Path


@dataclass(frozen=True)
class WeightsSwitched:
    version: int
    seconds: float


@dataclass(frozen=True)
class SwitchFailed:
    version: int
    message: str


@dataclass(frozen=True)
class VerifySketch:
    """Does the engine still compute with the weights it verified at load / switch?"""


@dataclass(frozen=True)
class SketchResult:
    ok: bool
    seconds: float


@dataclass(frozen=True)
class AddRequest:
    engine_request_id: str
    prompt_ids: list[int]
    spec: SamplingSpec
    max_tokens: int  # what is left of spec.max_tokens after a replay


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
    logprobs: list[float] = field(default_factory=list)  # one per token, under its sampling distribution


@dataclass(frozen=True)
class StepOutput:
    deltas: list[TokenDelta]
    step_s: float
    weights_version: int = 1  # every token of a step comes from one version
    # prompt tokens this step computed for requests that got their first token in it
    # (prefix-cache hits excluded): what the node's hang deadline charges prefill for
    prefilled_tokens: int = 0


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
