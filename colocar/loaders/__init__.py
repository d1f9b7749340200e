"""Distributed input pipelines on the sidecars, feeding global jax.Arrays through shared memory.

`load(config, cluster, mesh)` returns an iterator of global batches; see
docs/pipelines.md. Sidecar-side modules (`host_backend`, `worker`, `sources`, `records`) import no JAX.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from colocar.errors import ProcessesDisagree

    from .config import ConfigError, PipelineConfig, load_config
    from .iterator import DataIterator, load

__all__ = ["ConfigError", "DataIterator", "PipelineConfig", "ProcessesDisagree", "load", "load_config"]


def __getattr__(name: str) -> Any:
    if name in ("load", "DataIterator"):
        from . import iterator

        return getattr(iterator, name)
    if name == "ProcessesDisagree":  # kept here too: the loaders raised it first
        from colocar.errors import ProcessesDisagree

        return ProcessesDisagree
    if name in ("ConfigError", "PipelineConfig", "load_config"):
        from . import config

        return getattr(config, name)
    raise AttributeError(f"module 'colocar.loaders' has no attribute {name!r}")
