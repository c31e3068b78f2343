"""`python -m belayer.workers.rollout`: one rollout node (owner, leader, shadow) + its worker."""

from __future__ import annotations

import asyncio
import logging
import os
import sys

from belayer.config import load_config


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    config = load_config()
    from belayer.workers.rollout.identity import DuplicateNodeIdError, claim_on_this_machine
    from belayer.workers.rollout.worker import node_task_queue, serve

    try:
        with claim_on_this_machine(config.rollout.node_id):  # held until the node stops
            print(
                f"belayer rollout node {config.rollout.node_id}: serving {node_task_queue(config)} "
                f"and {config.temporal.rollout_task_queue}",
                flush=True,
            )
            asyncio.run(serve(config))
    except DuplicateNodeIdError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # The node is closed by now; skip the interpreter's finalization, where a Temporal
    # client can abort (exit 134; docs/design.md §7) and hide a refusal's exit status.
    os._exit(code)
