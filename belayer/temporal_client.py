"""The one way Belayer connects to Temporal: pydantic payloads, one namespace setting."""

from __future__ import annotations

from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter

from belayer.config import TemporalConfig
from belayer.errors import BelayerError


class TemporalUnreachable(BelayerError):
    """No Temporal frontend answers at the configured address."""


async def connect(cfg: TemporalConfig) -> Client:
    """A client for `cfg`, or `TemporalUnreachable` naming the address and the fix."""
    try:
        return await Client.connect(
            cfg.address, namespace=cfg.namespace, data_converter=pydantic_data_converter
        )
    except Exception as exc:  # the SDK raises plain RuntimeError for connection failures
        raise TemporalUnreachable(
            f"cannot reach Temporal at {cfg.address} ({exc}); start the local stack with "
            "`belayer up`, or point BELAYER_TEMPORAL__ADDRESS at your Temporal cluster"
        ) from None
