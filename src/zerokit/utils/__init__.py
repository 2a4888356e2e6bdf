"""Helpers for users' scripts (DeepSpeed's names)."""
