"""`ObjectStore`: verified, retried, bounded-memory object I/O over any S3 endpoint.

Every object written here carries its sha256 and size, and every read checks them: a
corrupt or truncated object raises `CorruptObject`, it is never returned.

Where the hash lives:
- single-request objects (`put_bytes`, and streams no longer than one part): in the
  object's own metadata, `x-amz-meta-sha256` and `x-amz-meta-size`.
- multipart objects: S3 fixes metadata at CreateMultipartUpload, before a stream's hash
  is known, and we do not want to read a stream twice (checkpoint archives arrive on a
  pipe). So the object's metadata carries `x-amz-meta-sha256-record: <nonce>`, and the
  hash lives in a small *hash record* object `<key_prefix>.belayer-records/<key>@<nonce>.json`
  written after the last part and *before* CompleteMultipartUpload. The object only
  becomes visible at Complete, so a reader never sees a multipart object without its
  record; the per-upload nonce means a record always describes exactly the upload
  that wrote the object (an overwrite points to its own record).

Create-if-absent is S3's conditional write (`If-None-Match: *` on PutObject and on
CompleteMultipartUpload); SeaweedFS 4.48 honours both (tests/storage pins this). A
conflict whose existing object has the same sha256 is the caller's own earlier write
(a retry) and counts as success; a different object raises `ObjectConflict`.

No botocore exception leaves this module: `errors.translate_error` maps them, and
`retry.RetryPolicy` retries only the transient ones.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import UTC, datetime
from typing import Any, BinaryIO, TypeVar

from pydantic import BaseModel, ConfigDict, Field

from belayer.storage.config import StorageConfig
from belayer.storage.encryption import archive_store
from belayer.storage.errors import (
    CorruptObject,
    ObjectConflict,
    ObjectNotFound,
    PermanentStorageError,
    StorageError,
    TransientStorageError,
    translate_error,
)
from belayer.storage.retry import RetryPolicy
from belayer.storage.s3client import make_s3_client

log = logging.getLogger(__name__)
T = TypeVar("T")

META_SHA256 = "sha256"
META_SIZE = "size"
META_RECORD = "sha256-record"
RECORD_ROOT = ".belayer-records/"
MAX_PARTS = 10_000
DOWNLOAD_CHUNK = 1 << 20
Progress = Callable[[int], None]
_SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")
_METADATA_NAME = re.compile(r"^[a-z0-9][a-z0-9-]{0,63}$")
_RESERVED_METADATA = frozenset({META_SHA256, META_SIZE, META_RECORD})


class ObjectRef(BaseModel):
    """What a caller keeps of an object: its key (without `key_prefix`), size and sha256."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    key: str = Field(description="Key relative to the store's key_prefix.")
    size: int = Field(ge=0, description="Size in bytes.")
    sha256: str = Field(pattern=_SHA256_HEX.pattern, description="Hex sha256 of the bytes.")


class ObjectStore:
    """Objects under `cfg.key_prefix` in `cfg.bucket`. Thread-safe (one boto3 client)."""

    def __init__(self, cfg: StorageConfig, *, client: Any = None, retry: RetryPolicy | None = None):
        self.cfg = cfg
        self.client = client if client is not None else make_s3_client(cfg)
        self.retry = retry or RetryPolicy(
            max_attempts=cfg.max_attempts,
            base_delay_s=cfg.retry_base_delay_s,
            max_delay_s=cfg.retry_max_delay_s,
        )
        self.part_size = cfg.part_size_mb << 20

    def check(self) -> None:
        """One cheap request that fails like real work would on a wrong endpoint, bucket or
        credentials (a HEAD cannot tell a missing bucket from a missing key)."""
        self._call(
            "check",
            None,
            lambda: self.client.list_objects_v2(
                Bucket=self.cfg.bucket, Prefix=self.cfg.key_prefix, MaxKeys=1
            ),
        )

    def close(self) -> None:
        self.client.close()

    def __enter__(self) -> ObjectStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- small objects ---------------------------------------------------------------

    def put_bytes(
        self, key: str, data: bytes, *, if_absent: bool = False, metadata: Mapping[str, str] | None = None
    ) -> ObjectRef:
        """Write `data` at `key` in one request; with `if_absent`, never replace another object.

        `metadata` (lowercase names, short ASCII values) is stored with the object in the
        same request, so it can never be seen without the bytes or the bytes without it;
        `head_metadata` reads it back. A create-if-absent write counts as the caller's own
        earlier write only when both the bytes and the metadata match.
        """
        data = bytes(data)
        caller = _caller_metadata(key, metadata)
        ref = ObjectRef(key=key, size=len(data), sha256=hashlib.sha256(data).hexdigest())
        args: dict[str, Any] = dict(
            Bucket=self.cfg.bucket,
            Key=self._full(key),
            Body=data,
            Metadata={**caller, META_SHA256: ref.sha256, META_SIZE: str(ref.size)},
        )
        if if_absent:
            args["IfNoneMatch"] = "*"
        try:
            self._call("put", key, lambda: self.client.put_object(**args))
        except ObjectConflict:
            return self._settle_conflict(ref, caller)
        return ref

    def get_bytes(self, key: str, *, expected_sha256: str | None = None) -> bytes:
        """The whole object, after checking size and sha256 (recorded, and `expected_sha256`)."""
        return self.get_bytes_and_metadata(key, expected_sha256=expected_sha256)[0]

    def get_bytes_and_metadata(
        self, key: str, *, expected_sha256: str | None = None
    ) -> tuple[bytes, dict[str, str]]:
        """`get_bytes`, and the metadata the object was written with (as `head_metadata`
        gives it), from the same single request: the two belong to one version of the object."""

        def fetch() -> tuple[dict, bytes]:
            resp = self.client.get_object(Bucket=self.cfg.bucket, Key=self._full(key))
            return resp, resp["Body"].read()

        resp, data = self._call("get", key, fetch)
        size, sha = self._expected(key, resp, expected_sha256)
        _verify(key, len(data), hashlib.sha256(data).hexdigest(), size, sha)
        return data, _caller_metadata_of(resp)

    # ---- streams ---------------------------------------------------------------------

    def upload_stream(
        self,
        key: str,
        source: BinaryIO | Iterable[bytes],
        *,
        if_absent: bool = False,
        progress: Progress | None = None,
    ) -> ObjectRef:
        """Stream `source` (a binary file or an iterable of bytes) to `key`, hashing on the way.

        At most two parts are in memory: one uploading, the next being read. A stream
        that fits in one part is written with a single PUT. `progress(bytes_done)` is
        called after each part (what an activity heartbeats). A failed multipart upload is
        aborted; if even the abort fails (endpoint down), the error says so and
        `abort_incomplete_uploads` removes the leftover parts later.
        """
        parts = _parts(source, self.part_size)
        head = [next(parts, b""), next(parts, None)]
        if head[1] is None:
            ref = self.put_bytes(key, head[0], if_absent=if_absent)
            if progress:
                progress(ref.size)
            return ref
        return self._multipart(key, _chain(head, parts), if_absent=if_absent, progress=progress)

    def download_stream(
        self,
        key: str,
        dest: BinaryIO,
        *,
        expected_sha256: str | None = None,
        progress: Progress | None = None,
    ) -> ObjectRef:
        """Write the object into `dest` in chunks; `CorruptObject` if it fails verification.

        On `CorruptObject` the bytes already written to `dest` must be discarded.
        """
        done = 0
        stream = self.iter_download(key, expected_sha256=expected_sha256)
        try:
            while True:
                chunk = next(stream)
                dest.write(chunk)
                done += len(chunk)
                if progress:
                    progress(done)
        except StopIteration as stop:
            return stop.value
        finally:
            stream.close()  # releases the HTTP connection when `dest` failed

    def iter_download(
        self, key: str, *, expected_sha256: str | None = None, chunk_size: int = DOWNLOAD_CHUNK
    ) -> Iterator[bytes]:
        """The object's bytes in chunks of at most `chunk_size`; the generator's return value
        is its `ObjectRef`.

        The size and sha256 are checked when the last chunk has been read: the iterator
        raises `CorruptObject` instead of finishing when they do not match, so the data
        it yielded counts only once it is exhausted. A dropped connection resumes with a
        ranged GET pinned to the same ETag.
        """
        hasher = hashlib.sha256()
        got = 0
        attempt = 1
        etag: str | None = None
        expected: tuple[int, str] | None = None
        body = None
        while True:
            try:
                if body is None:
                    resp = self._open_body(key, got, etag)
                    if etag is None:
                        etag = resp.get("ETag")
                        expected = self._expected(key, resp, expected_sha256)
                    body = resp["Body"]
                for chunk in body.iter_chunks(chunk_size):
                    hasher.update(chunk)
                    got += len(chunk)
                    yield chunk
                break
            except StorageError:
                raise
            except Exception as exc:
                error = self._translate(exc, "download", key)
                body = None
                if expected is not None and got >= expected[0] and isinstance(error, TransientStorageError):
                    break  # every recorded byte arrived; what failed came after them
                if not isinstance(error, TransientStorageError) or attempt >= self.retry.max_attempts:
                    raise error from exc
                log.info("download %r: resuming at byte %d (attempt %d): %s", key, got, attempt + 1, error)
                self.retry.sleep(self.retry.delay(attempt))
                attempt += 1
        assert expected is not None
        _verify(key, got, hasher.hexdigest(), *expected)
        return ObjectRef(key=key, size=got, sha256=expected[1])

    # ---- metadata, listing, deletion ---------------------------------------------------

    def head(self, key: str) -> ObjectRef:
        """Size and recorded sha256 without reading the bytes; `CorruptObject` if unrecorded."""
        return self.head_metadata(key)[0]

    def head_metadata(self, key: str) -> tuple[ObjectRef, dict[str, str]]:
        """`head`, and the metadata the object was written with (`put_bytes(metadata=...)`;
        empty when none), in the same single request."""
        resp = self._call(
            "head", key, lambda: self.client.head_object(Bucket=self.cfg.bucket, Key=self._full(key))
        )
        recorded = self._record(key, resp)
        if recorded is None:
            raise CorruptObject(
                f"{key!r} has no recorded sha256: it was not written through Belayer's ObjectStore"
            )
        return ObjectRef(key=key, size=recorded[0], sha256=recorded[1]), _caller_metadata_of(resp)

    def exists(self, key: str) -> bool:
        try:
            self._call(
                "head", key, lambda: self.client.head_object(Bucket=self.cfg.bucket, Key=self._full(key))
            )
        except ObjectNotFound:
            return False
        return True

    def list(self, prefix: str = "") -> Iterator[str]:
        """Keys (relative to `key_prefix`) starting with `prefix`, in lexicographic order."""
        for full_key in self._list_full(self._full(prefix, check=False)):
            key = full_key[len(self.cfg.key_prefix) :]
            if not key.startswith(RECORD_ROOT):
                yield key

    def delete(self, key: str) -> None:
        """Remove `key` and its hash record; deleting a missing key is not an error."""
        try:
            resp = self._call(
                "head", key, lambda: self.client.head_object(Bucket=self.cfg.bucket, Key=self._full(key))
            )
        except ObjectNotFound:
            return
        self._call(
            "delete", key, lambda: self.client.delete_object(Bucket=self.cfg.bucket, Key=self._full(key))
        )
        nonce = resp.get("Metadata", {}).get(META_RECORD)
        if nonce:
            self._delete_record(key, nonce)

    def delete_prefix(self, prefix: str) -> int:
        """Remove every object whose key starts with `prefix` (and their hash records).

        Returns how many objects (not counting records) were deleted.
        """
        if not prefix and not self.cfg.key_prefix:
            raise ValueError(
                "delete_prefix('') with an empty key_prefix would empty the whole bucket; refusing"
            )
        deleted = self._delete_full_keys(
            k for k in self._list_full(self._full(prefix, check=False)) if not self._is_record(k)
        )
        self._delete_full_keys(self._list_full(self.cfg.key_prefix + RECORD_ROOT + prefix))
        return deleted

    def abort_incomplete_uploads(self, prefix: str = "", *, older_than_s: float = 0.0) -> int:
        """Abort multipart uploads under `prefix` left by crashed writers; returns how many.

        Only uploads started more than `older_than_s` seconds ago (by the endpoint's
        clock) are touched; with the default 0 every upload goes, live ones included, so
        pass a bound longer than any upload when writers may be active.
        """
        full_prefix = self._full(prefix, check=False)
        aborted = 0
        markers: dict[str, str] = {}
        while True:
            page = self._call(
                "list-uploads",
                prefix,
                lambda markers=markers: self.client.list_multipart_uploads(
                    Bucket=self.cfg.bucket, Prefix=full_prefix, **markers
                ),
            )
            now = datetime.now(UTC)
            for upload in page.get("Uploads", []):
                initiated = upload.get("Initiated")
                if older_than_s and initiated and (now - initiated).total_seconds() < older_than_s:
                    continue
                self._abort(upload["Key"], upload["UploadId"])
                aborted += 1
            if not page.get("IsTruncated"):
                return aborted
            markers = {"KeyMarker": page["NextKeyMarker"], "UploadIdMarker": page["NextUploadIdMarker"]}

    # ---- multipart internals -----------------------------------------------------------

    def _multipart(
        self, key: str, parts: Iterator[bytearray], *, if_absent: bool, progress: Progress | None
    ) -> ObjectRef:
        nonce = uuid.uuid4().hex
        replaced = None if if_absent else self._record_nonce_of(key)
        created = self._call(
            "create-multipart",
            key,
            lambda: self.client.create_multipart_upload(
                Bucket=self.cfg.bucket, Key=self._full(key), Metadata={META_RECORD: nonce}
            ),
        )
        upload_id = created["UploadId"]
        record_written = completing = False
        try:
            etags, size, sha = self._upload_parts(key, upload_id, parts, progress)
            ref = ObjectRef(key=key, size=size, sha256=sha)
            self._write_record(ref, nonce)
            record_written = completing = True
            outcome = self._complete(key, upload_id, etags, nonce, if_absent=if_absent)
        except BaseException as exc:
            self._abort_after_failure(key, upload_id, exc)
            # A Complete that failed on our side may still have succeeded on the server;
            # then the object points at this record, so it stays (a leak at worst).
            if record_written and not completing:
                self._delete_record(key, nonce, quiet=True)
            raise
        if outcome == "conflict":
            self._delete_record(key, nonce, quiet=True)
            return self._settle_conflict(ref, {})
        if replaced and replaced != nonce:
            self._delete_record(key, replaced, quiet=True)
        return ref

    def _upload_parts(
        self, key: str, upload_id: str, parts: Iterator[bytearray], progress: Progress | None
    ) -> tuple[list[dict], int, str]:
        """Upload parts one at a time while the next one is read and hashed."""
        hasher = hashlib.sha256()
        etags: list[dict] = []
        size = 0
        pending: Future | None = None
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="belayer-upload") as pool:
            try:
                for number, part in enumerate(parts, start=1):
                    if number > MAX_PARTS:
                        raise PermanentStorageError(
                            f"upload {key!r}: more than {MAX_PARTS} parts of {self.cfg.part_size_mb} MiB; "
                            "raise BELAYER_STORAGE__PART_SIZE_MB"
                        )
                    hasher.update(part)
                    size += len(part)
                    if pending is not None:
                        etags.append(pending.result())
                        if progress:
                            progress(size - len(part))
                    pending = pool.submit(self._upload_part, key, upload_id, number, part)
                    del part
                if pending is not None:
                    etags.append(pending.result())
                    if progress:
                        progress(size)
            finally:
                if pending is not None:
                    pending.cancel()
        return etags, size, hasher.hexdigest()

    def _upload_part(self, key: str, upload_id: str, number: int, data: bytearray) -> dict:
        resp = self._call(
            f"upload-part {number}",
            key,
            lambda: self.client.upload_part(
                Bucket=self.cfg.bucket, Key=self._full(key), UploadId=upload_id, PartNumber=number, Body=data
            ),
        )
        return {"ETag": resp["ETag"], "PartNumber": number}

    def _complete(self, key: str, upload_id: str, etags: list[dict], nonce: str, *, if_absent: bool) -> str:
        """'done', or 'conflict' when if_absent lost to another object (upload then aborted)."""
        args: dict[str, Any] = dict(
            Bucket=self.cfg.bucket, Key=self._full(key), UploadId=upload_id, MultipartUpload={"Parts": etags}
        )
        if if_absent:
            args["IfNoneMatch"] = "*"
        try:
            self._call("complete-multipart", key, lambda: self.client.complete_multipart_upload(**args))
        except ObjectConflict:
            # Our own Complete may have succeeded on an attempt whose answer was lost.
            if self._record_nonce_of(key) == nonce:
                return "done"
            self._abort(self._full(key), upload_id)
            return "conflict"
        except StorageError as exc:
            if exc.code == "NoSuchUpload" and self._record_nonce_of(key) == nonce:
                return "done"
            raise
        return "done"

    def _abort_after_failure(self, key: str, upload_id: str, cause: BaseException) -> None:
        try:
            self._abort(self._full(key), upload_id)
        except StorageError as abort_error:
            log.warning(
                "upload %r failed and its abort failed too; upload id %s left: %s",
                key,
                upload_id,
                abort_error,
            )
            cause.add_note(
                f"the multipart upload {upload_id} of {key!r} could not be aborted either; "
                "ObjectStore.abort_incomplete_uploads removes it once the endpoint answers"
            )

    def _abort(self, full_key: str, upload_id: str) -> None:
        try:
            self._call(
                "abort-multipart",
                full_key,
                lambda: self.client.abort_multipart_upload(
                    Bucket=self.cfg.bucket, Key=full_key, UploadId=upload_id
                ),
            )
        except ObjectNotFound:
            pass
        except StorageError as exc:
            if exc.code != "NoSuchUpload":  # already completed or aborted: nothing left
                raise

    # ---- hash records ------------------------------------------------------------------

    def _record_key(self, key: str, nonce: str) -> str:
        return f"{self.cfg.key_prefix}{RECORD_ROOT}{key}@{nonce}.json"

    def _write_record(self, ref: ObjectRef, nonce: str) -> None:
        body = json.dumps({"key": ref.key, "size": ref.size, "sha256": ref.sha256, "nonce": nonce}).encode()
        record_key = self._record_key(ref.key, nonce)
        self._call(
            "put-record",
            ref.key,
            lambda: self.client.put_object(Bucket=self.cfg.bucket, Key=record_key, Body=body),
        )

    def _read_record(self, key: str, nonce: str) -> tuple[int, str]:
        record_key = self._record_key(key, nonce)
        try:
            body = self._call(
                "get-record",
                key,
                lambda: self.client.get_object(Bucket=self.cfg.bucket, Key=record_key)["Body"].read(),
            )
        except ObjectNotFound:
            raise CorruptObject(
                f"{key!r}: its hash record {record_key!r} is missing, so its bytes cannot be verified"
            ) from None
        try:
            record = json.loads(body)
            size, sha = int(record["size"]), str(record["sha256"])
        except (ValueError, KeyError, TypeError):
            raise CorruptObject(f"{key!r}: its hash record {record_key!r} is unreadable") from None
        if not _SHA256_HEX.match(sha) or record.get("nonce") != nonce:
            raise CorruptObject(f"{key!r}: its hash record {record_key!r} is malformed")
        return size, sha

    def _delete_record(self, key: str, nonce: str, *, quiet: bool = False) -> None:
        record_key = self._record_key(key, nonce)
        try:
            self._call(
                "delete-record",
                key,
                lambda: self.client.delete_object(Bucket=self.cfg.bucket, Key=record_key),
            )
        except StorageError as exc:
            if not quiet:
                raise
            log.warning(
                "could not delete hash record %r (harmless, delete_prefix removes it): %s", record_key, exc
            )

    def _record_nonce_of(self, key: str) -> str | None:
        try:
            resp = self._call(
                "head", key, lambda: self.client.head_object(Bucket=self.cfg.bucket, Key=self._full(key))
            )
        except ObjectNotFound:
            return None
        return resp.get("Metadata", {}).get(META_RECORD)

    def _record(self, key: str, resp: dict) -> tuple[int, str] | None:
        """(size, sha256) recorded for the object answered in `resp`, or None if unrecorded."""
        metadata = resp.get("Metadata", {})
        if META_SHA256 in metadata:
            sha = metadata[META_SHA256]
            if not _SHA256_HEX.match(sha):
                raise CorruptObject(f"{key!r}: recorded sha256 {sha!r} is malformed")
            size = metadata.get(META_SIZE)
            return (int(size) if size and size.isdigit() else int(resp.get("ContentLength", -1))), sha
        if META_RECORD in metadata:
            return self._read_record(key, metadata[META_RECORD])
        return None

    def _expected(self, key: str, resp: dict, expected_sha256: str | None) -> tuple[int, str]:
        """The (size, sha256) the bytes of `resp` must have."""
        recorded = self._record(key, resp)
        if recorded is None:
            if expected_sha256 is None:
                raise CorruptObject(
                    f"{key!r} has no recorded sha256 (not written through Belayer's ObjectStore); "
                    "pass expected_sha256 to read it"
                )
            return int(resp.get("ContentLength", -1)), expected_sha256
        if expected_sha256 is not None and expected_sha256 != recorded[1]:
            raise CorruptObject(
                f"{key!r} holds an object with sha256 {recorded[1]}, not the expected {expected_sha256}"
            )
        return recorded

    def _settle_conflict(self, ref: ObjectRef, metadata: dict[str, str]) -> ObjectRef:
        """A create-if-absent write lost: fine if the winner has our bytes and metadata, else
        ObjectConflict."""
        try:
            existing, existing_metadata = self.head_metadata(ref.key)
        except (ObjectNotFound, CorruptObject) as exc:
            raise ObjectConflict(
                f"{ref.key!r}: create-if-absent lost, and the existing object is unusable: {exc}"
            ) from None
        if existing.sha256 == ref.sha256 and existing.size == ref.size and existing_metadata == metadata:
            return ref
        raise ObjectConflict(
            f"{ref.key!r} already holds a different object (sha256 {existing.sha256}, {existing.size} bytes, "
            f"metadata {existing_metadata}); not replaced by sha256 {ref.sha256}, metadata {metadata}"
        )

    # ---- plumbing ----------------------------------------------------------------------

    def _full(self, key: str, *, check: bool = True) -> str:
        if check:
            if not key:
                raise ValueError("object key must not be empty")
            if key.startswith(RECORD_ROOT):
                raise ValueError(f"keys under {RECORD_ROOT!r} are reserved for hash records")
        return self.cfg.key_prefix + key

    def _is_record(self, full_key: str) -> bool:
        return full_key[len(self.cfg.key_prefix) :].startswith(RECORD_ROOT)

    def _open_body(self, key: str, offset: int, etag: str | None) -> dict:
        args: dict[str, Any] = dict(Bucket=self.cfg.bucket, Key=self._full(key))
        if offset:
            args["Range"] = f"bytes={offset}-"
        if etag is not None:
            args["IfMatch"] = etag
        try:
            return self.client.get_object(**args)
        except Exception as exc:
            error = self._translate(exc, "download", key)
            if isinstance(error, ObjectConflict):
                raise TransientStorageError(
                    f"download {key!r}: the object was replaced while downloading; download it again"
                ) from exc
            raise

    def usage(self, prefix: str) -> tuple[int, int]:
        """(objects, bytes) stored under `prefix`, as the server counts them (encrypted
        objects at their stored size)."""
        objects = size = 0
        for item in self._list_items(self._full(prefix, check=False)):
            if not item["Key"][len(self.cfg.key_prefix) :].startswith(RECORD_ROOT):
                objects, size = objects + 1, size + int(item["Size"])
        return objects, size

    def _list_full(self, full_prefix: str) -> Iterator[str]:
        for item in self._list_items(full_prefix):
            yield item["Key"]

    def _list_items(self, full_prefix: str) -> Iterator[dict]:
        token: dict[str, str] = {}
        while True:
            page = self._call(
                "list",
                full_prefix,
                lambda token=token: self.client.list_objects_v2(
                    Bucket=self.cfg.bucket, Prefix=full_prefix, **token
                ),
            )
            yield from page.get("Contents", [])
            if not page.get("IsTruncated"):
                return
            token = {"ContinuationToken": page["NextContinuationToken"]}

    def _delete_full_keys(self, full_keys: Iterable[str]) -> int:
        deleted = 0
        batch: list[str] = []
        for full_key in full_keys:
            batch.append(full_key)
            if len(batch) == 1000:
                deleted += self._delete_batch(batch)
                batch = []
        if batch:
            deleted += self._delete_batch(batch)
        return deleted

    def _delete_batch(self, full_keys: list[str]) -> int:
        resp = self._call(
            "delete-objects",
            full_keys[0],
            lambda: self.client.delete_objects(
                Bucket=self.cfg.bucket, Delete={"Objects": [{"Key": k} for k in full_keys], "Quiet": True}
            ),
        )
        errors = resp.get("Errors", [])
        if errors:
            first = errors[0]
            raise PermanentStorageError(
                f"delete of {len(errors)} of {len(full_keys)} objects failed, e.g. {first.get('Key')!r}: "
                f"{first.get('Code')} {first.get('Message')}"
            )
        return len(full_keys)

    def _translate(self, exc: BaseException, operation: str, key: str | None) -> StorageError:
        return translate_error(
            exc, operation=operation, key=key, endpoint=self.cfg.endpoint, bucket=self.cfg.bucket
        )

    def _call(self, operation: str, key: str | None, fn: Callable[[], T]) -> T:
        return self.retry.call(
            fn, translate=lambda exc: self._translate(exc, operation, key), what=f"{operation} {key}"
        )


def _caller_metadata(key: str, metadata: Mapping[str, str] | None) -> dict[str, str]:
    """`metadata` as S3 stores it, refused when S3 would alter it or it would shadow the
    names this module records hashes under."""
    caller = dict(metadata or {})
    for name, value in caller.items():
        if not _METADATA_NAME.match(name) or name in _RESERVED_METADATA:
            raise ValueError(
                f"{key!r}: metadata name {name!r} must be lowercase letters, digits and '-', "
                f"and not one of {sorted(_RESERVED_METADATA)}"
            )
        if not isinstance(value, str) or not value.isascii() or len(value) > 256:
            raise ValueError(f"{key!r}: metadata {name!r} must be an ASCII string of at most 256 characters")
    return caller


def _caller_metadata_of(resp: dict) -> dict[str, str]:
    """The metadata a caller wrote with the object (`put_bytes(metadata=...)`), from a
    GET or HEAD response: the store's own hash fields left out."""
    return {k: v for k, v in resp.get("Metadata", {}).items() if k not in _RESERVED_METADATA}


def _verify(key: str, got_size: int, got_sha: str, size: int, sha: str) -> None:
    if got_size != size:
        kind = "truncated" if got_size < size else "longer than recorded"
        raise CorruptObject(f"{key!r} is {kind}: {got_size} bytes read, {size} recorded at write")
    if got_sha != sha:
        raise CorruptObject(f"{key!r} is corrupt: sha256 of its bytes is {got_sha}, {sha} recorded at write")


def _parts(source: BinaryIO | Iterable[bytes], part_size: int) -> Iterator[bytearray]:
    """`source` regrouped into parts of exactly `part_size` bytes (the last may be shorter).

    Each part is a fresh buffer filled in place, without intermediate copies, so a part
    costs its own size and nothing more while the previous one is still uploading.
    """
    if isinstance(source, (bytes, bytearray, memoryview, str)):
        raise TypeError("upload_stream takes a binary file or an iterable of bytes; use put_bytes for bytes")
    if hasattr(source, "readinto"):
        return _readinto_parts(source, part_size)
    if hasattr(source, "read"):
        return _chunk_parts(iter(lambda: source.read(DOWNLOAD_CHUNK), b""), part_size)
    return _chunk_parts(source, part_size)


def _readinto_parts(source: BinaryIO, part_size: int) -> Iterator[bytearray]:
    while True:
        part = bytearray(part_size)
        filled = 0
        with memoryview(part) as view:
            while filled < part_size:  # pipes and sockets answer short reads before EOF
                n = source.readinto(view[filled:])
                if not n:
                    break
                filled += n
        if filled < part_size:
            del part[filled:]
            if filled:
                yield part
            return
        yield part


def _chunk_parts(chunks: Iterable[bytes], part_size: int) -> Iterator[bytearray]:
    part = bytearray(part_size)
    filled = 0
    for chunk in chunks:
        with memoryview(chunk) as view:
            data = view.cast("B") if view.format != "B" or view.ndim != 1 else view
            offset = 0
            while offset < len(data):
                take = min(part_size - filled, len(data) - offset)
                part[filled : filled + take] = data[offset : offset + take]
                filled += take
                offset += take
                if filled == part_size:
                    yield part
                    part = bytearray(part_size)
                    filled = 0
    if filled:
        del part[filled:]
        yield part


def _chain(head: list[bytearray], rest: Iterator[bytearray]) -> Iterator[bytearray]:
    """`head` then `rest`, keeping no reference to a part once it is handed out."""
    while head:
        yield head.pop(0)
    yield from rest


def put_by_hash(store, prefix: str, data: bytes, suffix: str = "") -> ObjectRef:
    """`data` at `<prefix><sha256><suffix>`, create-if-absent: the same bytes are one object,
    stored once however often they are written."""
    return store.put_bytes(f"{prefix}{hashlib.sha256(data).hexdigest()}{suffix}", data, if_absent=True)


def open_store(cfg: StorageConfig, *, encrypted: bool = True) -> Any:
    """The object store `cfg` names: the one way Belayer opens it.

    `encrypted` (the default): what holds agent data (observations, step records,
    checkpoint archives) is encrypted at rest when `storage.encryption_key` is set, and
    reads back in the clear, as the workers wrote it (belayer/storage/encryption.py).
    False: the objects as they are stored, for a caller that touches only objects that are
    never encrypted (token logs, weights, a benchmark's own objects, listings); that store
    is an `ObjectStore` and closes with `with`."""
    store = ObjectStore(cfg)
    return archive_store(store, cfg.encryption_key) if encrypted else store
