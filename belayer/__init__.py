"""Belayer: keeps LLM agentic RL training alive through failures.

The rollout API for a trainer Belayer does not own: `from belayer import RolloutClient,
Rollout` (belayer/rollouts.py). They are loaded on first use, so that importing any part
of the package (a worker, a command) does not pay for the Temporal client and the store.
"""

import importlib

__all__ = ["Rollout", "RolloutClient"]
_API_MODULE = "belayer.rollouts"


def __getattr__(name: str):
    if name in __all__:
        return getattr(importlib.import_module(_API_MODULE), name)
    raise AttributeError(f"module 'belayer' has no attribute {name!r}")
