"""What a Temporal server and an object store need before Belayer's workers use them.

The local stack (`belayer up`) does this itself. A deployment that brings its own
Temporal cluster and S3 (MinIO, AWS) runs `belayer prepare` once, from any machine that
reaches both, as the compose file and the Kubernetes job do: it is idempotent, so it
also runs safely on every deploy.

* Search attributes: the workflows set `BelayerTask`, `BelayerStatus`, `BelayerRun`
  and `BelayerIteration`, and Temporal refuses to start a workflow that sets an
  unregistered one; registered, they let the web UI filter trajectories and runs.
* The bucket: Belayer never relies on an object store creating buckets on first write
  (SeaweedFS runs with that off, S3 does not do it), so it is created here when missing.
"""

from __future__ import annotations

from temporalio.api.enums.v1 import IndexedValueType
from temporalio.api.operatorservice.v1 import AddSearchAttributesRequest, ListSearchAttributesRequest
from temporalio.client import Client

from belayer.config import TemporalConfig
from belayer.storage.config import StorageConfig
from belayer.storage.s3client import make_s3_client

# Each search attribute the workflows set, with its Temporal type.
SEARCH_ATTRIBUTES = {
    "BelayerTask": "Keyword",
    "BelayerStatus": "Keyword",
    "BelayerRun": "Keyword",
    "BelayerIteration": "Int",
}


async def add_missing_search_attributes(cfg: TemporalConfig) -> list[str]:
    """Register the search attributes the namespace lacks; returns their names."""

    # A bare client on purpose: these calls carry no payloads, so no payload key is needed.
    client = await Client.connect(cfg.address, namespace=cfg.namespace)
    listed = await client.operator_service.list_search_attributes(
        ListSearchAttributesRequest(namespace=cfg.namespace)
    )
    missing = {
        key: IndexedValueType.Value(f"INDEXED_VALUE_TYPE_{kind.upper()}")
        for key, kind in SEARCH_ATTRIBUTES.items()
        if key not in listed.custom_attributes
    }
    if missing:
        await client.operator_service.add_search_attributes(
            AddSearchAttributesRequest(namespace=cfg.namespace, search_attributes=missing)
        )
    return sorted(missing)


def create_bucket_if_missing(cfg: StorageConfig) -> bool:
    """Create the configured bucket when the store does not list it; True if created."""

    client = make_s3_client(cfg)
    names = [b["Name"] for b in client.list_buckets().get("Buckets", [])]
    if cfg.bucket in names:
        return False
    client.create_bucket(Bucket=cfg.bucket)
    return True
