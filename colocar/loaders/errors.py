"""The loaders' error, in a module of its own: the controller raises and catches it without
importing the sidecar-side pump and what it imports."""

from __future__ import annotations


class PipelineError(RuntimeError):
    """A record transform failed, a worker died, or the ring starved; names batch and host."""
