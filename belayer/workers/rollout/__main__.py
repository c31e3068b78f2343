"""`python -m belayer.workers.rollout`: one rollout node (owner, leader, shadow) + its worker."""

import os
import sys

from belayer.workers.rollout.worker import banner, node_id_claimed, serve
from belayer.workers.runner import main

code = main(serve, banner, hold=node_id_claimed)
sys.stdout.flush()
sys.stderr.flush()
# The node is closed by now; skip the interpreter's finalization, where a Temporal
# client can abort (exit 134; docs/design.md §7) and hide a refusal's exit status.
os._exit(code)
