"""The pool agent's process: its flags, the `Pool` service on gRPC, and its end.

Started by `colocar pool up` (in a session of its own, outliving the command); it says it is
ready with one JSON line on `--ready-fd`, like a sidecar. It stops on SIGTERM, SIGINT or the
admin's `Shutdown`, stopping every tenant's sidecars first.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import threading
from typing import Any

import grpc

from colocar.protocol import colocar_pb2 as pb
from colocar.protocol import colocar_pb2_grpc as pb_grpc
from colocar.sidecar.auth import read_token_file
from colocar.sizes import parse_size

from .agent import ADMIN, PoolAgent, admit_stream
from .daemon import announce, log_to_stderr, start_server, stop_on_signals
from .metrics import PoolMetrics
from .nodes import PoolNodes
from .tenant_sidecars import HostOptions, LocalHosts


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="colocar pool serve", description=__doc__)
    p.add_argument("--tenants", required=True, help="the tenants file (YAML)")
    p.add_argument("--admin-token-file", required=True)
    p.add_argument("--workdir", required=True, help="the pool's folder (tenants' token files, logs)")
    p.add_argument("--hosts", type=int, default=1, help="sidecars per tenant on this machine")
    p.add_argument("--nodes", help="the pool's nodes, HOST:PORT,... (a pool spanning machines; not --hosts)")
    p.add_argument("--node-token-file", help="the token the nodes want (with --nodes)")
    p.add_argument("--capacity", default="1G", help="arena bytes per host for all tenants together")
    p.add_argument("--max-tenants", type=int, default=8)
    p.add_argument("--idle-seconds", type=float, default=60.0)
    p.add_argument("--lease-seconds", type=float, default=30.0)
    p.add_argument("--shm-dir", default="/dev/shm")
    p.add_argument("--address", default="127.0.0.1:0")
    p.add_argument("--ready-fd", type=int)
    p.add_argument("--label", default="pool", help="names the agent in its log lines")
    p.add_argument("--metrics-port", type=int, help="serve per-tenant Prometheus metrics here (0: any port)")
    p.add_argument("--metrics-host", default="127.0.0.1", help="the address the metrics port binds")
    return p


class PoolServicer(pb_grpc.PoolServicer):
    """`Pool` on gRPC: each handler first knows its caller from the call's token."""

    def __init__(self, agent: PoolAgent):
        self.agent = agent

    def _caller(self, context: grpc.ServicerContext, admin_only: bool = False) -> Any:
        caller = self.agent.caller(context.invocation_metadata())
        if caller is None or (admin_only and caller != ADMIN):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong colocar pool token")
        return caller

    def Admit(self, request: pb.AdmitRequest, context: grpc.ServicerContext) -> Any:
        caller = self._caller(context)
        if caller == ADMIN:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                "the admin token is no tenant's: connect with a tenant's",
            )
        yield from admit_stream(self.agent, caller, request, context)

    def Status(self, request: pb.Empty, context: grpc.ServicerContext) -> pb.PoolStatus:
        return pb.PoolStatus(json=json.dumps(self.agent.status(self._caller(context))))

    def Shutdown(self, request: pb.Empty, context: grpc.ServicerContext) -> pb.Empty:
        self._caller(context, admin_only=True)
        threading.Thread(target=self.agent.stop, name="colocar-pool-shutdown").start()
        return pb.Empty()


def serve(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    log_to_stderr(args.label)
    bind = args.address.rsplit(":", 1)[0]
    agent = PoolAgent(
        args.tenants,
        read_token_file(args.admin_token_file),
        _hosts(args, bind),
        capacity=parse_size(args.capacity),
        max_tenants=args.max_tenants,
        idle_seconds=args.idle_seconds,
    )
    try:
        add = lambda server: pb_grpc.add_PoolServicer_to_server(PoolServicer(agent), server)
        server, port = start_server(add, args.address, 64, "colocar-pool")
    except SystemExit:
        agent.stop()
        raise
    stop_on_signals(agent.stop)
    address = f"{bind}:{port}"
    if args.metrics_port is not None:
        agent.metrics = PoolMetrics(agent, args.metrics_host, args.metrics_port)
    metrics = {"metrics": agent.metrics.address} if agent.metrics else {}
    announce(args.ready_fd, {"address": address, "pid": os.getpid(), **metrics})
    logging.getLogger("colocar.pool").info("pool agent serving on %s (%d hosts)", address, agent.hosts.count)
    agent.stopped.wait()
    agent.stop()  # also when the signal's thread still runs: it stops what is left
    server.stop(grace=2).wait()
    return 0


def _hosts(args: argparse.Namespace, bind: str) -> LocalHosts | PoolNodes:
    """Where the tenants' sidecars run: the nodes named by --nodes, else this machine."""
    if not args.nodes:
        return LocalHosts(HostOptions(args.hosts, args.workdir, args.shm_dir, args.lease_seconds, bind))
    if not args.node_token_file:
        raise SystemExit("colocar pool: --nodes needs --node-token-file (the token the nodes want)")
    return PoolNodes(
        [a.strip() for a in args.nodes.split(",") if a.strip()], args.node_token_file, args.lease_seconds
    )


def main(argv: list[str] | None = None) -> None:
    sys.exit(serve(argv))


if __name__ == "__main__":
    main()
