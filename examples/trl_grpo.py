"""TRL's GRPOTrainer on the project's tiny model, with Belayer as its rollout backend.

    .venv/bin/belayer up                                   # the local stack
    .venv/bin/python examples/trl_grpo.py --max-steps 4
    .venv/bin/python examples/trl_grpo.py --max-steps 4 --chaos engine-crash@iteration=1 --json

TRL computes the loss and takes each optimizer step on the CPU; Belayer runs each step's
groups of multi-turn rollouts of the learn tasks in real sandboxes and serves every new
version of the weights (belayer/integrations/trl.py). `--chaos` takes `belayer train`'s
plan syntax (`KIND@iteration=K`, an iteration being one TRL optimizer step): the fault
hits a rollout of step K once it has run an action, and Belayer recovers it, so the
final weights equal the fault-free run's. `--json` prints
`{"steps": [{"step", "mean_reward", "weights_sha256"}], "final_weights_sha256", "faults"}`.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LEARN = ROOT / "examples/workloads/learn.yaml"


def arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "workload", nargs="?", type=Path, default=LEARN, help="tasks to train on (default: the learn tasks)"
    )
    parser.add_argument("--max-steps", type=int, default=4, help="TRL optimizer steps (default 4)")
    parser.add_argument("--tasks-per-step", type=int, default=2, help="groups per step (default 2)")
    parser.add_argument(
        "--group-size", type=int, default=2, help="rollouts per task: TRL's num_generations (default 2)"
    )
    parser.add_argument("--lr", type=float, default=1e-4, help="learning rate (default 1e-4)")
    parser.add_argument(
        "--seed", type=int, default=0, help="TRL's seed and Belayer's sampling seed (default 0)"
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads of the step: the numbers depend on them (default 1)",
    )
    parser.add_argument(
        "--chaos", metavar="PLAN", help="faults, `belayer train`'s syntax: KIND@iteration=K[,...]"
    )
    parser.add_argument("--json", action="store_true", help="print the run as JSON")
    return parser.parse_args(argv)


def weights_sha256(model) -> str:
    """The hash of every parameter's bytes, in name order: equal weights, equal hash."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def main(argv: list[str] | None = None) -> int:
    args = arguments(argv)
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is experimental in TRL
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from belayer.chaos.rollouts import BackgroundChaos
    from belayer.config import load_config
    from belayer.integrations.trl import BelayerRollouts
    from belayer.model.build import model_path

    torch.set_num_threads(args.threads)
    config = load_config()
    built = model_path(config.rollout.model, config.cache_dir)
    model = AutoModelForCausalLM.from_pretrained(str(built), dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(built))
    rollouts = BelayerRollouts.connect(args.workload, config=config, seed=args.seed)
    steps: list[dict] = []

    class Record(TrainerCallback):
        def on_step_end(self, _args, state, control, model=None, **kwargs):
            batch = rollouts.batches[-1]
            rewards = [r.reward for r in batch]
            steps.append({"step": state.global_step, "mean_reward": sum(rewards) / len(rewards),
                          "weights_sha256": weights_sha256(model)})  # fmt: skip
            if not args.json:
                print(f"step {state.global_step}: mean reward {steps[-1]['mean_reward']:.3f}", flush=True)

    with tempfile.TemporaryDirectory(prefix="trl-grpo-") as output_dir:
        trainer = GRPOTrainer(
            model=model,
            processing_class=tokenizer,
            args=GRPOConfig(
                output_dir=output_dir,
                max_steps=args.max_steps,
                learning_rate=args.lr,
                seed=args.seed,
                per_device_train_batch_size=args.tasks_per_step * args.group_size,
                num_generations=args.group_size,
                temperature=1.0,
                beta=0.0,
                use_cpu=True,
                bf16=False,
                save_strategy="no",
                report_to=[],
                logging_steps=1,
                disable_tqdm=args.json,
            ),  # fmt: skip
            train_dataset=rollouts.dataset(),
            reward_funcs=rollouts.reward,
            rollout_func=rollouts.rollout_func,
            callbacks=[rollouts.weight_sync(), Record()],
        )
        say = None if args.json else print
        chaos = BackgroundChaos(config, args.chaos, lambda: rollouts.step, say) if args.chaos else None
        try:
            with contextlib.redirect_stdout(sys.stderr if args.json else sys.stdout):  # TRL logs to stdout
                trainer.train()
        finally:
            faults = chaos.stop() if chaos is not None else []
            rollouts.close()
    report = {"steps": steps, "final_weights_sha256": weights_sha256(model), "faults": faults}
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(f"final weights sha256 {report['final_weights_sha256']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
