"""The pool's Prometheus metrics, per tenant: calls, arena use, sessions, quota refusals, queue.

Runs in the pool's agent, off unless `--metrics-port` is given. What the tenants' sidecars
count is read from the agent's last look at them (it asks each host's Stats every second);
the queue's waits are observed as tenants are admitted. Every series carries `tenant`; the
names are listed in docs/metrics.md ("A shared pool").
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Protocol

from prometheus_client import CollectorRegistry, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from .admission import Admission
    from .tenants import TenantsFile


class AgentView(Protocol):
    """What the metrics read of the agent (`agent.PoolAgent` is one); a protocol, so that this
    module does not import `agent` (which imports it)."""

    tenants: TenantsFile
    running: dict[str, Any]
    admission: Admission

    def use_of(self, name: str) -> list[dict[str, Any]]: ...


WAIT_BUCKETS = (0.1, 1, 5, 15, 60, 300, 900, 3600, float("inf"))


class PoolCollector(Collector):
    """Reads the agent's view of every tenant when Prometheus scrapes."""

    def __init__(self, agent: AgentView):
        self.agent = agent

    def collect(self) -> Iterator[Metric]:
        served = GaugeMetricFamily(
            "colocar_pool_tenant_served", "1 while the tenant's sidecars run", labels=["tenant"]
        )
        quota = GaugeMetricFamily(
            "colocar_pool_tenant_quota",
            "The tenant's quotas (arena: bytes per host)",
            labels=["tenant", "quota"],
        )
        calls = CounterMetricFamily(
            "colocar_pool_tenant_calls",
            "Calls the tenant's sidecars served (since they started)",
            labels=["tenant"],
        )
        sessions = GaugeMetricFamily(
            "colocar_pool_tenant_sessions", "The tenant's open sessions", labels=["tenant"]
        )
        arena = GaugeMetricFamily(
            "colocar_pool_tenant_arena_used_bytes",
            "Arena bytes the tenant holds, all hosts",
            labels=["tenant"],
        )
        moved = CounterMetricFamily(
            "colocar_pool_tenant_arena_allocated_bytes",
            "Bytes of the arena blocks the tenant's data went through, all hosts (since its sidecars began)",
            labels=["tenant"],
        )
        refusals = CounterMetricFamily(
            "colocar_pool_tenant_quota_refusals", "Requests refused by a quota", labels=["tenant", "quota"]
        )
        for name, tenant in self.agent.tenants.tenants.items():
            use = self.agent.use_of(name)
            served.add_metric([name], float(name in self.agent.running))
            for key, value in tenant.quotas().items():
                quota.add_metric([name, key], value)
            calls.add_metric([name], sum(h.get("calls", 0) for h in use))
            sessions.add_metric([name], sum(h.get("sessions", 0) for h in use))
            arena.add_metric([name], sum(h.get("arena_used", 0) for h in use))
            moved.add_metric([name], sum(h.get("arena_allocated", 0) for h in use))
            for key in ("sessions", "concurrent calls", "arena"):
                refusals.add_metric([name, key], sum(h.get("quota_refusals", {}).get(key, 0) for h in use))
        waiting = GaugeMetricFamily("colocar_pool_queue_waiting", "Tenants waiting in the admission queue")
        waiting.add_metric([], len(self.agent.admission.queue()))
        yield from (served, quota, calls, sessions, arena, moved, refusals, waiting)


class PoolMetrics:
    """`/metrics` of the agent on `host:port` (port 0: any free one)."""

    def __init__(self, agent: AgentView, host: str, port: int):
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(PoolCollector(agent))
        self.queue_wait = Histogram(
            "colocar_pool_queue_wait_seconds",
            "Seconds a tenant waited in the admission queue before it was served",
            ["tenant"],
            buckets=WAIT_BUCKETS,
            registry=self.registry,
        )
        self._server, self._thread = start_http_server(port, host, self.registry)
        self.address = f"{host}:{self._server.server_address[1]}"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
