"""The trainer worker: `trainer.train_step` on the trainer task queue, one step at a time."""
