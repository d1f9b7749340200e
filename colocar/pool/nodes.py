"""A pool that spans machines, seen from its agent: the pool nodes, one per machine.

`PoolNodes` is the agent's strategy for where a tenant's sidecars run when the pool is given
`--nodes` (`LocalHosts` runs them as the agent's own children): each node (`node.py`) starts
the tenant's sidecar on its machine, host i on node i. `NodeTenantSidecars` has the same face
as `TenantSidecars`, so the agent admits, watches and stops tenants the same way whatever the
topology. The agent's look at a tenant on the nodes, every second, is also its keep-alive there.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc

from colocar.protocol import colocar_pb2 as pb
from colocar.protocol import colocar_pb2_grpc as pb_grpc
from colocar.protocol.tokens import TOKEN_METADATA_KEY
from colocar.sidecar.auth import read_token_file

from .tenant_sidecars import sidecar_stats
from .tenants import Tenant

START_SECONDS = 300.0  # a first tenant sidecar imports jax and starts its worker processes
CALL_SECONDS = 10.0
UNREACHABLE_LOOKS = 3  # a node that does not answer this many looks in a row has lost its tenants


class PoolNodes:
    """The pool's nodes, host by host, and the token they want."""

    def __init__(self, addresses: list[str], token_file: str, lease_seconds: float = 30.0):
        if not addresses:
            raise ValueError("a pool spanning machines needs at least one node (--nodes HOST:PORT,...)")
        self.addresses, self.count = list(addresses), len(addresses)
        self._token_file, self.lease_seconds = token_file, lease_seconds
        self._channels = [grpc.insecure_channel(a) for a in self.addresses]
        self.stubs = [pb_grpc.PoolNodeStub(c) for c in self._channels]

    def metadata(self) -> tuple[tuple[str, str], ...]:
        return ((TOKEN_METADATA_KEY, read_token_file(self._token_file)),)  # rotated: read each time

    def each(self, call: Any) -> list[Any]:
        """`call(i, stub)` on every node at once; the results (or the exceptions) host by host."""

        def one(i: int) -> Any:
            try:
                return call(i, self.stubs[i])
            except Exception as e:  # noqa: BLE001 - the caller decides
                return e

        with ThreadPoolExecutor(self.count) as pool:
            return list(pool.map(one, range(self.count)))

    def start(self, tenant: Tenant) -> NodeTenantSidecars:
        return NodeTenantSidecars(tenant, self).start()

    def close(self) -> None:
        for channel in self._channels:
            channel.close()


def _node_tenant(tenant: Tenant, nodes: PoolNodes) -> pb.NodeTenant:
    return pb.NodeTenant(
        lease_seconds=nodes.lease_seconds,
        name=tenant.name,
        token=tenant.token,
        arena=tenant.arena,
        calls=tenant.calls,
        processes=tenant.processes,
        sessions=tenant.sessions,
    )


class NodeTenantSidecars:
    """One tenant's sidecars on the pool's nodes: what `TenantSidecars` is on one machine."""

    def __init__(self, tenant: Tenant, nodes: PoolNodes):
        self.tenant, self.nodes = tenant, nodes
        self.addresses: list[str] = []
        self.machines: list[str] = []
        self._unanswered = [0] * nodes.count

    def start(self) -> NodeTenantSidecars:
        """Starts the tenant's sidecar on every node; none is left running on a failure."""
        request, metadata = _node_tenant(self.tenant, self.nodes), self.nodes.metadata()
        replies = self.nodes.each(
            lambda i, stub: stub.StartTenant(request, metadata=metadata, timeout=START_SECONDS)
        )
        failed = [
            (a, r) for a, r in zip(self.nodes.addresses, replies, strict=True) if isinstance(r, Exception)
        ]
        if failed:
            self.stop()
            address, error = failed[0]
            raise RuntimeError(f"pool node {address}: {_why(error)}")
        self.addresses = [r.address for r in replies]
        self.machines = [r.machine for r in replies]
        return self

    def rotate(self, tenant: Tenant) -> None:
        """The tenant's entry changed: its sidecars take the new token."""
        self.tenant, request, metadata = tenant, _node_tenant(tenant, self.nodes), self.nodes.metadata()
        self.nodes.each(lambda i, stub: stub.StartTenant(request, metadata=metadata, timeout=CALL_SECONDS))

    def exited(self) -> str | None:
        """Why a host's sidecar is gone, if one is (its node says so, restarted without it, or
        has not answered `UNREACHABLE_LOOKS` looks in a row)."""
        request, metadata = pb.NodeTenantName(name=self.tenant.name), self.nodes.metadata()
        replies = self.nodes.each(
            lambda i, stub: stub.Tenants(request, metadata=metadata, timeout=CALL_SECONDS)
        )
        for i, (address, reply) in enumerate(zip(self.nodes.addresses, replies, strict=True)):
            if isinstance(reply, Exception):
                self._unanswered[i] += 1
                if self._unanswered[i] >= UNREACHABLE_LOOKS:
                    return f"pool node {address} does not answer: {_why(reply)}"
                continue
            self._unanswered[i] = 0
            name = self.tenant.name
            if name in reply.exited:
                return f"pool node {address}: {reply.exited[name]}"
            if name not in reply.running:
                return f"pool node {address} no longer runs it (restarted?)"
        return None

    def stats(self) -> list[dict[str, Any]]:
        return sidecar_stats(self.addresses, self.tenant.token)

    def stop(self) -> None:
        """Asks every node to stop the tenant's sidecar (a node that does not answer stops it
        itself once the agent's lease runs out)."""
        request, metadata = pb.NodeTenantName(name=self.tenant.name), self.nodes.metadata()
        self.nodes.each(lambda i, stub: stub.StopTenant(request, metadata=metadata, timeout=CALL_SECONDS))


def _why(error: Exception) -> str:
    if isinstance(error, grpc.RpcError):
        return f"{error.code().name}: {error.details()}"  # type: ignore[attr-defined]
    return str(error)
