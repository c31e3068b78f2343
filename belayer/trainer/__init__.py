"""The trainer side of the training loop: samples read from token logs, a torch policy, the
optimizer step, and write-once checkpoints in the object store."""
