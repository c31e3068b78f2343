"""The trainer side of the GRPO loop: samples read from token logs, a torch policy, the
optimizer step, and write-once checkpoints in the object store."""
