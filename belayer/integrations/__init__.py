"""Belayer as the rollout backend of trainers people already use (`belayer.integrations.trl`)."""
