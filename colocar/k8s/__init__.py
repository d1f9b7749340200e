"""Kubernetes deployment: manifests with the colocar sidecar as a native sidecar container.

`colocar k8s render --topology T --image I --bucket gs://B/P` (see `cli.py`) prints a JobSet,
its headless Service, a NetworkPolicy and a Workload Identity ServiceAccount; with `--pool`,
a shared sidecar pool that outlives jobs. Runs on the user's machine, never in a job. Modules:
`topologies` (slice shapes, plain data), `options` (input validation), `pod` (the host pod),
`render` (the objects and their YAML), and `pool/` (the same for a pool: its inputs and tenants
file `pool/options.py`, its node and agent pods `pool/pods.py`, its objects `pool/render.py`).
"""

from .options import RenderError, RenderOptions, build_options
from .render import render, to_yaml
from .topologies import TOPOLOGIES, Topology

__all__ = ["TOPOLOGIES", "RenderError", "RenderOptions", "Topology", "build_options", "render", "to_yaml"]
