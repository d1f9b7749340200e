"""A pool node: the tenants' sidecars on one machine of a pool that spans several.

Runs as `colocar pool node` on every machine (on Kubernetes, a pod per node of the slice;
under Slurm, a task per node). The pool's agent asks it to start a tenant's sidecar, with the
tenant's token and quotas, and to stop it; the sidecars are the node's child processes
(`TenantSidecars` with one host), so they end with it. The agent's looks at a tenant are its
keep-alive: a tenant the agent has not looked at for `agent_lease` seconds is stopped, so an
agent that died, or a new one that does not know it, leaves nothing running.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time

from colocar.controller_bridge.pool_client import machine_name

from .tenant_sidecars import HostOptions, TenantSidecars
from .tenants import Tenant

log = logging.getLogger("colocar.pool")


class PoolNode:
    """The tenants served on this machine, by name. Starting and stopping sidecars takes
    seconds; the map of tenants is only locked to read or change it, so the agent's looks are
    answered meanwhile (a look that waited on a start would count as a node not answering)."""

    def __init__(self, options: HostOptions, agent_lease: float = 30.0):
        self.options, self.agent_lease = options, agent_lease
        self.machine = machine_name()
        self.running: dict[str, TenantSidecars] = {}
        self._lock = threading.Lock()  # the maps below
        self._starts = threading.Lock()  # one start at a time (the agent starts one at a time too)
        self._heard: dict[str, float] = {}  # tenant -> when the agent last asked about it
        self.stopped = threading.Event()
        threading.Thread(target=self._watch, name="colocar-pool-node-watch", daemon=True).start()

    def heard(self, name: str) -> None:
        """The agent asked about the tenant: its lease starts again."""
        self._heard[name] = time.monotonic()

    def start_tenant(self, tenant: Tenant, lease_seconds: float = 0.0) -> str:
        """The address of the tenant's sidecar here, started unless it runs (then it takes a
        new token; its quotas apply when it next starts)."""
        with self._starts:
            with self._lock:
                running = self.running.get(tenant.name)
                if running is not None and not running.exited():
                    self.heard(tenant.name)
                    running.rotate(tenant)
                    return running.addresses[0]
            self.stop_tenant(tenant.name, "restarted")
            lease = lease_seconds or self.options.lease_seconds
            sidecars = TenantSidecars(tenant, dataclasses.replace(self.options, lease_seconds=lease)).start()
            with self._lock:
                kept = not self.stopped.is_set()  # else the node's stop ran meanwhile
                if kept:
                    self.running[tenant.name] = sidecars
                    self.heard(tenant.name)  # after the start, which may take longer than the lease
        if not kept:
            sidecars.stop()
            raise RuntimeError("the pool node is going down")
        log.info("tenant %s: sidecar at %s", tenant.name, sidecars.addresses[0])
        return sidecars.addresses[0]

    def stop_tenant(self, name: str, why: str) -> None:
        with self._lock:
            sidecars = self.running.pop(name, None)
            self._heard.pop(name, None)
        if sidecars is not None:
            log.info("tenant %s: stopping its sidecar (%s)", name, why)
            sidecars.stop()

    def tenants(self, asking: str) -> tuple[list[str], dict[str, str]]:
        """The tenants served here, and why the sidecar of any of them ended; the agent asks
        about `asking` (its lease starts again)."""
        with self._lock:
            if asking in self.running:
                self.heard(asking)
            running = dict(self.running)
        exited = {name: why for name, s in running.items() if (why := s.exited())}
        return sorted(running), exited

    def _watch(self) -> None:
        while not self.stopped.wait(1.0):
            now = time.monotonic()
            with self._lock:
                silent = {name: now - self._heard.get(name, now) for name in self.running}
            for name, seconds in silent.items():
                if seconds > self.agent_lease:
                    self.stop_tenant(name, f"the pool agent has not asked about it for {seconds:.0f} s")

    def stop(self) -> None:
        """Stops every tenant's sidecar; the node's process then exits."""
        self.stopped.set()
        with self._starts:  # a start under way finishes first (and is stopped below)
            for name in list(self.running):
                self.stop_tenant(name, "the pool node is going down")
