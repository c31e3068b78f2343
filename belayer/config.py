"""Belayer's configuration: one `BelayerConfig`, one sub-config per component.

Sources, highest priority first: explicit overrides, `BELAYER_*` environment variables
(nested fields with `__`, e.g. `BELAYER_STORAGE__BUCKET`), a TOML file (`--config`,
`BELAYER_CONFIG`, or `~/.config/belayer/config.toml` when present), then defaults.
Environment variables are read here and nowhere else; components receive only their
own sub-config.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field, SecretStr, ValidationError
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from belayer.errors import ConfigError
from belayer.policy.config import PolicyConfig
from belayer.rollout.config import RolloutConfig
from belayer.sandbox.config import SandboxConfig
from belayer.section import Section
from belayer.storage.config import StorageConfig

ENV_PREFIX = "BELAYER_"
DEFAULT_CONFIG_FILE = Path("~/.config/belayer/config.toml").expanduser()


class TemporalConfig(Section):
    """Where the Temporal server is and which task queues Belayer uses."""

    address: str = Field("127.0.0.1:7233", description="Temporal frontend host:port.")
    namespace: str = Field("default", description="Temporal namespace for all workflows.")
    ui_port: int = Field(8233, ge=1, le=65535, description="Local dev server web UI port.")
    rollout_task_queue: str = Field(
        "belayer-rollout", description="Shared queue any rollout node serves generate on."
    )
    workflow_task_queue: str = Field(
        "belayer-workflows", description="Queue the trajectory workflows run on."
    )
    encrypt_payloads: bool = Field(
        False,
        description="Encrypt every Temporal payload (inputs, results, failures) with AES-256-GCM "
        "under a key derived from storage.encryption_key, which must then be set; the web UI "
        "shows them through `belayer codec-server`.",
    )
    accept_plaintext_payloads: bool = Field(
        False,
        description="With encrypt_payloads on, still read payloads that carry no encryption marker "
        "(histories written before encryption was switched on). Off by default: an unmarked "
        "payload is refused, as anyone who can reach Temporal could have written it. Turn it on "
        "only until the workflows started before encryption have ended.",
    )
    codec_port: int = Field(
        8081,
        ge=1,
        le=65535,
        description="Port of `belayer codec-server` on 127.0.0.1; `belayer up` points the web UI "
        "at it when encrypt_payloads is on.",
    )


def missing_key_error() -> ConfigError:
    """Payload encryption switched on without the key it derives from."""
    return ConfigError(
        "temporal.encrypt_payloads is on but storage.encryption_key is empty: payloads are "
        "encrypted under the archives' key. Set BELAYER_STORAGE__ENCRYPTION_KEY (or "
        "`storage.encryption_key` in the config file) to a 32-byte base64 key, or turn "
        "BELAYER_TEMPORAL__ENCRYPT_PAYLOADS off"
    )


class StackConfig(Section):
    """The local stack started by `belayer up` (development and CI).

    SeaweedFS also listens on each port + 10000 (gRPC); its S3 port comes from
    `storage.endpoint`.
    """

    startup_timeout_s: float = Field(60.0, gt=0, description="How long `up --wait` waits per component.")
    seaweedfs_master_port: int = Field(9333, ge=1, le=55535, description="SeaweedFS master port.")
    seaweedfs_filer_port: int = Field(8888, ge=1, le=55535, description="SeaweedFS filer port.")
    seaweedfs_volume_port: int = Field(9340, ge=1, le=55535, description="SeaweedFS volume port.")
    seaweedfs_admin_port: int = Field(23646, ge=1, le=55535, description="SeaweedFS admin port.")
    sandbox_hosts: int = Field(
        1,
        ge=1,
        le=16,
        description="Sandbox hosts `belayer up` starts (also `up --sandbox-hosts`): the machine itself, then "
        "hosts in mount and UTS namespaces of their own (<machine>-h1, ...), each with its own podman storage, "
        "runc state, network namespaces, channels and queue (root only, like every sandbox host).",
    )
    rollout_nodes: int = Field(
        1,
        ge=1,
        le=16,
        description="Rollout nodes `belayer up` starts (also `up --rollout-nodes`): ids rollout.node_id, then "
        "<node_id>.1, <node_id>.2, ..., each with its own engines, shared memory and task queue.",
    )
    serve_port: int = Field(
        8400,
        ge=0,
        le=65535,
        description="Port of the OpenAI-compatible endpoint (`belayer serve`) that `belayer up` starts on "
        "127.0.0.1; 0: none.",
    )
    serve_workloads: list[Path] = Field(
        default_factory=list,
        description="Workloads whose tasks the stack's endpoint offers by id (a session may also bring its task).",
    )


class TrainerConfig(Section):
    """The trainer worker (`python -m belayer.workers.trainer`)."""

    task_queue: str = Field("belayer-trainer", description="Queue `trainer.train_step` is served on.")
    threads: int = Field(
        2,
        ge=1,
        le=256,
        description="torch CPU threads of the worker outside a step (loading, hashing); "
        "a step runs on its run's `TrainerSettings.threads`, since its numbers depend on them.",
    )
    device: Literal["cpu", "cuda", "auto"] = Field(
        "auto",
        description="Where the model trains; auto is CUDA when torch sees a GPU. Keep it fixed "
        "for a run: CPU and GPU results differ in the last bits.",
    )


class BelayerConfig(BaseSettings):
    """The whole effective configuration."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        env_nested_delimiter="__",
        extra="forbid",
        validate_default=True,
    )

    state_dir: Path = Field(
        Path("~/.local/state/belayer"),
        description="Pids, logs, Temporal's sqlite file, object data and podman storage.",
    )
    cache_dir: Path = Field(
        Path("~/.cache/belayer"), description="Heavy artefacts keyed by version (image, model, CRIU)."
    )
    temporal: TemporalConfig = TemporalConfig()
    storage: StorageConfig = StorageConfig()
    stack: StackConfig = StackConfig()
    sandbox: SandboxConfig = SandboxConfig()
    rollout: RolloutConfig = RolloutConfig()
    policy: PolicyConfig = PolicyConfig()
    trainer: TrainerConfig = TrainerConfig()

    def model_post_init(self, __context: Any) -> None:
        self.state_dir = self.state_dir.expanduser()
        self.cache_dir = self.cache_dir.expanduser()
        if self.temporal.encrypt_payloads and not self.storage.encryption_key.get_secret_value():
            raise missing_key_error()

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        toml_file = _config_file_path()
        if toml_file is not None:
            sources.append(TomlConfigSettingsSource(settings_cls, toml_file=toml_file))
        return tuple(sources)


_explicit_config_file: Path | None = None


def _config_file_path() -> Path | None:
    if _explicit_config_file is not None:
        return _explicit_config_file
    from_env = os.environ.get(ENV_PREFIX + "CONFIG")
    if from_env:
        return Path(from_env).expanduser()
    return DEFAULT_CONFIG_FILE if DEFAULT_CONFIG_FILE.is_file() else None


def load_config(config_file: Path | None = None, **overrides: Any) -> BelayerConfig:
    """Build the effective configuration, or raise `ConfigError` naming field and fix."""
    global _explicit_config_file
    if config_file is not None and not config_file.is_file():
        raise ConfigError(
            f"config file {config_file} does not exist; pass an existing TOML file to "
            f"--config or unset {ENV_PREFIX}CONFIG"
        )
    _explicit_config_file = config_file
    try:
        env_file = _config_file_path()
        if env_file is not None and not env_file.is_file():
            raise ConfigError(
                f"config file {env_file} (from {ENV_PREFIX}CONFIG) does not exist; "
                "point it at an existing TOML file or unset it"
            )
        return BelayerConfig(**overrides)
    except ValidationError as exc:
        raise ConfigError(describe_validation_error(exc)) from None
    except ValueError as exc:  # malformed TOML or an env value that is not JSON
        raise ConfigError(f"invalid configuration: {exc}") from None
    finally:
        _explicit_config_file = None


def describe_validation_error(exc: ValidationError) -> str:
    """One line per bad field: its dotted name, its env variable, what is wrong, the fix."""
    lines = ["invalid configuration:"]
    for error in exc.errors():
        path = [str(p) for p in error["loc"]]
        dotted = ".".join(path)
        env_name = ENV_PREFIX + "__".join(p.upper() for p in path)
        hint = _field_description(path)
        if error["type"] == "extra_forbidden":
            fix = "remove it (unknown setting); `belayer config show` lists the valid ones"
        else:
            fix = f"set {env_name} or `{dotted}` in the config file to a valid value"
            if hint:
                fix += f" ({hint})"
        lines.append(f"  {dotted}: {error['msg']} (got {error.get('input')!r}); fix: {fix}")
    return "\n".join(lines)


def _field_description(path: list[str]) -> str | None:
    model: type[BaseModel] | None = BelayerConfig
    description = None
    for name in path:
        if model is None or name not in model.model_fields:
            return None
        field = model.model_fields[name]
        description = field.description
        annotation = field.annotation
        model = annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None
    return description


def masked_dump(config: BelayerConfig) -> dict[str, Any]:
    """The configuration as plain data with every secret replaced by '***'."""
    return plain_dump(config, reveal_secrets=False)


def plain_dump(config: BelayerConfig, *, reveal_secrets: bool) -> dict[str, Any]:
    """The configuration as plain data, unset (None) values left out (TOML has no null).

    Every `SecretStr` field is masked, or revealed for the owner-only file the workers
    read, so a secret added to any section is handled without naming it here.
    """

    def plain(value: Any) -> Any:
        if isinstance(value, SecretStr):
            if reveal_secrets:
                return value.get_secret_value()
            return "***" if value.get_secret_value() else ""
        if isinstance(value, BaseModel):
            fields = ((name, plain(getattr(value, name))) for name in type(value).model_fields)
            return {name: field for name, field in fields if field is not None}
        if isinstance(value, Path):
            return str(value)
        return value

    return plain(config)
