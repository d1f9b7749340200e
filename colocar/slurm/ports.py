"""The ports of a job on a node: its sidecar's (or its pool node's), a pool agent's, the JAX
coordinator's.

Several jobs may share a node (and in a test, several "nodes" share one machine), so a port
comes from the job id and the node: a job's slot of 8 ports in 20000-31999, below Linux's
ephemeral range. A port another process holds is skipped for the next candidate (the job's
directory publishes the one bound, so nobody has to guess). The JAX coordinator's port is
the one JAX's own Slurm detection picks, moved by one per trainer restart so that a restarted
coordinator never meets a stale client of the last.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator

SIDECAR_BASE = 20000
SLOTS = 1500  # job slots of PER_JOB ports: 20000-31999
PER_JOB = 8
JAX_PORTS = 1 << 12  # JAX: SLURM_JOB_ID % 2**12 + (65535 - 2**12 + 1)
JAX_BASE = 65535 - JAX_PORTS + 1


def sidecar_ports(job_id: int, node_id: int, tries: int = 16) -> Iterator[int]:
    """Candidate sidecar ports for this job's node, the derived one first."""
    for k in range(tries):
        slot = (job_id + 7919 * k) % SLOTS  # another slot per retry (7919: prime, co-prime to SLOTS)
        yield SIDECAR_BASE + slot * PER_JOB + node_id % PER_JOB


def agent_ports(job_id: int, tries: int = 16) -> Iterator[int]:
    """Candidate ports of a shared pool's agent (`colocar slurm pool-task`, on the first node):
    the last port of the job's slot, which a node of a job of fewer than 8 nodes never takes."""
    return sidecar_ports(job_id, PER_JOB - 1, tries)


def is_free(port: int) -> bool:
    """True if nothing on this machine holds `port` (a sidecar binds every interface)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


def jax_coordinator_port(job_id: int, generation: int = 0) -> int:
    """JAX's Slurm coordinator port for the job (generation 0), one further per restart."""
    return JAX_BASE + (job_id + generation) % JAX_PORTS
