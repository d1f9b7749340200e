"""Accelerator topologies for `colocar k8s render`, as plain data.

One entry per slice shape: which GKE nodes it needs (node selectors, taints to tolerate), how
many hosts (pods) a slice has and how many chips each host's trainer requests, plus sidecar
defaults sized for that machine type (a share of its CPUs and memory). Adding a topology is
adding an entry here; nothing else in the renderer knows about accelerators.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

TPU_TOLERATION = {"key": "google.com/tpu", "operator": "Exists", "effect": "NoSchedule"}
GPU_TOLERATION = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}


@dataclass(frozen=True)
class Topology:
    """A slice: `hosts` pods, each on its own node, each trainer holding `chips_per_host` chips."""

    name: str
    description: str
    machine_type: str  # GKE machine type of one host (documentation; the selectors pick it)
    resource: str  # extended resource the trainer requests: google.com/tpu or nvidia.com/gpu
    hosts: int
    chips_per_host: int
    node_selector: dict[str, str]
    tolerations: list[dict[str, Any]]
    # One slice is one node pool on GKE: JobSet then places one slice per pool, never two.
    exclusive_node_pool: bool
    # Sidecar defaults: the arena volume's sizeLimit, CPU cores, memory beyond the arena.
    shm_gib: int
    sidecar_cpu: int
    sidecar_memory_gib: int
    jax_coordinator: bool = field(default=False)  # GPU multi-host: JAX needs the address given

    @property
    def chips(self) -> int:
        return self.hosts * self.chips_per_host


def _tpu(
    name: str, accelerator: str, topology: str, machine: str, hosts: int, shm: int, cpu: int, mem: int
) -> Topology:
    return Topology(
        name=name,
        description=f"TPU {name}: {hosts} host(s) x 4 chips, {machine}, topology {topology}",
        machine_type=machine,
        resource="google.com/tpu",
        hosts=hosts,
        chips_per_host=4,
        node_selector={
            "cloud.google.com/gke-tpu-accelerator": accelerator,
            "cloud.google.com/gke-tpu-topology": topology,
        },
        tolerations=[TPU_TOLERATION],
        exclusive_node_pool=True,
        shm_gib=shm,
        sidecar_cpu=cpu,
        sidecar_memory_gib=mem,
    )


def _a3(name: str, hosts: int) -> Topology:
    return Topology(
        name=name,
        description=f"GPU {name}: {hosts} node(s) x 8 NVIDIA H100 80GB, a3-highgpu-8g",
        machine_type="a3-highgpu-8g",
        resource="nvidia.com/gpu",
        hosts=hosts,
        chips_per_host=8,
        node_selector={"cloud.google.com/gke-accelerator": "nvidia-h100-80gb"},
        tolerations=[GPU_TOLERATION],
        exclusive_node_pool=False,
        shm_gib=128,
        sidecar_cpu=16,
        sidecar_memory_gib=16,
        jax_coordinator=hosts > 1,
    )


TOPOLOGIES: dict[str, Topology] = {
    t.name: t
    for t in (
        # ct5lp-hightpu-4t: 112 vCPUs, 192 GB per host.
        _tpu("v5e-16", "tpu-v5-lite-podslice", "4x4", "ct5lp-hightpu-4t", 4, shm=32, cpu=8, mem=8),
        # ct6e-standard-4t: 180 vCPUs, 720 GB per host.
        _tpu("v6e-64", "tpu-v6e-slice", "8x8", "ct6e-standard-4t", 16, shm=64, cpu=16, mem=16),
        # ct5p-hightpu-4t: 208 vCPUs, 448 GB per host.
        _tpu("v5p-8", "tpu-v5p-slice", "2x2x1", "ct5p-hightpu-4t", 1, shm=64, cpu=16, mem=16),
        # a3-highgpu-8g: 208 vCPUs, 1872 GB per node.
        _a3("a3-8", 1),
        _a3("a3-16", 2),
    )
}
