"""S3-compatible object storage: verified object I/O (`ObjectStore`) and token logs.

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
from belayer.storage.store import ObjectRef, ObjectStore
from belayer.storage.tokenlog import PrefixRef, TokenLog, prefix_ref, read_prefix

__all__ = [
    "CorruptObject",
    "ObjectConflict",
    "ObjectNotFound",
    "ObjectRef",
    "ObjectStore",
    "PermanentStorageError",
    "PrefixRef",
    "StorageConfig",
    "StorageError",
    "TokenLog",
    "TransientStorageError",
    "prefix_ref",
    "read_prefix",
]
