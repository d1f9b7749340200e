"""One tenant's sidecars in a shared pool: one per host, its own processes, token and quotas.

Runs in the pool's agent. A tenant's code, code cache, `sys.path` and working directory, its
sessions, objects, arrays and arena blocks live in its own sidecar processes (and their worker
processes): another tenant's token is refused there before anything is read, so nothing of one
tenant is reachable, listable or freeable with another's token. The quotas are the sidecar's
own limits (`--arena-size`, `--processes`, `--max-sessions`, `--max-calls`). The sidecars end
with the agent (`--parent-pid`) and remove their arenas; a rotated token reaches them through
their token file, which they re-read.
"""

from __future__ import annotations

import os
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import grpc

from colocar.controller_bridge.local.sidecars import Sidecar, wait_ready
from colocar.controller_bridge.pool_client import machine_name
from colocar.protocol import colocar_pb2 as pb
from colocar.protocol import colocar_pb2_grpc as pb_grpc
from colocar.protocol.tokens import TOKEN_METADATA_KEY, write_token_file

from .tenants import Tenant

STARTUP_SECONDS = 300.0
STOP_GRACE = 10.0


@dataclass(frozen=True)
class HostOptions:
    """What every tenant sidecar of the pool shares: where, and its session lease."""

    hosts: int
    workdir: str
    shm_dir: str
    lease_seconds: float = 30.0
    bind: str = "127.0.0.1"
    advertise: str = ""  # the host jobs reach the sidecars at, when not `bind` (e.g. 0.0.0.0)


class TenantSidecars:
    """The running sidecars of one tenant, host by host."""

    def __init__(self, tenant: Tenant, options: HostOptions):
        self.tenant, self.options = tenant, options
        self.folder = os.path.join(options.workdir, "tenants", tenant.name)
        os.makedirs(self.folder, mode=0o700, exist_ok=True)
        self.token_file = os.path.join(self.folder, "token")
        write_token_file(self.token_file, tenant.token)
        self.sidecars = [
            Sidecar(i, self.folder, label=f"{tenant.name}-host{i}") for i in range(options.hosts)
        ]

    def _argv(self) -> list[str]:
        t, o = self.tenant, self.options
        return [
            sys.executable, "-m", "colocar.sidecar",
            "--address", f"{o.bind}:0",
            "--shm-dir", o.shm_dir,
            "--arena-size", str(t.arena),
            "--processes", str(t.processes),
            "--threads", str(max(t.calls, 1)),
            "--token-file", self.token_file,
            "--lease-seconds", str(o.lease_seconds),
            "--parent-pid", str(os.getpid()),
            "--tenant", t.name,
            "--max-sessions", str(t.sessions),
            "--max-calls", str(t.calls),
        ]  # fmt: skip

    def start(self) -> TenantSidecars:
        """Starts every host's sidecar and waits until they serve; none is left on a failure."""
        argv, env = self._argv(), dict(os.environ)
        try:
            for s in self.sidecars:
                s.spawn(argv, env)
            wait_ready(self.sidecars, STARTUP_SECONDS)
        except BaseException:
            self.stop()
            raise
        return self

    @property
    def addresses(self) -> list[str]:
        bound = [str((s.info or {}).get("address", "")) for s in self.sidecars]
        if not self.options.advertise:
            return bound
        return [f"{self.options.advertise}:{a.rsplit(':', 1)[-1]}" for a in bound]

    @property
    def machines(self) -> list[str]:
        return [machine_name()] * len(self.sidecars)

    def rotate(self, tenant: Tenant) -> None:
        """The tenant's entry changed: a new token is written (the sidecars re-read it within
        a second); new quotas apply when its sidecars next start."""
        if tenant.token != self.tenant.token:  # whole or not at all: a sidecar may read it now
            fresh = self.token_file + ".new"
            write_token_file(fresh, tenant.token)
            os.replace(fresh, self.token_file)
        self.tenant = tenant

    def exited(self) -> str | None:
        """Why a host's sidecar is gone, if one is."""
        return next((f"{s.label}: {why}" for s in self.sidecars if (why := s.status())), None)

    def stats(self) -> list[dict[str, Any]]:
        return sidecar_stats(self.addresses, self.tenant.token)

    def stop(self) -> None:
        """Stops every host's sidecar (they drain, then remove their arenas)."""
        for s in self.sidecars:
            if getattr(s, "process", None) is not None:
                s.terminate()
        for s in self.sidecars:
            if getattr(s, "process", None) is not None:
                s.stop(STOP_GRACE)


class LocalHosts:
    """A pool on this machine: each tenant's sidecars are child processes of the agent, one
    per host (`PoolNodes` is the same for a pool spanning machines)."""

    def __init__(self, options: HostOptions):
        self.options, self.count = options, options.hosts

    def start(self, tenant: Tenant) -> TenantSidecars:
        return TenantSidecars(tenant, self.options).start()

    def close(self) -> None:
        pass


def sidecar_stats(addresses: list[str], token: str) -> list[dict[str, Any]]:
    """Each sidecar's Stats (sessions, arena use, calls, quota refusals); {} for one that does
    not answer."""
    with ThreadPoolExecutor(max(len(addresses), 1)) as pool:
        return list(pool.map(lambda address: _host_stats(address, token), addresses))


def _host_stats(address: str, token: str) -> dict[str, Any]:
    try:
        with grpc.insecure_channel(address) as channel:
            reply = pb_grpc.SidecarStub(channel).Stats(
                pb.Empty(), metadata=((TOKEN_METADATA_KEY, token),), timeout=5
            )
    except grpc.RpcError:
        return {}
    return {
        "sessions": reply.sessions,
        "calls": reply.calls,
        "in_flight": reply.in_flight,
        "objects": reply.objects,
        "arena_used": sum(p.used for p in reply.pools),
        "arena_allocated": sum(p.allocated for p in reply.pools),
        "quota_refusals": dict(reply.quota_refusals),
    }
