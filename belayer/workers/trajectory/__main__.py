"""`python -m belayer.workers.trajectory`: the workflow worker.

Serves `TrajectoryWorkflow`, `TrajectoryGroupWorkflow`, `TrainingWorkflow` (and the
`NestedGroupWorkflow`s of its large iterations), the rollout API's `RolloutWorkflow`,
`PublishWorkflow` and `ServedVersionsWorkflow`, `belayer serve`'s `AgentSessionWorkflow`, the context (tokenizer) activities, and the
training runs' iteration log, task draws and stored samples on the workflow task queue.
Deterministic workflow code only runs here; every side effect is an activity.
"""

import sys

from belayer.activities.batches import BatchActivities
from belayer.activities.context import ContextActivities
from belayer.activities.training_log import TrainingLogActivities
from belayer.config import BelayerConfig
from belayer.model.build import model_path
from belayer.storage.store import open_store
from belayer.workers.runner import main, run_worker
from belayer.workflows.groups import TrajectoryGroupWorkflow
from belayer.workflows.publishing import PublishWorkflow, ServedVersionsWorkflow
from belayer.workflows.rollouts import NestedGroupWorkflow, RolloutWorkflow
from belayer.workflows.session import AgentSessionWorkflow
from belayer.workflows.training import TrainingWorkflow
from belayer.workflows.trajectory import TrajectoryWorkflow


async def serve(config: BelayerConfig) -> None:
    tokenizer = model_path(config.rollout.model, config.cache_dir) / "tokenizer.json"
    store = open_store(config.storage)
    context = ContextActivities(store, tokenizer)
    await run_worker(
        config.temporal,
        encryption_key=config.storage.encryption_key,
        role="trajectory",
        task_queues=[config.temporal.workflow_task_queue],
        workflows=[
            TrajectoryWorkflow,
            TrajectoryGroupWorkflow,
            TrainingWorkflow,
            RolloutWorkflow,
            NestedGroupWorkflow,
            PublishWorkflow,
            ServedVersionsWorkflow,
            AgentSessionWorkflow,
        ],
        activities=[*context.all(), *TrainingLogActivities(store).all(), *BatchActivities(store).all()],
    )


def banner(config: BelayerConfig) -> str:
    return f"belayer trajectory worker: serving {config.temporal.workflow_task_queue}"


sys.exit(main(serve, banner))
