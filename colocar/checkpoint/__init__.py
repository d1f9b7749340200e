"""Async checkpoints written by the sidecars with tensorstore (see issue 4)."""
