"""The pod of one host: trainer, colocar sidecar (a native sidecar), arena volume, token, probes,
the sidecar's metrics port and its scrape annotations.

Plain dicts in Kubernetes' own field names. The sidecar is an `initContainers` entry with
`restartPolicy: Always`: it starts (and passes its startup probe) before the trainer and stops
after it. Both containers mount one memory-backed `emptyDir` at the same path; the sidecar's
`--arena-size` is derived from that volume's `sizeLimit`, never set on its own.
"""

from __future__ import annotations

from typing import Any

from .options import RenderOptions, quantity, sidecar_size

SIDECAR = "colocar-sidecar"
TRAINER = "trainer"
CONTROLLER = "controller"
HEALTH_SERVICE = "colocar.v1.Sidecar"  # colocar.sidecar.server.SERVICE_NAME (a test keeps them equal)
UID = 10001  # the image's non-root user and group (k8s/Dockerfile)
SHM_PATH = "/colocar/shm"
SECRET_PATH = "/etc/colocar/secret"  # the Secret as Kubernetes mounts it: root-owned, mode 0440
TOKEN_PATH = "/run/colocar/token"  # a 0600 copy owned by the sidecar, which refuses anything looser
TLS_PATH = "/etc/colocar/tls"
DRAIN_SECONDS = 30
GRACE_SECONDS = 120  # the trainer's last checkpoint first, then the sidecar's drain
METRICS_PORT_NAME = "metrics"
METRICS_PATH = "/metrics"  # colocar.sidecar.metrics.PATH (a test keeps them equal)


def token_secret(opts: RenderOptions) -> str:
    return f"{opts.name}-colocar-token"


def service_account(opts: RenderOptions) -> str:
    return f"{opts.name}-colocar"


def restricted() -> dict[str, Any]:
    """The hardened container context: UID 10001, no capabilities, a read-only root."""
    return {
        "runAsNonRoot": True,
        "runAsUser": UID,
        "runAsGroup": UID,
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def sidecar_args(opts: RenderOptions) -> list[str]:
    """The `colocar sidecar` flags; a test parses them with the sidecar's own parser."""
    args = [
        "--address", f"0.0.0.0:{opts.port}",
        "--shm-dir", SHM_PATH,
        "--arena-size", sidecar_size(opts.arena_bytes),
    ]  # fmt: skip
    for name, size in opts.pools:
        args += ["--pool", f"{name}={sidecar_size(size)}"]
    args += [
        "--token-file", f"{TOKEN_PATH}/token",
        "--processes", str(opts.processes),
        "--drain-seconds", str(DRAIN_SECONDS),
    ]  # fmt: skip
    if opts.metrics_port:
        args += ["--metrics-host", "0.0.0.0", "--metrics-port", str(opts.metrics_port)]
    if opts.tls_secret:
        args += [
            "--tls-cert", f"{TLS_PATH}/tls.crt",
            "--tls-key", f"{TLS_PATH}/tls.key",
            "--tls-client-ca", f"{TLS_PATH}/ca.crt",
        ]  # fmt: skip
    return args


def _probes(opts: RenderOptions) -> dict[str, Any]:
    """gRPC health probes; kubelet's gRPC probe cannot speak TLS, so with mTLS: the TCP port."""
    check: dict[str, Any] = (
        {"tcpSocket": {"port": opts.port}}
        if opts.tls_secret
        else {"grpc": {"port": opts.port, "service": HEALTH_SERVICE}}
    )
    return {
        # Pre-faulting a large arena takes a while (about 1 GB/s): up to 10 minutes.
        "startupProbe": {**check, "periodSeconds": 2, "timeoutSeconds": 2, "failureThreshold": 300},
        "readinessProbe": {**check, "periodSeconds": 10, "timeoutSeconds": 2, "failureThreshold": 3},
        "livenessProbe": {**check, "periodSeconds": 10, "timeoutSeconds": 5, "failureThreshold": 6},
    }


def volume_mount(name: str, path: str, read_only: bool = False) -> dict[str, Any]:
    mount: dict[str, Any] = {"name": name, "mountPath": path}
    if read_only:
        mount["readOnly"] = True
    return mount


def _ports(opts: RenderOptions) -> list[dict[str, Any]]:
    ports = [{"name": "colocar", "containerPort": opts.port, "protocol": "TCP"}]
    if opts.metrics_port:
        ports.append({"name": METRICS_PORT_NAME, "containerPort": opts.metrics_port, "protocol": "TCP"})
    return ports


def scrape_annotations(opts: RenderOptions) -> dict[str, str]:
    """The annotations a Prometheus with the usual pod scrape config reads (none: no endpoint)."""
    return metrics_annotations(opts.metrics_port)


def metrics_annotations(port: int) -> dict[str, str]:
    """`prometheus.io/*` annotations for a metrics endpoint on `port` (0: none)."""
    if not port:
        return {}
    return {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(port),
        "prometheus.io/path": METRICS_PATH,
    }


def sidecar_container(opts: RenderOptions) -> dict[str, Any]:
    """The native sidecar: memory = the whole arena volume (tmpfs pages are charged to the
    container that faults them in, and the sidecar pre-faults the arena) plus working memory."""
    memory = quantity(opts.shm_bytes + opts.sidecar_memory_bytes)
    mounts = [
        volume_mount("colocar-shm", SHM_PATH),
        volume_mount("colocar-token", TOKEN_PATH, read_only=True),
        volume_mount("colocar-tmp", "/tmp"),
    ]
    if opts.tls_secret:
        mounts.append(volume_mount("colocar-tls", TLS_PATH, read_only=True))
    return {
        "name": SIDECAR,
        "image": opts.image,
        "restartPolicy": "Always",
        "command": ["colocar", "sidecar"],
        "args": sidecar_args(opts),
        "env": [{"name": "HOME", "value": "/tmp"}],  # the root filesystem is read-only
        "ports": _ports(opts),
        **_probes(opts),
        "resources": {
            "requests": {"cpu": str(opts.sidecar_cpu), "memory": memory},
            "limits": {"memory": memory},
        },
        "securityContext": restricted(),
        "volumeMounts": mounts,
    }


def token_copy_container(opts: RenderOptions) -> dict[str, Any]:
    """Copies the Secret's token to a 0600 file the (non-root) sidecar owns: Kubernetes mounts
    Secrets owned by root, and `--token-file` refuses a file that its group can read."""
    return {
        "name": "colocar-token",
        "image": opts.image,
        "command": ["install", "-m", "0600", f"{SECRET_PATH}/token", f"{TOKEN_PATH}/token"],
        "resources": {"requests": {"cpu": "10m", "memory": "16Mi"}, "limits": {"memory": "64Mi"}},
        "securityContext": restricted(),
        "volumeMounts": [
            volume_mount("colocar-secret", SECRET_PATH, read_only=True),
            volume_mount("colocar-token", TOKEN_PATH),
        ],
    }


def _client_env(opts: RenderOptions, sidecars: str) -> list[dict[str, Any]]:
    """What `colocar.connect()` reads, plus the storage prefix for the user's code."""
    return [
        {"name": "COLOCAR_SIDECARS", "value": sidecars},
        {"name": "COLOCAR_TOKEN_FILE", "value": f"{SECRET_PATH}/token"},
        {"name": "COLOCAR_BUCKET", "value": opts.bucket},
    ]


def _client_mounts(opts: RenderOptions) -> list[dict[str, Any]]:
    mounts = [volume_mount("colocar-secret", SECRET_PATH, read_only=True)]
    if opts.tls_secret:
        mounts.append(volume_mount("colocar-tls", TLS_PATH, read_only=True))
    return mounts


def trainer_container(opts: RenderOptions) -> dict[str, Any]:
    """The device owner of the host: holds the chips, talks to its own sidecar on loopback."""
    topo = opts.topology
    env = _client_env(opts, f"127.0.0.1:{opts.port}")
    if topo.jax_coordinator:
        # jax.distributed.initialize() reads the address; pass num_processes=COLOCAR_NUM_HOSTS and
        # process_id=JOB_COMPLETION_INDEX (set by the Indexed Job) yourself.
        env.append({"name": "JAX_COORDINATOR_ADDRESS", "value": f"{pod_hostname(opts, 0)}.{opts.name}:8476"})
        env.append({"name": "COLOCAR_NUM_HOSTS", "value": str(topo.hosts)})
    if topo.hosts > 1:  # how the other hosts' sidecars reach this one (snapshot replicas): by DNS
        env.append({"name": "COLOCAR_PEER_ADDRESS", "value": f"{{hostname}}.{opts.name}:{opts.port}"})
    chips = str(topo.chips_per_host)
    return {
        "name": TRAINER,
        "image": opts.trainer_image,
        "command": list(opts.trainer_command),
        "env": env,
        "resources": {"requests": {topo.resource: chips}, "limits": {topo.resource: chips}},
        "volumeMounts": [volume_mount("colocar-shm", SHM_PATH), *_client_mounts(opts)],
    }


def controller_container(opts: RenderOptions) -> dict[str, Any]:
    """Single-controller: one process on a CPU node that reaches every sidecar by DNS."""
    sidecars = ",".join(
        f"{pod_hostname(opts, i)}.{opts.name}:{opts.port}" for i in range(opts.topology.hosts)
    )
    return {
        "name": CONTROLLER,
        "image": opts.trainer_image,
        "command": list(opts.controller_command),
        "env": _client_env(opts, sidecars),
        "resources": {"requests": {"cpu": "2", "memory": "8Gi"}, "limits": {"memory": "8Gi"}},
        "volumeMounts": _client_mounts(opts),
    }


def pod_hostname(opts: RenderOptions, index: int) -> str:
    """JobSet's stable hostname of worker pod `index` (first job of the replicated job)."""
    return f"{opts.name}-workers-0-{index}"


def _volumes(opts: RenderOptions, host: bool) -> list[dict[str, Any]]:
    secret = {
        "name": "colocar-secret",
        "secret": {
            "secretName": token_secret(opts),
            "defaultMode": 0o440,  # written as 288; with fsGroup: root:10001, r--r-----
            "items": [{"key": "token", "path": "token"}],
        },
    }
    volumes: list[dict[str, Any]] = [secret]
    if host:
        volumes += [
            {"name": "colocar-shm", "emptyDir": {"medium": "Memory", "sizeLimit": quantity(opts.shm_bytes)}},
            {"name": "colocar-token", "emptyDir": {"medium": "Memory", "sizeLimit": "1Mi"}},
            {"name": "colocar-tmp", "emptyDir": {"sizeLimit": "1Gi"}},
        ]
    if opts.tls_secret:
        volumes.append(
            {"name": "colocar-tls", "secret": {"secretName": opts.tls_secret, "defaultMode": 0o440}}
        )
    return volumes


def _pod_spec(opts: RenderOptions, containers: list[dict[str, Any]], host: bool) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "serviceAccountName": service_account(opts),
        "automountServiceAccountToken": False,
        # With --trainer-restarts, a failed trainer restarts in place: the pod, its native
        # sidecar and the arena volume (the snapshots in it) stay.
        "restartPolicy": "OnFailure" if host and opts.trainer_restarts else "Never",
        "terminationGracePeriodSeconds": GRACE_SECONDS,
        # The Secret and the volumes become readable by group 10001, the sidecar's.
        "securityContext": {"fsGroup": UID, "fsGroupChangePolicy": "OnRootMismatch"},
    }
    if host:
        topo = opts.topology
        spec["nodeSelector"] = dict(topo.node_selector)
        spec["tolerations"] = [dict(t) for t in topo.tolerations]
        spec["initContainers"] = [token_copy_container(opts), sidecar_container(opts)]
    spec["containers"] = containers
    spec["volumes"] = _volumes(opts, host)
    return spec


def host_pod_template(opts: RenderOptions, labels: dict[str, str]) -> dict[str, Any]:
    """The pod template of every accelerator host."""
    return {
        "metadata": {
            "labels": {**labels, "app.kubernetes.io/component": "host"},
            "annotations": {"kubectl.kubernetes.io/default-container": TRAINER, **scrape_annotations(opts)},
        },
        "spec": _pod_spec(opts, [trainer_container(opts)], host=True),
    }


def controller_pod_template(opts: RenderOptions, labels: dict[str, str]) -> dict[str, Any]:
    """The pod template of the single controller (no accelerator, no sidecar)."""
    return {
        "metadata": {"labels": {**labels, "app.kubernetes.io/component": "controller"}},
        "spec": _pod_spec(opts, [controller_container(opts)], host=False),
    }
