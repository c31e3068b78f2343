"""Storage settings: where checkpoints, token logs and observations live."""

from pydantic import Field, SecretStr

from belayer.section import Section


class StorageConfig(Section):
    """An S3-compatible endpoint (SeaweedFS locally; MinIO or AWS S3 in production)."""

    endpoint: str = Field(
        "http://127.0.0.1:8333",
        description="S3 endpoint URL; empty for AWS S3's regional default endpoint.",
    )
    bucket: str = Field("belayer", min_length=3, max_length=63, description="Bucket for all objects.")
    region: str = Field("us-east-1", description="Region name sent to the endpoint.")
    access_key: SecretStr = Field(
        SecretStr("belayer"), description="Access key id; the local SeaweedFS enforces it."
    )
    secret_key: SecretStr = Field(SecretStr("belayer-local-secret"), description="Secret access key.")
    key_prefix: str = Field("", description="Prefix put before every key, e.g. 'team-a/'.")
    encryption_key: SecretStr = Field(
        SecretStr(""),
        description="32-byte key (base64 or hex) encrypting checkpoint archives at rest (AES-256-GCM, "
        "belayer/storage/encryption.py); empty: not encrypted. Never logged.",
    )
    part_size_mb: int = Field(
        16, ge=5, le=512, description="Multipart part size in MiB; S3 requires at least 5."
    )
    max_attempts: int = Field(
        8,
        ge=1,
        le=20,
        description=(
            "Attempts for a transient error before giving up; at the default delays, 8 attempts "
            "wait 8-16 s in all, enough to ride out a SeaweedFS restart."
        ),
    )
    path_style: bool = Field(
        True, description="Path-style addressing; SeaweedFS and MinIO need it, AWS accepts it."
    )
    connect_timeout_s: float = Field(
        5.0, gt=0, le=300, description="Seconds to wait for a TCP connection to the endpoint."
    )
    read_timeout_s: float = Field(
        60.0, gt=0, le=3600, description="Seconds to wait for the endpoint's next bytes before retrying."
    )
    retry_base_delay_s: float = Field(
        0.2,
        ge=0,
        le=60,
        description="Backoff cap after the first transient error; doubles per attempt (equal jitter).",
    )
    retry_max_delay_s: float = Field(5.0, ge=0, le=300, description="Upper bound of one backoff delay.")
