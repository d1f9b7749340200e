"""`colocar pool node`: the process of a pool node, its flags and the `PoolNode` service.

Started on each machine of a pool that spans several (a Kubernetes pod, a Slurm task, or by
hand), in the foreground. Every call must carry the pool's node token (`--token-file`, re-read
when it changes); the agent names the nodes with `colocar pool up --nodes`. It says it is
ready with one JSON line on `--ready-fd` (like a sidecar) and stops on SIGTERM or SIGINT,
stopping every tenant's sidecar first.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
from typing import Any

import grpc

from colocar.cli_help import HelpFormatter
from colocar.protocol import colocar_pb2 as pb
from colocar.protocol import colocar_pb2_grpc as pb_grpc
from colocar.sidecar.auth import Token, metadata_token, read_token_file

from .daemon import announce, log_to_stderr, start_server, stop_on_signals
from .node import PoolNode
from .tenant_sidecars import HostOptions
from .tenants import Tenant


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="colocar pool node", description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--address", default="127.0.0.1:0", help="host:port the node serves the agent on")
    p.add_argument("--token-file", required=True, help="the pool's node token (the agent presents it)")
    p.add_argument("--shm-dir", default="/dev/shm", help="where the tenants' arenas live (jobs map them)")
    p.add_argument("--workdir", help="the tenants' token files and logs (default: a temporary folder)")
    p.add_argument(
        "--advertise", help="the host jobs reach the tenants' sidecars at (default: --address's host)"
    )
    p.add_argument(
        "--agent-lease",
        type=float,
        default=30.0,
        help="stop every tenant's sidecar after this many seconds without a word from the agent",
    )
    p.add_argument("--ready-fd", type=int, help="write one JSON line (address, pid) here once serving")
    p.add_argument("--label", default="pool-node", help="names the node in its log lines")
    return p


class NodeServicer(pb_grpc.PoolNodeServicer):
    """`PoolNode` on gRPC: the node token first, then the node's state."""

    def __init__(self, node: PoolNode, token: Token):
        self.node, self._token = node, token

    def _check(self, context: grpc.ServicerContext) -> None:
        if self._token.proven_by(metadata_token(context.invocation_metadata())) is None:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong colocar pool node token")

    def StartTenant(self, request: pb.NodeTenant, context: grpc.ServicerContext) -> pb.NodeTenantReply:
        self._check(context)
        tenant = Tenant(
            request.name,
            request.token,
            "",
            0,
            request.arena,
            request.calls,
            request.processes,
            request.sessions,
        )
        try:
            address = self.node.start_tenant(tenant, request.lease_seconds)
        except Exception as e:  # noqa: BLE001 - the agent hears why
            context.abort(grpc.StatusCode.UNAVAILABLE, f"starting tenant {tenant.name!r}'s sidecar: {e}")
        return pb.NodeTenantReply(address=address, machine=self.node.machine)

    def StopTenant(self, request: pb.NodeTenantName, context: grpc.ServicerContext) -> pb.Empty:
        self._check(context)
        self.node.stop_tenant(request.name, "the pool agent asked")
        return pb.Empty()

    def Tenants(self, request: pb.NodeTenantName, context: grpc.ServicerContext) -> pb.NodeTenants:
        self._check(context)
        running, exited = self.node.tenants(request.name)
        return pb.NodeTenants(running=running, exited=exited, machine=self.node.machine)


def serve(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    log_to_stderr(args.label)
    bind = args.address.rsplit(":", 1)[0]
    workdir = args.workdir or tempfile.mkdtemp(prefix="colocar-pool-node-")
    options = HostOptions(1, workdir, args.shm_dir, bind=bind, advertise=args.advertise or "")
    token = Token(read_token_file(args.token_file), args.token_file)
    node = PoolNode(options, args.agent_lease)
    add = lambda server: pb_grpc.add_PoolNodeServicer_to_server(NodeServicer(node, token), server)
    server, port = start_server(add, args.address, 16, "colocar-pool-node")
    stop_on_signals(node.stop)
    address = f"{args.advertise or bind}:{port}"
    announce(args.ready_fd, {"address": address, "pid": os.getpid()})
    logging.getLogger("colocar.pool").info("pool node serving on %s (machine %s)", address, node.machine)
    node.stopped.wait()
    node.stop()  # also when the signal's thread still runs: it stops what is left
    server.stop(grace=2).wait()
    return 0


def main(argv: list[str] | None = None) -> Any:
    sys.exit(serve(argv))


if __name__ == "__main__":
    main()
