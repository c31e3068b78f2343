"""Belayer's exception root.

Every error Belayer raises on purpose derives from `BelayerError`, and its message
names the problem and the fix (the setting to change, the command to run). Translators
per dependency (boto3, podman/CRIU, vLLM) turn foreign errors into these subclasses.
"""


class BelayerError(Exception):
    """Root of every error Belayer raises on purpose."""


class ConfigError(BelayerError):
    """The effective configuration is invalid; the message names field and fix."""


class StackError(BelayerError):
    """A local service failed to install, start or answer."""
