"""What `colocar k8s render` takes, checked before anything is rendered.

Every user input (job name, images, bucket URL, sizes, arena pools) is validated here, so that a bad
value fails with a message saying what to write instead and nothing reaches stdout. Sizes take
colocar's one syntax (`32G` = `32Gi`, binary); manifests get Kubernetes quantities (`32Gi`).
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass

from colocar.sizes import parse_size as parse_size_text

from .topologies import TOPOLOGIES, Topology

MiB = 1 << 20
GiB = 1 << 30
VARIANTS = ("multi-controller", "single-controller")
DEFAULT_GSA = "colocar@PROJECT_ID.iam.gserviceaccount.com"
# The image's example program (k8s/Dockerfile copies examples/train.py there); Kubernetes expands
# $(COLOCAR_BUCKET) from the container's environment. Its own directory for the controller.
TRAINER_COMMAND = "python /opt/colocar/examples/train.py"
CONTROLLER_COMMAND = "python /opt/colocar/examples/train.py --ckpt $(COLOCAR_BUCKET)/controller"
_NAME_RE = re.compile(r"^[a-z]([a-z0-9-]{0,38}[a-z0-9])?$")
_POOL_RE = re.compile(r"^[A-Za-z0-9_.-]+$")
_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9._-]*[a-z0-9]$")
_BUCKET_PART_RE = re.compile(r"^[a-z0-9_-]{1,63}$")
_PREFIX_RE = re.compile(r"^[A-Za-z0-9._~=+@,-]+(/[A-Za-z0-9._~=+@,-]+)*$")
_GSA_RE = re.compile(r"^[a-z][a-z0-9-]{4,28}[a-z0-9]@[A-Za-z0-9_.-]+\.iam\.gserviceaccount\.com$")


class RenderError(ValueError):
    """An input `render` cannot turn into valid manifests; the message says what to fix."""


def parse_size(text: str, what: str) -> int:
    """'32Gi', '32G' or '32GiB' -> bytes (`colocar.sizes`: binary units everywhere, so '32G' is
    32Gi here too, unlike a Kubernetes quantity); a whole number of MiB, as volumes need."""
    try:
        nbytes = parse_size_text(text)
    except ValueError as e:
        raise RenderError(f"{what}: {e}") from None
    if nbytes == 0 or nbytes % MiB:
        raise RenderError(f"{what}: {text!r} must be a positive whole number of MiB (e.g. 512M or 32G)")
    return nbytes


def quantity(nbytes: int) -> str:
    """Bytes (a whole number of MiB) -> a Kubernetes quantity: '32Gi' or '30720Mi'."""
    return f"{nbytes // GiB}Gi" if nbytes % GiB == 0 else f"{nbytes // MiB}Mi"


def sidecar_size(nbytes: int) -> str:
    """Bytes (a whole number of MiB) -> the sidecar's size syntax: '30G' or '30720M' (binary)."""
    return f"{nbytes // GiB}G" if nbytes % GiB == 0 else f"{nbytes // MiB}M"


def check_name(name: str) -> str:
    if not _NAME_RE.match(name):
        raise RenderError(
            f"--name {name!r}: use 1-40 lowercase letters, digits and '-', starting with a letter "
            "(it prefixes pod hostnames, which DNS limits to 63 characters)"
        )
    return name


def check_image(image: str, flag: str) -> str:
    """An image must be pinned (tag or digest): controller and sidecar versions must agree."""
    last = image.rsplit("/", 1)[-1]
    if not image or any(c.isspace() for c in image):
        raise RenderError(f"{flag} {image!r} is not an image reference")
    if "@sha256:" in image:
        return image
    if ":" not in last or not last.rsplit(":", 1)[1]:
        raise RenderError(
            f"{flag} {image!r} has no tag: pin a version (e.g. {image}:0.1.0 or @sha256:...), since the "
            "trainer and the sidecar must run the same Python, JAX and cloudpickle"
        )
    if last.rsplit(":", 1)[1] == "latest":
        raise RenderError(
            f"{flag} {image!r}: ':latest' moves under a running job; pin a version tag or digest"
        )
    return image


def check_bucket(url: str) -> tuple[str, str]:
    """'gs://bucket/prefix' -> (bucket, prefix); the prefix may be empty."""
    if not url.startswith("gs://"):
        raise RenderError(f"--bucket {url!r}: expected gs://BUCKET/PREFIX")
    bucket, _, prefix = url[len("gs://") :].partition("/")
    prefix = prefix.rstrip("/")
    if bucket != bucket.lower() and _bucket_ok(bucket.lower()):
        raise RenderError(
            f"--bucket {url!r}: GCS bucket names are lower case; write gs://{bucket.lower()}"
            f"{'/' + prefix if prefix else ''} if that is your bucket (in the docs, BUCKET stands for "
            "your bucket's name)"
        )
    if not _bucket_ok(bucket):
        raise RenderError(
            f"--bucket {url!r}: {bucket!r} is not a bucket name (3-63 lowercase letters, digits, "
            "'-', '_' and '.', starting and ending with a letter or digit; up to 222 with dots, "
            "63 between dots)"
        )
    if prefix and not _PREFIX_RE.match(prefix):
        raise RenderError(f"--bucket {url!r}: prefix {prefix!r} has empty path parts or odd characters")
    return bucket, prefix


def _bucket_ok(bucket: str) -> bool:
    """What GCS accepts as a bucket name (dotted names may be longer, 63 between dots)."""
    parts = bucket.split(".")
    limit = 222 if len(parts) > 1 else 63
    return (
        3 <= len(bucket) <= limit
        and bool(_BUCKET_RE.match(bucket))
        and all(_BUCKET_PART_RE.match(p) for p in parts)
    )


def check_namespace(namespace: str) -> str:
    if not re.match(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$", namespace):
        raise RenderError(f"--namespace {namespace!r} is not a namespace name")
    return namespace


def check_gsa(email: str) -> str:
    if email != DEFAULT_GSA and not _GSA_RE.match(email):
        raise RenderError(f"--gcp-service-account {email!r}: expected NAME@PROJECT.iam.gserviceaccount.com")
    return email


def parse_pool(text: str) -> tuple[str, int]:
    name, eq, size = text.partition("=")
    if not eq or not _POOL_RE.match(name) or name == "default":
        raise RenderError(
            f"--arena-pool {text!r}: expected NAME=SIZE with a NAME other than 'default' (e.g. ckpt=8Gi)"
        )
    return name, parse_size(size, f"--arena-pool {name}")


def arena_bytes(shm_bytes: int) -> int:
    """The arena for a volume of `shm_bytes`: 1/16 of it (at least 256 MiB) stays free.

    The headroom is for other files in the volume (the link socket, scratch files of shipped
    code) and keeps the tmpfs below its limit, where the sidecar would fail to start.
    """
    headroom = max(256 * MiB, shm_bytes // 16)
    return (shm_bytes - headroom) // MiB * MiB


@dataclass(frozen=True)
class RenderOptions:
    """Everything the manifests depend on, validated; see `colocar k8s render --help`."""

    topology: Topology
    image: str
    bucket: str
    name: str = "train"
    variant: str = "multi-controller"
    trainer_image: str = ""
    trainer_command: tuple[str, ...] = tuple(TRAINER_COMMAND.split())
    controller_command: tuple[str, ...] = tuple(CONTROLLER_COMMAND.split())
    gcp_service_account: str = DEFAULT_GSA
    namespace: str = "default"
    port: int = 7070
    shm_bytes: int = 0
    pools: tuple[tuple[str, int], ...] = ()
    sidecar_cpu: int = 0
    sidecar_memory_bytes: int = 0
    tls_secret: str = ""
    max_restarts: int = 3
    metrics_port: int = 9464  # the sidecar's Prometheus endpoint (0: none)
    pod_monitoring: bool = False  # also a PodMonitoring (GKE Managed Service for Prometheus)
    trainer_restarts: int = 0  # in-place restarts of each host's trainer container (0: none)

    @property
    def bucket_name(self) -> str:
        """'gs://b/p' -> 'b'."""
        return self.bucket.removeprefix("gs://").split("/", 1)[0]

    @property
    def arena_bytes(self) -> int:
        return arena_bytes(self.shm_bytes)

    @property
    def processes(self) -> int:
        """Worker processes for `processes=True` calls: half the cores; pipeline workers get the rest."""
        return max(1, self.sidecar_cpu // 2)


def _check_settings(
    topology: str, variant: str, port: int, namespace: str, tls_secret: str | None
) -> Topology:
    """Checks the plain settings; returns the named topology."""
    if topology not in TOPOLOGIES:
        raise RenderError(f"--topology {topology!r} is unknown; known: {', '.join(TOPOLOGIES)}")
    if variant not in VARIANTS:
        raise RenderError(f"--variant {variant!r}: choose {' or '.join(VARIANTS)}")
    if not 1024 <= port <= 65535:
        raise RenderError(f"--port {port}: choose an unprivileged port, 1024-65535")
    check_namespace(namespace)
    if tls_secret is not None and not re.match(r"^[a-z0-9]([a-z0-9.-]{0,251}[a-z0-9])?$", tls_secret):
        raise RenderError(f"--tls-secret {tls_secret!r} is not a Secret name")
    return TOPOLOGIES[topology]


def _check_metrics(metrics_port: int, port: int, pod_monitoring: bool) -> None:
    """The metrics port: 0 (none) or an unprivileged port other than the sidecar's."""
    if metrics_port == 0:
        if pod_monitoring:
            raise RenderError("--pod-monitoring needs the metrics endpoint: drop --metrics-port 0")
        return
    if not 1024 <= metrics_port <= 65535:
        raise RenderError(f"--metrics-port {metrics_port}: choose an unprivileged port, 1024-65535 (0: none)")
    if metrics_port == port:
        raise RenderError(f"--metrics-port {metrics_port} is the sidecar's --port too: choose another")


def _check_trainer_restarts(trainer_restarts: int, variant: str) -> None:
    """In-place trainer restarts: 0 or more, and only where the trainers hold the job's state
    (multi-controller; a single controller runs in a pod of its own)."""
    if trainer_restarts < 0:
        raise RenderError(f"--trainer-restarts {trainer_restarts} must be 0 or more")
    if trainer_restarts and variant != "multi-controller":
        raise RenderError(
            "--trainer-restarts restarts the per-host trainers in place (multi-controller); "
            "drop it or use --variant multi-controller"
        )


def _parse_commands(trainer_command: str, controller_command: str) -> dict[str, tuple[str, ...]]:
    """Both command lines split as a shell would, by flag; neither may be empty."""
    commands = {}
    for flag, text in (("--trainer-command", trainer_command), ("--controller-command", controller_command)):
        try:
            commands[flag] = tuple(shlex.split(text))
        except ValueError as e:
            raise RenderError(f"{flag} {text!r}: {e}") from None
        if not commands[flag]:
            raise RenderError(f"{flag} is empty")
    return commands


def _check_shm(
    shm_size: str | None, pools: list[str] | None, topo: Topology
) -> tuple[int, tuple[tuple[str, int], ...]]:
    """The arena volume's bytes (default: the topology's) and the pools, which must leave at
    least 64 MiB of the arena to the default pool."""
    shm_bytes = parse_size(shm_size, "--shm-size") if shm_size else topo.shm_gib * GiB
    if shm_bytes < GiB:
        raise RenderError(f"--shm-size {shm_size}: give the arena volume at least 1Gi")
    parsed_pools = tuple(parse_pool(p) for p in pools or ())
    if len({n for n, _ in parsed_pools}) != len(parsed_pools):
        raise RenderError("--arena-pool: each pool name may appear once")
    arena = arena_bytes(shm_bytes)
    reserved = sum(size for _, size in parsed_pools)
    if reserved + 64 * MiB > arena:
        raise RenderError(
            f"--arena-pool reservations ({quantity(reserved)}) leave less than 64Mi of the {quantity(arena)} "
            f"arena (derived from --shm-size {quantity(shm_bytes)}) for the default pool: "
            "lower them or raise --shm-size"
        )
    return shm_bytes, parsed_pools


def build_options(
    *,
    topology: str,
    image: str,
    bucket: str,
    name: str = "train",
    variant: str = "multi-controller",
    trainer_image: str | None = None,
    trainer_command: str = TRAINER_COMMAND,
    controller_command: str = CONTROLLER_COMMAND,
    gcp_service_account: str = DEFAULT_GSA,
    namespace: str = "default",
    port: int = 7070,
    shm_size: str | None = None,
    pools: list[str] | None = None,
    sidecar_cpu: int | None = None,
    sidecar_memory: str | None = None,
    tls_secret: str | None = None,
    max_restarts: int = 3,
    metrics_port: int = 9464,
    pod_monitoring: bool = False,
    trainer_restarts: int = 0,
) -> RenderOptions:
    """Validates raw inputs (as typed on the command line) into `RenderOptions`."""
    topo = _check_settings(topology, variant, port, namespace, tls_secret)
    _check_metrics(metrics_port, port, pod_monitoring)
    commands = _parse_commands(trainer_command, controller_command)
    shm_bytes, parsed_pools = _check_shm(shm_size, pools, topo)
    cpu = topo.sidecar_cpu if sidecar_cpu is None else sidecar_cpu
    if cpu < 1:
        raise RenderError(f"--sidecar-cpu {cpu}: give the sidecar at least one core")
    memory = (
        parse_size(sidecar_memory, "--sidecar-memory") if sidecar_memory else topo.sidecar_memory_gib * GiB
    )
    if max_restarts < 0:
        raise RenderError(f"--max-restarts {max_restarts} must be 0 or more")
    _check_trainer_restarts(trainer_restarts, variant)
    bucket_name, prefix = check_bucket(bucket)
    return RenderOptions(
        topology=topo,
        image=check_image(image, "--image"),
        bucket=f"gs://{bucket_name}/{prefix}" if prefix else f"gs://{bucket_name}",
        name=check_name(name),
        variant=variant,
        trainer_image=check_image(trainer_image, "--trainer-image") if trainer_image else image,
        trainer_command=commands["--trainer-command"],
        controller_command=commands["--controller-command"],
        gcp_service_account=check_gsa(gcp_service_account),
        namespace=namespace,
        port=port,
        shm_bytes=shm_bytes,
        pools=parsed_pools,
        sidecar_cpu=cpu,
        sidecar_memory_bytes=memory,
        tls_secret=tls_secret or "",
        max_restarts=max_restarts,
        metrics_port=metrics_port,
        pod_monitoring=pod_monitoring,
        trainer_restarts=trainer_restarts,
    )
