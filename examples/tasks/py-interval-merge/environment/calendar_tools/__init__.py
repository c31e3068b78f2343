"""Small helpers for working with time ranges."""
