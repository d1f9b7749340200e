"""What `colocar k8s render --pool` takes, checked before anything is rendered.

The tenants file is the one `colocar pool up --tenants` reads. It is validated here with the
pool's own parser (`colocar.pool.tenants.parse`), so a file the agent would refuse fails at
render time, and re-written so that every tenant's `token_file` is its Secret as the agent
mounts it: the tokens live in Secrets, never in the ConfigMap or in the user's file.
"""

from __future__ import annotations

import os
import re
import tempfile
from dataclasses import dataclass
from typing import Any

import yaml

from colocar.pool.tenants import TenantsFileError, parse
from colocar.protocol.tokens import write_token_file

from ..options import GiB, RenderError, check_image, check_name, check_namespace, parse_size, quantity
from ..topologies import TOPOLOGIES, Topology

POOL_SHM_PATH = "/colocar-pool/shm"  # the arena folder, at the same path in node and job pods
TENANTS_DIR = "/etc/colocar/tenants"  # the agent's mount of every tenant's Secret
CONFIG_DIR = "/etc/colocar/pool"  # the agent's mount of the tenants ConfigMap
ADMIN_DIR = "/etc/colocar/admin"
NODE_DIR = "/etc/colocar/node"  # the node token: a Secret (agent), a 0600 copy (node pods)
TENANTS_FILE = "tenants.yaml"
_TENANT_RE = re.compile(r"^[a-z0-9]([a-z0-9-]{0,48}[a-z0-9])?$")
TENANTS_HEADER = """\
# The pool's tenants (colocar k8s render --pool). Each token_file is the tenant's Secret
# <pool>-tenant-<tenant>, mounted by the agent: rotate a token by changing its Secret. Edit
# priorities and quotas here: kubelet updates the agent's copy in place (within a minute or
# so) and the agent re-reads it, without a restart.
"""


def tenant_token_path(tenant: str) -> str:
    """Where the agent reads a tenant's token: its Secret's mount (no subPath, so updated)."""
    return f"{TENANTS_DIR}/{tenant}/token"


def check_tenant_name(tenant: str) -> str:
    """A tenant name is part of Kubernetes names (its Secret, its folder in a projected volume)."""
    if not _TENANT_RE.match(tenant):
        hint = re.sub(r"[^a-z0-9-]+", "-", tenant.lower()).strip("-") or "team-a"
        raise RenderError(
            f"tenant {tenant!r}: on Kubernetes a tenant name is part of its Secret's name: use 1-50 "
            f"lowercase letters, digits and '-', starting and ending with a letter or digit (e.g. {hint!r})"
        )
    return tenant


def _entries(text: str, source: str) -> dict[str, Any]:
    """The tenants file's data, with a 'tenants:' mapping; RenderError otherwise."""
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        raise RenderError(f"--tenants {source}: not YAML: {e}") from None
    if not isinstance(data, dict) or not isinstance(data.get("tenants"), dict) or not data["tenants"]:
        raise RenderError(
            f"--tenants {source}: expected a mapping 'tenants:' of tenant names to their entries "
            "(at least one), as for colocar pool up"
        )
    return data


def _with_defaults(entries: dict[Any, Any]) -> dict[Any, Any]:
    """`alice:` with nothing under it: a tenant with the default priority and quotas (its
    token_file is rendered anyway)."""
    return {tenant: {} if entry is None else entry for tenant, entry in entries.items()}


def _validated(data: dict[str, Any], source: str, capacity: int) -> list[str]:
    """Parses `data` as the agent would (each token file made up, in a scratch folder), and
    checks that every tenant fits the pool's capacity; the tenant names, in file order."""
    with tempfile.TemporaryDirectory(prefix="colocar-k8s-") as folder:
        entries = {}
        for i, (tenant, entry) in enumerate(_with_defaults(data["tenants"]).items()):
            write_token_file(os.path.join(folder, f"{i}.token"), f"render-check-{i}")
            entries[tenant] = {**entry, "token_file": f"{i}.token"} if isinstance(entry, dict) else entry
        try:
            tenants = parse(yaml.safe_dump({**data, "tenants": entries}, sort_keys=False), folder)
        except TenantsFileError as e:
            raise RenderError(f"--tenants {source}: {e}") from None
    for t in tenants.values():
        if t.arena > capacity:
            raise RenderError(
                f"--tenants {source}: tenant {t.name!r}: its arena quota ({quantity(t.arena)}) is more "
                f"than the pool's --capacity ({quantity(capacity)} per host): it could never be served"
            )
    return list(tenants)


def rewrite_tenants(text: str, source: str, capacity: int) -> tuple[tuple[str, ...], str]:
    """The user's tenants file -> (its tenant names, the file the agent reads).

    Every `token_file` the user wrote (or left out) becomes the tenant's mounted Secret; the
    priorities, quotas and any other keys stay as written. Comments are not kept.
    """
    data = _entries(text, source)
    for tenant in data["tenants"]:
        check_tenant_name(str(tenant))
    names = _validated(data, source, capacity)
    entries = {
        str(tenant): {**entry, "token_file": tenant_token_path(str(tenant))}
        for tenant, entry in _with_defaults(data["tenants"]).items()
    }
    body = yaml.safe_dump({**data, "tenants": entries}, sort_keys=False, default_flow_style=False)
    return tuple(names), TENANTS_HEADER + body


@dataclass(frozen=True)
class PoolOptions:
    """Everything a pool's manifests depend on, validated; see `colocar k8s render --help`."""

    topology: Topology
    image: str
    tenants: tuple[str, ...]
    tenants_yaml: str  # the ConfigMap's tenants.yaml
    name: str = "pool"
    namespace: str = "default"
    port: int = 7070
    capacity_bytes: int = GiB  # arena bytes per host, all tenants together
    max_tenants: int = 8
    idle_seconds: float = 60.0
    sidecar_cpu: int = 1
    sidecar_memory_bytes: int = GiB
    metrics_port: int = 9464  # the agent's Prometheus endpoint (0: none)
    pod_monitoring: bool = False
    secrets: bool = True  # render the Secrets, with fresh tokens (False: print commands instead)

    @property
    def nodes(self) -> str:
        """The StatefulSet of node pods and its headless Service."""
        return f"{self.name}-nodes"

    @property
    def node_addresses(self) -> list[str]:
        """Each node pod's stable DNS name and port, host by host (StatefulSet ordinals)."""
        return [f"{self.nodes}-{i}.{self.nodes}.{self.namespace}.svc:{self.port}" for i in range(self.hosts)]

    @property
    def hosts(self) -> int:
        return self.topology.hosts

    @property
    def agent_address(self) -> str:
        """What jobs pass to `colocar.connect(pool=...)`: the agent's Service."""
        return f"{self.name}.{self.namespace}.svc:{self.port}"


def _check_ports(port: int, metrics_port: int, pod_monitoring: bool) -> None:
    if not 1024 <= port <= 65535:
        raise RenderError(f"--port {port}: choose an unprivileged port, 1024-65535")
    if metrics_port == 0:
        if pod_monitoring:
            raise RenderError("--pod-monitoring needs the agent's metrics endpoint: drop --metrics-port 0")
    elif not 1024 <= metrics_port <= 65535 or metrics_port == port:
        raise RenderError(
            f"--metrics-port {metrics_port}: choose an unprivileged port other than --port (0: none)"
        )


def _check_limits(max_tenants: int, idle_seconds: float, cpu: int) -> None:
    if max_tenants < 1:
        raise RenderError(f"--max-tenants {max_tenants}: serve at least one tenant")
    if not idle_seconds > 0:
        raise RenderError(f"--idle-seconds {idle_seconds:g} must be positive")
    if cpu < 1:
        raise RenderError(f"--sidecar-cpu {cpu}: give the node pods at least one core")


def read_tenants(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError as e:
        raise RenderError(f"--tenants {path}: {e.strerror}") from None


def build_pool_options(
    *,
    topology: str,
    image: str,
    tenants_file: str,
    tenants_text: str | None = None,
    name: str = "pool",
    namespace: str = "default",
    port: int = 7070,
    capacity: str = "1G",
    max_tenants: int = 8,
    idle_seconds: float = 60.0,
    sidecar_cpu: int | None = None,
    sidecar_memory: str | None = None,
    metrics_port: int = 9464,
    pod_monitoring: bool = False,
    secrets: bool = True,
) -> PoolOptions:
    """Validates raw inputs (as typed on the command line) into `PoolOptions`; the tenants
    file is read from `tenants_file` unless its `tenants_text` is given."""
    if topology not in TOPOLOGIES:
        raise RenderError(f"--topology {topology!r} is unknown; known: {', '.join(TOPOLOGIES)}")
    topo = TOPOLOGIES[topology]
    _check_ports(port, metrics_port, pod_monitoring)
    cpu = topo.sidecar_cpu if sidecar_cpu is None else sidecar_cpu
    _check_limits(max_tenants, idle_seconds, cpu)
    capacity_bytes = parse_size(capacity, "--capacity")
    memory = (
        parse_size(sidecar_memory, "--sidecar-memory") if sidecar_memory else topo.sidecar_memory_gib * GiB
    )
    text = read_tenants(tenants_file) if tenants_text is None else tenants_text
    names, tenants_yaml = rewrite_tenants(text, tenants_file, capacity_bytes)
    return PoolOptions(
        topology=topo,
        image=check_image(image, "--image"),
        tenants=names,
        tenants_yaml=tenants_yaml,
        name=check_name(name),
        namespace=check_namespace(namespace),
        port=port,
        capacity_bytes=capacity_bytes,
        max_tenants=max_tenants,
        idle_seconds=idle_seconds,
        sidecar_cpu=cpu,
        sidecar_memory_bytes=memory,
        metrics_port=metrics_port,
        pod_monitoring=pod_monitoring,
        secrets=secrets,
    )
