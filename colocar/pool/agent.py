"""The pool's agent: admits tenants, runs their sidecars, stops the idle ones, reports the pool.

Runs as its own long-lived process (`colocar pool up` starts it; `agent_main.py`). Every
`Pool` RPC carries a token: a tenant's (from the tenants file) or the pool's admin token.
`Admit` queues the tenant (`admission.py`), then starts its sidecars if they are not running
(on this machine, `tenant_sidecars.py`, or on the pool's nodes, `nodes.py`), and answers
their addresses. A tenant whose sidecars held no session for
`idle_seconds` is stopped, and its room goes to the queue; so is one whose sidecar died (its
state is gone: its next job starts fresh ones), and one removed from the tenants file. What a
job held is freed by its sidecars when it ends or dies (its session's lease): the pool never
needs a restart to reclaim it.
"""

from __future__ import annotations

import hmac
import logging
import queue
import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc

from colocar.errors import PoolFullError
from colocar.protocol import colocar_pb2 as pb
from colocar.protocol.tokens import TOKEN_METADATA_KEY

from .admission import Admission
from .metrics import PoolMetrics
from .nodes import NodeTenantSidecars, PoolNodes
from .tenant_sidecars import LocalHosts, TenantSidecars
from .tenants import Tenant, TenantsFile

Hosts = LocalHosts | PoolNodes  # where tenants' sidecars run: this machine, or the pool's nodes
Sidecars = TenantSidecars | NodeTenantSidecars

log = logging.getLogger("colocar.pool")
ADMIN = "admin"


class PoolAgent:
    """The state behind the `Pool` service (its handlers: `agent_grpc.py`)."""

    def __init__(
        self, tenants_path: str, admin_token: str, hosts: Hosts, *, capacity: int, max_tenants: int,
        idle_seconds: float,
    ):  # fmt: skip
        self.hosts, self.idle_seconds = hosts, idle_seconds
        self._admin = admin_token
        self.admission = Admission(capacity, max_tenants)
        self.running: dict[str, Sidecars] = {}
        self._idle_since: dict[str, float] = {}
        self._use: dict[str, list[dict[str, Any]]] = {}
        self._lock = threading.RLock()  # starting and stopping tenants' sidecars
        self.metrics: PoolMetrics | None = None  # `agent_main` starts it with --metrics-port
        self.stopped = threading.Event()
        self._stopping = threading.Lock()
        self.tenants = TenantsFile(tenants_path, on_change=self._tenants_changed)
        threading.Thread(target=self._watch, name="colocar-pool-watch", daemon=True).start()

    # --- who calls ---------------------------------------------------------------------------
    def caller(self, metadata: Any) -> Tenant | str | None:
        """The tenant whose token the call carries, ADMIN for the admin token, else None."""
        token = next((v for k, v in metadata or () if k == TOKEN_METADATA_KEY), "")
        if not token:
            return None
        if hmac.compare_digest(token.encode(), self._admin.encode()):
            return ADMIN
        return self.tenants.who(token)

    # --- admitting ---------------------------------------------------------------------------
    def admit(self, tenant: Tenant, wait: bool, timeout: float, updates: queue.Queue, gone: Any) -> Sidecars:
        """`tenant`'s sidecars once it is served (queued meanwhile, each
        position change put on `updates`); PoolFullError when it would not wait, timed out, or
        its caller left (`gone()`)."""

        def update(position: int, estimate: float, waiting: int) -> None:
            updates.put(pb.AdmitUpdate(position=position, estimated_wait_seconds=estimate, waiting=waiting))

        while True:
            queued = self.admission.admit(tenant, wait, timeout, update, gone)
            if queued is not None and self.metrics is not None:
                self.metrics.queue_wait.labels(tenant.name).observe(queued)
            with self._lock:
                if self.stopped.is_set():
                    raise PoolFullError("the pool is going down")
                if tenant.name in self.running:  # a job about to connect: not idle
                    self._idle_since[tenant.name] = time.monotonic()
                    return self.running[tenant.name]
                if queued is not None:
                    return self._start(tenant)
            time.sleep(0.05)  # served, but its idle sidecars are stopping: queue again once they are

    def _start(self, tenant: Tenant) -> Sidecars:
        try:
            sidecars = self.hosts.start(tenant)
        except BaseException:
            self.admission.release(tenant.name)
            raise
        self.running[tenant.name] = sidecars
        self._idle_since[tenant.name] = time.monotonic()
        log.info("tenant %s served: sidecars at %s", tenant.name, ", ".join(sidecars.addresses))
        return sidecars

    def _stop(self, name: str, why: str) -> None:
        with self._lock:
            sidecars = self._take(name)
        self._finish(name, sidecars, why)

    def _take(self, name: str) -> Sidecars | None:
        """The tenant leaves `running` (under the lock): no admit hands out its addresses now."""
        self._idle_since.pop(name, None)
        self._use.pop(name, None)
        return self.running.pop(name, None)

    def _finish(self, name: str, sidecars: Sidecars | None, why: str) -> None:
        if sidecars is not None:
            log.info("tenant %s: stopping its sidecars (%s)", name, why)
            sidecars.stop()
            self.admission.release(name)

    # --- watching ----------------------------------------------------------------------------
    def _watch(self) -> None:
        while not self.stopped.wait(1.0):
            for name in list(self.running):
                try:
                    self._check(name)
                except Exception:  # noqa: BLE001 - the watch goes on for the others
                    log.exception("tenant %s: checking its sidecars failed", name)

    def _check(self, name: str) -> None:
        sidecars = self.running.get(name)
        if sidecars is None:
            return
        if why := sidecars.exited():
            self._stop(name, f"a sidecar is gone: {why}")
            return
        use, now = sidecars.stats(), time.monotonic()
        with self._lock:  # decided together with the admits that hand out its addresses
            if self.running.get(name) is not sidecars:
                return
            self._use[name] = use
            if any(h.get("sessions", 1) for h in use):  # a host that did not answer counts as busy
                self._idle_since[name] = now
                return
            if now - self._idle_since.get(name, now) < self.idle_seconds:
                return
            self._take(name)
        self._finish(name, sidecars, f"no session for {self.idle_seconds:.0f} s")

    def use_of(self, name: str) -> list[dict[str, Any]]:
        """What the tenant's sidecars said at the last look, host by host ([] when not served)."""
        return self._use.get(name, [])

    def _tenants_changed(self, old: dict[str, Tenant], new: dict[str, Tenant]) -> None:
        for name in list(self.running):
            if name not in new:
                self._stop(name, "removed from the tenants file")
            elif new[name] != old.get(name):
                self.running[name].rotate(new[name])

    # --- reporting and stopping --------------------------------------------------------------
    def status(self, caller: Tenant | str) -> dict[str, Any]:
        """The pool as JSON-able data; a tenant sees its own entry and the queue's length."""
        mine = None if caller == ADMIN else caller.name  # type: ignore[union-attr]
        tenants = {
            name: self._tenant_status(t) for name, t in self.tenants.tenants.items() if mine in (None, name)
        }
        waiting = self.admission.queue()
        out: dict[str, Any] = {
            "tenants": tenants,
            "queue": [w for w in waiting if mine in (None, w["tenant"])],
            "waiting": len(waiting),
            "capacity": self.admission.capacity,
            "max_tenants": self.admission.max_tenants,
            "served": len(self.admission.served),
            "hosts": self.hosts.count,
        }
        if mine is None:
            out["tenants_file_error"] = self.tenants.error
            out["queue_waits"] = list(self.admission.waits)
        return out

    def _tenant_status(self, tenant: Tenant) -> dict[str, Any]:
        sidecars = self.running.get(tenant.name)
        return {
            "priority": tenant.priority,
            "quotas": tenant.quotas(),
            "served": sidecars is not None,
            "addresses": sidecars.addresses if sidecars else [],
            "hosts": self._use.get(tenant.name, []),
        }

    def stop(self) -> None:
        """Stops every tenant's sidecars; the agent's process then exits. A second caller
        (a signal during a Shutdown) returns once the first is done."""
        self.stopped.set()
        with self._stopping:
            self.tenants.close()
            for name in list(self.running):
                self._stop(name, "the pool is going down")
            self.hosts.close()


def admit_stream(agent: PoolAgent, tenant: Tenant, request: Any, context: Any) -> Iterator[pb.AdmitUpdate]:
    """The Admit RPC: the tenant's queue updates as they come, then its sidecars' addresses."""
    updates: queue.Queue = queue.Queue()
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["sidecars"] = agent.admit(
                tenant, request.wait, request.timeout_seconds, updates, lambda: not context.is_active()
            )
        except Exception as e:  # noqa: BLE001 - the caller hears of it below
            outcome["error"] = e
        updates.put(None)

    threading.Thread(target=run, name=f"colocar-admit-{tenant.name}", daemon=True).start()
    while (update := updates.get()) is not None:
        update.tenant = tenant.name
        yield update
    if isinstance(outcome.get("error"), PoolFullError):
        context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(outcome["error"]))
    if "error" in outcome:
        context.abort(
            grpc.StatusCode.INTERNAL,
            f"starting tenant {tenant.name!r}'s sidecars: {outcome['error']}",
        )
    sidecars = outcome["sidecars"]
    yield pb.AdmitUpdate(tenant=tenant.name, addresses=sidecars.addresses, machines=sidecars.machines)
