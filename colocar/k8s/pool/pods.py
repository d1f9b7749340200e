"""The pods of a shared pool: a node daemon on every accelerator node, and the agent.

Node pods (a StatefulSet: stable DNS names the agent is given) run `colocar pool node`, which
starts the tenants' sidecars when the agent asks. Their arenas live in a hostPath folder under
the node's /dev/shm, because the jobs' pods on that node must map the same files: memory
shared across pods. The agent (a one-replica Deployment) runs the admission queue and reads
the tenants file and every tenant's token from mounts that Kubernetes updates in place.
"""

from __future__ import annotations

from typing import Any

from ..options import quantity, sidecar_size
from ..pod import METRICS_PORT_NAME, UID, metrics_annotations, restricted, volume_mount
from .options import (
    ADMIN_DIR,
    CONFIG_DIR,
    NODE_DIR,
    POOL_SHM_PATH,
    TENANTS_DIR,
    TENANTS_FILE,
    PoolOptions,
)

NODE = "colocar-pool-node"
AGENT = "colocar-pool-agent"
NODE_SECRET_DIR = "/etc/colocar/node-secret"  # the node Secret in the node pods' init container
NODE_WORKDIR = "/tmp/colocar-pool-node"
AGENT_WORKDIR = "/tmp/colocar-pool"
NODE_GRACE_SECONDS = 60  # the tenants' sidecars drain, then remove their arenas
HOSTNAME = "kubernetes.io/hostname"
NODE_POOL = "cloud.google.com/gke-nodepool"


def pool_labels(opts: PoolOptions, component: str = "") -> dict[str, str]:
    labels = {"app.kubernetes.io/name": "colocar", "app.kubernetes.io/instance": opts.name}
    return {**labels, "app.kubernetes.io/component": component} if component else labels


def node_labels(opts: PoolOptions) -> dict[str, str]:
    return pool_labels(opts, "pool-node")


def agent_labels(opts: PoolOptions) -> dict[str, str]:
    return pool_labels(opts, "pool-agent")


def shm_host_path(opts: PoolOptions) -> str:
    """The arena folder on every pool node, one per pool name."""
    return f"/dev/shm/colocar-pool-{opts.name}"


def node_secret(opts: PoolOptions) -> str:
    return f"{opts.name}-node"


def admin_secret(opts: PoolOptions) -> str:
    return f"{opts.name}-admin"


def tenant_secret(opts: PoolOptions, tenant: str) -> str:
    return f"{opts.name}-tenant-{tenant}"


def tenants_config_map(opts: PoolOptions) -> str:
    return f"{opts.name}-tenants"


def node_args(opts: PoolOptions) -> list[str]:
    """The `colocar pool node` flags; a test parses them with its own parser."""
    return [
        "--address", f"0.0.0.0:{opts.port}",
        "--token-file", f"{NODE_DIR}/token",
        "--shm-dir", POOL_SHM_PATH,
        "--workdir", NODE_WORKDIR,
        "--advertise", "$(POD_IP)",  # Kubernetes expands it from the container's env
    ]  # fmt: skip


def agent_args(opts: PoolOptions) -> list[str]:
    """The agent's flags (`python -m colocar.pool.agent_main`); a test parses them."""
    args = [
        "--tenants", f"{CONFIG_DIR}/{TENANTS_FILE}",
        "--admin-token-file", f"{ADMIN_DIR}/token",
        "--workdir", AGENT_WORKDIR,
        "--nodes", ",".join(opts.node_addresses),
        "--node-token-file", f"{NODE_DIR}/token",
        "--address", f"0.0.0.0:{opts.port}",
        "--capacity", sidecar_size(opts.capacity_bytes),
        "--max-tenants", str(opts.max_tenants),
        "--idle-seconds", f"{opts.idle_seconds:g}",
    ]  # fmt: skip
    if opts.metrics_port:
        args += ["--metrics-port", str(opts.metrics_port), "--metrics-host", "0.0.0.0"]
    return args


def _field_env(name: str, path: str) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}


def _tcp_probe(port: int) -> dict[str, Any]:
    return {"tcpSocket": {"port": port}, "periodSeconds": 5, "timeoutSeconds": 2, "failureThreshold": 3}


def _root_init(name: str, opts: PoolOptions, command: list[str], mounts: list[dict[str, Any]]) -> Any:
    """An init container that runs as root with CHOWN and FOWNER only: it hands the hostPath
    folder (created root-owned by kubelet) and the node token (a root-owned Secret) to UID
    10001, which the node daemon runs as."""
    context = {
        **restricted(),
        "runAsNonRoot": False,
        "runAsUser": 0,
        "runAsGroup": 0,
        "capabilities": {"drop": ["ALL"], "add": ["CHOWN", "FOWNER"]},
    }
    resources = {"requests": {"cpu": "10m", "memory": "16Mi"}, "limits": {"memory": "64Mi"}}
    return {
        "name": name,
        "image": opts.image,
        "command": command,
        "resources": resources,
        "securityContext": context,
        "volumeMounts": mounts,
    }


def node_init_containers(opts: PoolOptions) -> list[dict[str, Any]]:
    """The arena folder, mode 0700 of UID 10001 (a job's trainer maps it as root or as 10001),
    and the node token copied to a 0600 file of UID 10001 (`--token-file` refuses looser)."""
    owner = ["-o", str(UID), "-g", str(UID)]
    folder = ["install", "-d", *owner, "-m", "0700", POOL_SHM_PATH]
    token = ["install", *owner, "-m", "0600", f"{NODE_SECRET_DIR}/token", f"{NODE_DIR}/token"]
    return [
        _root_init("colocar-pool-shm", opts, folder, [volume_mount("colocar-pool-shm", POOL_SHM_PATH)]),
        _root_init(
            "colocar-node-token",
            opts,
            token,
            [
                volume_mount("colocar-node-secret", NODE_SECRET_DIR, read_only=True),
                volume_mount("colocar-node-token", NODE_DIR),
            ],
        ),
    ]


def node_container(opts: PoolOptions) -> dict[str, Any]:
    """The node daemon: memory = the arenas it may hold (tmpfs pages are charged to the pod
    whose sidecar faults them in) plus the tenants' sidecars' working memory."""
    memory = quantity(opts.capacity_bytes + opts.sidecar_memory_bytes)
    return {
        "name": NODE,
        "image": opts.image,
        "command": ["colocar", "pool", "node"],
        "args": node_args(opts),
        "env": [
            {"name": "HOME", "value": "/tmp"},  # the root filesystem is read-only
            _field_env("POD_IP", "status.podIP"),
            _field_env("COLOCAR_NODE_NAME", "spec.nodeName"),  # the sidecars' machine, as jobs name it
        ],
        "ports": [{"name": "colocar", "containerPort": opts.port, "protocol": "TCP"}],
        "readinessProbe": _tcp_probe(opts.port),
        "resources": {
            "requests": {"cpu": str(opts.sidecar_cpu), "memory": memory},
            "limits": {"memory": memory},
        },
        "securityContext": restricted(),
        "volumeMounts": [
            volume_mount("colocar-pool-shm", POOL_SHM_PATH),
            volume_mount("colocar-node-token", NODE_DIR, read_only=True),
            volume_mount("colocar-tmp", "/tmp"),
        ],
    }


def _node_affinity(opts: PoolOptions) -> dict[str, Any]:
    """One node pod per node; on TPU slices all in one node pool (one slice), where a job's
    JobSet, which takes a whole node pool, then finds a pool node on each of its hosts."""
    own = {"labelSelector": {"matchLabels": node_labels(opts)}}
    required = "requiredDuringSchedulingIgnoredDuringExecution"
    affinity: dict[str, Any] = {"podAntiAffinity": {required: [{**own, "topologyKey": HOSTNAME}]}}
    if opts.topology.exclusive_node_pool:
        affinity["podAffinity"] = {required: [{**own, "topologyKey": NODE_POOL}]}
    return affinity


def _secret_volume(name: str, secret: str) -> dict[str, Any]:
    """A token Secret as a root-owned 0400 file `token` (written as 256)."""
    items = [{"key": "token", "path": "token"}]
    return {"name": name, "secret": {"secretName": secret, "defaultMode": 0o400, "items": items}}


def _node_volumes(opts: PoolOptions) -> list[dict[str, Any]]:
    # A hostPath has no sizeLimit: the agent's --capacity bounds the arenas on each node.
    shm = {"path": shm_host_path(opts), "type": "DirectoryOrCreate"}
    return [
        {"name": "colocar-pool-shm", "hostPath": shm},
        _secret_volume("colocar-node-secret", node_secret(opts)),
        {"name": "colocar-node-token", "emptyDir": {"medium": "Memory", "sizeLimit": "1Mi"}},
        {"name": "colocar-tmp", "emptyDir": {"sizeLimit": "1Gi"}},
    ]


def node_stateful_set(opts: PoolOptions, metadata: dict[str, Any]) -> dict[str, Any]:
    """`hosts` node pods, started together, `<nodes>-<i>.<nodes>` in DNS."""
    topo = opts.topology
    spec = {
        "automountServiceAccountToken": False,
        "terminationGracePeriodSeconds": NODE_GRACE_SECONDS,
        "nodeSelector": dict(topo.node_selector),
        "tolerations": [dict(t) for t in topo.tolerations],
        "affinity": _node_affinity(opts),
        "initContainers": node_init_containers(opts),
        "containers": [node_container(opts)],
        "volumes": _node_volumes(opts),
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": metadata,
        "spec": {
            "serviceName": opts.nodes,
            "replicas": topo.hosts,
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": node_labels(opts)},
            "template": {"metadata": {"labels": node_labels(opts)}, "spec": spec},
        },
    }


def _agent_context() -> dict[str, Any]:
    """Root without capabilities: Kubernetes mounts Secret files owned by root, and the agent
    reads them where they are (so that a rotated token reaches it). Mode 0400 passes its check
    (no group or other bits); an fsGroup would widen them to 0440, which it refuses."""
    return {**restricted(), "runAsNonRoot": False, "runAsUser": 0, "runAsGroup": 0}


def _agent_volumes(opts: PoolOptions) -> list[dict[str, Any]]:
    """No subPath anywhere: kubelet swaps the files in place and the agent's watch re-reads them."""
    tenants = [
        {"secret": {"name": tenant_secret(opts, t), "items": [{"key": "token", "path": f"{t}/token"}]}}
        for t in opts.tenants
    ]
    return [
        {"name": "colocar-pool-config", "configMap": {"name": tenants_config_map(opts)}},
        {"name": "colocar-tenants", "projected": {"defaultMode": 0o400, "sources": tenants}},
        _secret_volume("colocar-admin", admin_secret(opts)),
        _secret_volume("colocar-node", node_secret(opts)),
        {"name": "colocar-tmp", "emptyDir": {"sizeLimit": "1Gi"}},
    ]


def agent_container(opts: PoolOptions) -> dict[str, Any]:
    ports = [{"name": "colocar", "containerPort": opts.port, "protocol": "TCP"}]
    if opts.metrics_port:
        ports.append({"name": METRICS_PORT_NAME, "containerPort": opts.metrics_port, "protocol": "TCP"})
    return {
        "name": AGENT,
        "image": opts.image,
        "command": ["python", "-m", "colocar.pool.agent_main"],
        "args": agent_args(opts),
        "env": [{"name": "HOME", "value": "/tmp"}],
        "ports": ports,
        "readinessProbe": _tcp_probe(opts.port),
        "resources": {"requests": {"cpu": "1", "memory": "1Gi"}, "limits": {"memory": "1Gi"}},
        "securityContext": _agent_context(),
        "volumeMounts": [
            volume_mount("colocar-pool-config", CONFIG_DIR, read_only=True),
            volume_mount("colocar-tenants", TENANTS_DIR, read_only=True),
            volume_mount("colocar-admin", ADMIN_DIR, read_only=True),
            volume_mount("colocar-node", NODE_DIR, read_only=True),
            volume_mount("colocar-tmp", "/tmp"),
        ],
    }


def agent_deployment(opts: PoolOptions, metadata: dict[str, Any]) -> dict[str, Any]:
    """One agent, replaced by stopping the old one first (Recreate): two agents would each
    hand out the same nodes' capacity."""
    template_meta: dict[str, Any] = {"labels": agent_labels(opts)}
    if opts.metrics_port:
        template_meta["annotations"] = metrics_annotations(opts.metrics_port)
    spec = {
        "automountServiceAccountToken": False,
        "containers": [agent_container(opts)],
        "volumes": _agent_volumes(opts),
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": metadata,
        "spec": {
            "replicas": 1,
            "strategy": {"type": "Recreate"},
            "selector": {"matchLabels": agent_labels(opts)},
            "template": {"metadata": template_meta, "spec": spec},
        },
    }
