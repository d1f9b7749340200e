"""The sidecar process: flags, arena, gRPC server, health, graceful shutdown.

`python -m colocar.sidecar` or `colocar sidecar`. The bound address is written to
`--ready-file` once the server accepts calls (port 0 picks a free port). SIGTERM drains
in-flight calls for at most `--drain-seconds`, then removes the arena and exits 0. With
`--metrics-port`, Prometheus metrics are served over HTTP (docs/metrics.md).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from concurrent import futures
from typing import TYPE_CHECKING

# Before anything imports JAX: the sidecar never takes an accelerator.
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
os.environ.setdefault("TPU_VISIBLE_CHIPS", "")
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import grpc  # noqa: E402
import multiprocess  # noqa: E402
from grpc_health.v1 import health, health_pb2, health_pb2_grpc  # noqa: E402

from colocar.cli_help import HelpFormatter  # noqa: E402
from colocar.protocol import colocar_pb2_grpc as pb_grpc  # noqa: E402
from colocar.protocol import link as link_protocol  # noqa: E402
from colocar.protocol import versions  # noqa: E402
from colocar.shm import context as shm_context  # noqa: E402
from colocar.shm.arena import ShmUnavailableError  # noqa: E402
from colocar.sizes import parse_size  # noqa: E402

from . import auth, cancels, lifeline, logs, quotas  # noqa: E402
from .blocks import SidecarArena  # noqa: E402
from .grpc_servicer import GrpcServicer  # noqa: E402
from .link_server import LinkServer  # noqa: E402
from .preload import PRELOAD_HELP, Preload  # noqa: E402
from .quotas import Quotas  # noqa: E402
from .service import ServiceConfig, SidecarService  # noqa: E402
from .workers import WorkerPool  # noqa: E402

if TYPE_CHECKING:
    from .metrics import MetricsEndpoint

SERVICE_NAME = "colocar.v1.Sidecar"
# What every worker needs, and nothing heavier: grain (it imports JAX, seconds) is imported by
# the shipped code that uses it, not by every worker a pipeline or the call pool starts.
FORKSERVER_PRELOAD = [
    "numpy",
    "cloudpickle",
    "colocar.sidecar.worker_main",
    "colocar.loaders.worker",
    "colocar.loaders.config",
    "colocar.loaders.records",
    "colocar.loaders.sources",
    "array_record.python.array_record_data_source",
]
MiB = 1 << 20
DEFAULT_LABEL = "sidecar"
log = logging.getLogger("colocar.sidecar")
# Streams one connection may have open at once (gRPC queues a client's further calls): bounds
# what one peer holds here, far above what a controller uses (its streams and calls in flight).
MAX_STREAMS_PER_CONNECTION = 1024


def _size(text: str) -> int:
    """A size flag's value: '256M', '1G', '16Gi', '4096' -> bytes (one syntax: `colocar.sizes`)."""
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _pool(text: str) -> tuple[str, int]:
    name, _, size = text.partition("=")
    if not name or not size:
        raise argparse.ArgumentTypeError(f"expected NAME=SIZE, got {text!r}")
    return name, _size(size)


STOP_SIGNALS = ("TERM", "USR1", "USR2")
STOP_SIGNAL_HELP = (
    "the signal that drains the sidecar (TERM: SIGTERM or SIGINT); any other leaves SIGTERM and "
    "SIGINT ignored, for a supervisor that stops the sidecar after its trainer (Slurm signals "
    "every process of a job step at once)"
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="colocar sidecar", description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--address", default="127.0.0.1:0", help="host:port to bind (port 0: any)")
    p.add_argument("--ready-file", help="write the bound address and pid here as JSON when ready")
    p.add_argument(
        "--ready-fd",
        type=int,
        help="write the same JSON, one line, to this inherited file descriptor when ready, then "
        "close it (a parent that started the sidecar waits on a pipe instead of polling a file)",
    )
    p.add_argument("--shm-dir", default="/dev/shm", help="directory of the arena (tmpfs)")
    p.add_argument("--arena-size", type=_size, default="1G", help="arena bytes (e.g. 4G, 16Gi)")
    p.add_argument(
        "--pool",
        type=_pool,
        action="append",
        default=[],
        help="reserve NAME=SIZE of the arena, e.g. ckpt=8G (repeatable)",
    )
    p.add_argument("--token-file", help="file (mode 0600) holding the shared token (re-read when it changes)")
    p.add_argument("--tls-cert", help="server certificate (PEM)")
    p.add_argument("--tls-key", help="server private key (PEM)")
    p.add_argument("--tls-client-ca", help="CA for client certificates (mutual TLS)")
    p.add_argument("--lease-seconds", type=float, default=30.0, help="session lease")
    p.add_argument(
        "--session-grace",
        type=float,
        default=3600.0,
        help="seconds a named session outlives its controller (keeping its objects and arrays) "
        "for a controller to reattach; a controller may ask for its own",
    )
    p.add_argument("--threads", type=int, default=32, help="concurrent shipped calls")
    p.add_argument("--processes", type=int, default=2, help="worker processes for CPU-bound calls")
    p.add_argument(
        "--alloc-timeout",
        type=float,
        default=30.0,
        help="seconds an allocation waits for room in a full pool",
    )
    p.add_argument("--drain-seconds", type=float, default=10.0, help="grace period on SIGTERM")
    p.add_argument("--parent-pid", type=int, default=0, help="exit when this process is gone")
    p.add_argument("--stop-signal", choices=STOP_SIGNALS, default="TERM", help=STOP_SIGNAL_HELP)
    p.add_argument("--label", default=DEFAULT_LABEL, help="name part of the arena file and host in log lines")
    p.add_argument("--preload", action="append", default=[], metavar="MODULE", help=PRELOAD_HELP)
    p.add_argument(
        "--metrics-port",
        type=int,
        help="serve Prometheus metrics over HTTP on this port, at /metrics (0: any free port; "
        "default: no metrics endpoint)",
    )
    p.add_argument(
        "--metrics-host",
        default="127.0.0.1",
        help="address the metrics port binds (0.0.0.0: every interface, for a scraper on another machine)",
    )
    quotas.add_arguments(p)
    return p


def _start_link(service: SidecarService, arena_path: str, token: auth.Token) -> LinkServer | None:
    """The local link next to the arena file, if the path fits a Unix socket."""
    path = arena_path.removesuffix(".arena") + ".sock"
    try:
        link = LinkServer(service, path, token)
    except OSError as e:  # e.g. a path longer than the 107 bytes a Unix socket allows
        logging.getLogger("colocar.sidecar").warning("no local link at %s: %s", path, e)
        return None
    service.link_path = path
    return link


def _host_name(label: str) -> str:
    """The host in log lines and metrics: `--label`, or the machine's name by default."""
    return socket.gethostname() if label == DEFAULT_LABEL else label


def _start_metrics(args: argparse.Namespace) -> MetricsEndpoint | None:
    """The metrics endpoint, or None without `--metrics-port`. Bound first: a port in use ends
    the start at once, before an arena exists."""
    if args.metrics_port is None:
        return None
    if not 0 <= args.metrics_port <= 65535:
        raise SystemExit(f"colocar sidecar: error: --metrics-port {args.metrics_port}: choose 0-65535")
    try:
        from .metrics import MetricsEndpoint  # only here: prometheus_client stays out otherwise

        return MetricsEndpoint(
            args.metrics_host, args.metrics_port, _host_name(args.label), versions.colocar_version()
        )
    except OSError as e:
        raise SystemExit(
            f"colocar sidecar: error: cannot serve metrics on {args.metrics_host}:{args.metrics_port} "
            f"(--metrics-host, --metrics-port): {e.strerror or e}"
        ) from None


def _configure_logging(label: str) -> logging.Logger:
    """Log lines on stderr carry the host, pid and thread: `[host1 pid=123 MainThread]` (the
    host is `--label`, or the machine's name when that is left at its default). gRPC reports
    handler failures through logging; without a handler they would vanish. Undecodable requests
    are the client's fault and answered with an error: no traceback."""
    host = _host_name(label)
    logging.basicConfig(
        level=logging.WARNING,
        format=f"%(asctime)s [{host} pid=%(process)d %(threadName)s] %(name)s %(levelname)s: %(message)s",
        stream=sys.__stderr__,
    )
    logging.getLogger("grpc._common").setLevel(logging.CRITICAL)
    log = logging.getLogger("colocar.sidecar")
    log.setLevel(logging.INFO)
    return log


def _start_service(args: argparse.Namespace, arena: SidecarArena) -> tuple[SidecarService, WorkerPool | None]:
    """The service over `arena` and its worker processes (none with `--processes 0`); shipped
    code's `colocar.shm.empty` allocates in `arena` from here on."""
    config = ServiceConfig(
        lease_seconds=args.lease_seconds,
        session_grace_seconds=args.session_grace,
        max_concurrent_calls=args.threads,
        alloc_timeout_seconds=args.alloc_timeout,
        quotas=Quotas.from_args(args),
    )
    timeout = config.alloc_timeout_seconds
    shm_context.install(
        lambda shape, dtype, pool: arena.empty(shape, dtype, pool, timeout, cancels.current()), arena
    )
    # Every worker process (call workers, pipeline workers) forks from one forkserver, started
    # with the first of them; what it preloads, each worker has at once. (Starting it ahead, in
    # the background, saved ~0.3 s of a first pipeline but cost every sidecar start ~0.7 s of
    # a 2-core machine, also those that never start a worker.)
    multiprocess.get_context("forkserver").set_forkserver_preload(FORKSERVER_PRELOAD)
    workers = WorkerPool(args.processes, arena) if args.processes > 0 else None
    return SidecarService(arena, workers, config), workers


def _start_grpc(
    args: argparse.Namespace,
    service: SidecarService,
    token: auth.Token,
    credentials: grpc.ServerCredentials | None,
    arena: SidecarArena,
) -> tuple[grpc.Server, health.HealthServicer, str]:
    """The gRPC server with the service (the token checked on every RPC's metadata, before its
    message is read) and health checks, bound and started; returns it, its health servicer
    (SERVING) and the bound address. Exits (closing `arena`) if it cannot bind."""
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=args.threads + 16, thread_name_prefix="colocar-rpc"),
        interceptors=[auth.TokenInterceptor(token)],
        options=[
            ("grpc.max_receive_message_length", link_protocol.MAX_REQUEST),
            ("grpc.max_send_message_length", link_protocol.MAX_FRAME),
            ("grpc.max_concurrent_streams", MAX_STREAMS_PER_CONNECTION),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.min_ping_interval_without_data_ms", 500),
            ("grpc.http2.max_ping_strikes", 0),
            ("grpc.so_reuseport", 0),
        ],
    )
    pb_grpc.add_SidecarServicer_to_server(GrpcServicer(service, token), server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    if credentials is not None:
        port = server.add_secure_port(args.address, credentials)
    else:
        port = server.add_insecure_port(args.address)
    if port == 0:
        arena.close()
        raise SystemExit(f"cannot bind {args.address}")
    server.start()
    host = args.address.rsplit(":", 1)[0]
    for name in ("", SERVICE_NAME):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return server, health_servicer, f"{host}:{port}"


def _stop_event(parent_pid: int, stop_signal: str = "TERM") -> tuple[threading.Event, list[str]]:
    """Set on SIGTERM or SIGINT (or on `stop_signal` alone, the other two then ignored, also by
    the worker processes started after), or (with `parent_pid`) once that process is gone; the
    list gets the reason (the signal's name, or that the parent is gone)."""
    stop, why = threading.Event(), ["parent process gone"]

    def on_signal(signum: int, _frame: object) -> None:
        why[0] = signal.Signals(signum).name
        stop.set()

    own = [signal.Signals[f"SIG{stop_signal}"]]
    stops = [signal.SIGTERM, signal.SIGINT] if stop_signal == "TERM" else own
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    for sig in stops:
        signal.signal(sig, on_signal)
    if parent_pid:  # no orphans: a local cluster's sidecar ends with its controller
        lifeline.on_exit(parent_pid, stop.set, name="colocar-parent-watch")
    return stop, why


def _announce(
    args: argparse.Namespace, bound: str, arena: SidecarArena, metrics: MetricsEndpoint | None
) -> None:
    """Writes the ready file (atomically: a reader never sees half of it) and the ready fd,
    and says on stderr where it serves (calls, and metrics if on) and which dead sidecars'
    arenas it removed."""
    info = {"address": bound, "pid": os.getpid(), "arena": arena.arena.path}
    if metrics is not None:
        info["metrics"] = metrics.address
    if args.ready_file:
        tmp = args.ready_file + ".tmp"
        with open(tmp, "w") as f:
            json.dump(info, f)
        os.replace(tmp, args.ready_file)
    if args.ready_fd is not None:
        try:
            with open(args.ready_fd, "w", closefd=True) as f:
                f.write(json.dumps(info) + "\n")
        except OSError as e:  # the parent went away: it no longer waits for us
            log.warning("cannot write to --ready-fd %d: %s", args.ready_fd, e)
    log.info("colocar sidecar serving on %s (arena %s)", bound, arena.arena.path)
    if metrics is not None:
        log.info("metrics on http://%s/metrics", metrics.address)
    for path in arena.stale_removed:
        log.info("removed the arena of a dead sidecar: %s", path)


def _drain(
    drain_seconds: float,
    service: SidecarService,
    health_servicer: health.HealthServicer,
    server: grpc.Server,
    link: LinkServer | None,
) -> None:
    """Graceful shutdown: no new calls (gRPC, then the link), in-flight ones finish within
    `drain_seconds` in all, then the service stops."""
    service.draining = True
    health_servicer.enter_graceful_shutdown()
    started = time.monotonic()
    drain_deadline = started + drain_seconds
    if link is not None:
        link.close()
    server.stop(grace=drain_seconds).wait()
    if link is not None:
        link.drain(max(0.0, drain_deadline - time.monotonic()))
    service.stop()
    log.info("drained in %.1f s", time.monotonic() - started)


def _security(args: argparse.Namespace) -> tuple[auth.Token, grpc.ServerCredentials | None]:
    """The token (re-read when its file changes) and TLS credentials from their files; a file
    that cannot be read ends the sidecar with a message naming the flag and the file."""
    try:
        token = auth.read_token_file(args.token_file) if args.token_file else None
    except OSError as e:
        raise SystemExit(f"colocar sidecar: error: --token-file {args.token_file}: {e.strerror}") from None
    try:
        credentials = auth.server_credentials(args.tls_cert, args.tls_key, args.tls_client_ca)
    except OSError as e:
        raise SystemExit(f"colocar sidecar: error: TLS file {e.filename}: {e.strerror}") from None
    auth.check_address_safety(args.address, token, mutual_tls=bool(args.tls_client_ca))
    return auth.Token(token, args.token_file), credentials


def serve(argv: list[str] | None = None) -> int:
    """Runs a sidecar until SIGTERM, SIGINT or its parent's end, then drains and exits 0."""
    args = build_parser().parse_args(argv)
    if args.ready_fd is not None:  # for us alone: no child process (the forkserver) inherits it
        os.set_inheritable(args.ready_fd, False)
    preload = Preload(tuple(args.preload))  # overlaps the start-up; joined before anything serves
    _configure_logging(args.label)
    stop, why = _stop_event(args.parent_pid, args.stop_signal)  # before the workers: they inherit it
    token, credentials = _security(args)
    metrics = _start_metrics(args)
    try:
        arena = SidecarArena(args.shm_dir, args.arena_size, dict(args.pool), label=args.label)
    except (OSError, ShmUnavailableError) as e:
        raise SystemExit(f"colocar sidecar: error: {e}") from None
    logs.install()
    service, workers = _start_service(args, arena)
    if metrics is not None:
        metrics.attach(service)
    for name, why_not in preload.wait().items():  # its first use raises the error itself
        log.warning("cannot import %s at start: %s", name, why_not)
    link = _start_link(service, arena.arena.path, token)
    server, health_servicer, bound = _start_grpc(args, service, token, credentials, arena)
    _announce(args, bound, arena, metrics)
    while not stop.wait(0.5):
        pass
    log.info(
        "%s: draining (no new calls; in-flight ones get up to %.0f s, --drain-seconds)",
        why[0],
        args.drain_seconds,
    )
    _drain(args.drain_seconds, service, health_servicer, server, link)
    if metrics is not None:  # scraped until the drain ended
        metrics.close()
    if workers is not None:
        workers.close()
    arena.close()
    return 0


def main(argv: list[str] | None = None) -> None:
    sys.exit(serve(argv))
