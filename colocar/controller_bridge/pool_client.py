"""Joining a shared pool from a controller: the admission queue, then the tenant's sidecars.

Runs in the controller (`colocar.connect(pool=...)`, `colocar pool admit`). The pool is named
by its pool file (written by `colocar pool up`) or its agent's host:port. While the pool is
full the caller waits in its queue, the position and the estimated wait printed as they change
(and kept in `cluster.stats()["pool"]`); Ctrl-C or `queue_timeout` leaves the queue cleanly.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc

from colocar.errors import AuthError, ColocarError, PoolFullError
from colocar.protocol import colocar_pb2 as pb
from colocar.protocol import colocar_pb2_grpc as pb_grpc
from colocar.protocol.tokens import TOKEN_METADATA_KEY


@dataclass
class Admitted:
    """A tenant's admission: its sidecars and how it waited (position, estimate) on the way."""

    tenant: str
    addresses: list[str]
    waited_seconds: float
    updates: list[dict[str, float]] = field(default_factory=list)
    machines: list[str] = field(default_factory=list)  # the machine of each sidecar

    def own(self, process_index: int, process_count: int) -> list[str]:
        """The sidecars a controller connects to: all of them, or in multi-controller JAX
        (one process per host) the one on this process's machine, found by its name (by the
        process's index when several share it, as on one machine)."""
        if process_count <= 1:
            return self.addresses
        me = machine_name()
        mine = [a for a, m in zip(self.addresses, self.machines, strict=False) if m == me]
        if len(mine) == 1:
            return mine
        if len(self.addresses) != process_count:
            raise ColocarError(
                f"tenant {self.tenant!r}: {process_count} JAX processes but the pool has "
                f"{len(self.addresses)} hosts and none is alone on {me!r}: "
                "start the pool with one host per process"
            )
        return [self.addresses[process_index]]

    def as_dict(self) -> dict[str, Any]:
        last = self.updates[-1] if self.updates else {}
        return {
            "tenant": self.tenant,
            "waited_seconds": self.waited_seconds,
            "queued": bool(self.updates),
            "last_position": last.get("position", 0),
            "last_estimate_seconds": last.get("estimate", -1.0),
            "updates": list(self.updates),
        }


def agent_address(pool: str) -> str:
    """The agent's host:port from a pool file, or `pool` itself when it is one."""
    if pool.endswith(".json") or "/" in pool:
        try:
            with open(pool) as f:
                return str(json.load(f)["address"])
        except (OSError, ValueError, KeyError) as e:
            raise ColocarError(f"pool file {pool}: {e} (is the pool up? colocar pool up)") from None
    return pool


def machine_name() -> str:
    """The machine a sidecar or a job runs on: `COLOCAR_NODE_NAME` (on Kubernetes the node's
    name, from the downward API), else Slurm's node name in a task (`SLURMD_NODENAME`: several
    slurmd may share a host), else the host name."""
    return os.environ.get("COLOCAR_NODE_NAME") or os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def say_on_stderr(update: dict[str, float]) -> None:
    estimate = update["estimate"]
    eta = f"about {estimate:.0f} s" if estimate >= 0 else "unknown yet"
    print(
        f"colocar: the pool is full; waiting in its queue: position {update['position']:.0f} of "
        f"{update['waiting']:.0f}, estimated wait {eta}",
        file=sys.stderr,
        flush=True,
    )


def admit(
    pool: str,
    token: str,
    *,
    wait: bool = True,
    queue_timeout: float = 0.0,
    say: Callable[[dict[str, float]], None] = say_on_stderr,
) -> Admitted:
    """Waits until the pool serves the tenant of `token`; its sidecars' addresses."""
    address, started = agent_address(pool), time.monotonic()
    updates: list[dict[str, float]] = []
    with grpc.insecure_channel(address) as channel:
        call = pb_grpc.PoolStub(channel).Admit(
            pb.AdmitRequest(timeout_seconds=queue_timeout, wait=wait), metadata=((TOKEN_METADATA_KEY, token),)
        )
        try:
            for reply in call:
                if reply.addresses:
                    waited = time.monotonic() - started
                    return Admitted(
                        reply.tenant, list(reply.addresses), waited, updates, list(reply.machines)
                    )
                update = {
                    "position": reply.position,
                    "estimate": reply.estimated_wait_seconds,
                    "waiting": reply.waiting,
                    "at": time.monotonic() - started,
                }
                updates.append(update)
                say(update)
        except grpc.RpcError as e:
            raise _error(e, address) from None
        finally:
            call.cancel()  # Ctrl-C or an error: the agent drops the ticket
    raise ColocarError(f"pool agent at {address} ended the admission without an answer")


def _error(e: grpc.RpcError, address: str) -> Exception:
    code, details = e.code(), e.details() or ""  # type: ignore[attr-defined]
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return AuthError(f"pool at {address}: {details} (is this token in the pool's tenants file?)")
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return PoolFullError(details)
    if code == grpc.StatusCode.UNAVAILABLE:
        return ColocarError(
            f"pool agent at {address} does not answer ({details}): is the pool up? (colocar pool status)"
        )
    return ColocarError(f"pool at {address}: {code.name}: {details}")


def pool_status(pool: str, token: str) -> dict[str, Any]:
    """The pool's status as its agent reports it (all tenants for the admin token)."""
    address = agent_address(pool)
    with grpc.insecure_channel(address) as channel:
        try:
            reply = pb_grpc.PoolStub(channel).Status(
                pb.Empty(), metadata=((TOKEN_METADATA_KEY, token),), timeout=30
            )
        except grpc.RpcError as e:
            raise _error(e, address) from None
    return dict(json.loads(reply.json))


def shutdown(pool: str, token: str) -> None:
    address = agent_address(pool)
    with grpc.insecure_channel(address) as channel:
        try:
            pb_grpc.PoolStub(channel).Shutdown(
                pb.Empty(), metadata=((TOKEN_METADATA_KEY, token),), timeout=30
            )
        except grpc.RpcError as e:
            raise _error(e, address) from None
