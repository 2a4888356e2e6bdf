"""Core mechanism: units (flat sharded parameter groups), wrapping, collectives, hooks."""
