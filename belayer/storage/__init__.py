"""S3-compatible object storage: verified object I/O (`ObjectStore`,
opened from the configuration by `open_store`, the one way to open it), token logs with
their model/environment marks, and each generated turn's logprobs and weights versions.

Everything that talks to S3 lives in this package; nothing else imports boto3.
"""

from belayer.storage.config import StorageConfig
from belayer.storage.errors import (
    CorruptObject,
    ObjectConflict,
    ObjectNotFound,
    PermanentStorageError,
    StorageError,
    TransientStorageError,
)
from belayer.storage.generation import GenerationRef, read_generation
from belayer.storage.store import ObjectRef, ObjectStore, open_store
from belayer.storage.tokenlog import PrefixRef, Span, TokenLog, loss_mask, prefix_ref, read_marks, read_prefix

__all__ = [
    "CorruptObject",
    "GenerationRef",
    "ObjectConflict",
    "ObjectNotFound",
    "ObjectRef",
    "ObjectStore",
    "PermanentStorageError",
    "PrefixRef",
    "Span",
    "StorageConfig",
    "StorageError",
    "TokenLog",
    "TransientStorageError",
    "loss_mask",
    "open_store",
    "prefix_ref",
    "read_generation",
    "read_marks",
    "read_prefix",
]
