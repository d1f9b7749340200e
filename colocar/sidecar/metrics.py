"""Prometheus metrics of a sidecar on an HTTP port, off unless `--metrics-port` is given.

Runs in the sidecar. Each endpoint has its own `CollectorRegistry` (never the global one), so
several sidecars in one process never collide. What the sidecar counts already (calls, errors,
sessions, objects, the arena's pools) is read when Prometheus scrapes, by `SidecarCollector`;
events of the sidecar-side libraries are counted where they happen, in this process's
instruments below: loader pipelines (`loaders/pump.py`: batches, bad records, ring slots in use)
and checkpoint writers (`checkpoint/backends/writer.py`: bytes written, saves and durations).
The list of metrics, and how to scrape them, is in docs/metrics.md.
"""

from __future__ import annotations

import sys
import threading
import weakref
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.registry import Collector

from . import instruments

if TYPE_CHECKING:
    from .service import SidecarService

PATH = "/metrics"  # what start_http_server serves (any path, in fact); the k8s annotations name it
# Seconds: a call takes from about 100 us (an empty call) to minutes (a whole save or epoch).
CALL_BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 60)
SAVE_BUCKETS = (0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, float("inf"))

# Counted where they happen, in every sidecar-side process; exported by this process's endpoint.
LOADER_BATCHES = Counter(
    "colocar_loader_batches", "Batches the loader pipelines of this sidecar finished", registry=None
)
LOADER_BAD_RECORDS = Counter(
    "colocar_loader_bad_records", "Records the pipelines skipped as bad (error policy)", registry=None
)
CHECKPOINT_BYTES = Counter(
    "colocar_checkpoint_written_bytes", "Array bytes the checkpoint writers made durable", registry=None
)
CHECKPOINT_SAVES = Counter(
    "colocar_checkpoint_saves",
    "Saves of a step that ended on this host, by outcome: done (this host's part is durable), "
    "committed (the primary wrote the commit marker), failed",
    ["outcome"],
    registry=None,
)
SAVE_OUTCOMES = ("done", "committed", "failed")
for _outcome in SAVE_OUTCOMES:  # each series exists from the start, at 0 (a rate needs two points)
    CHECKPOINT_SAVES.labels(_outcome)
CHECKPOINT_SECONDS = Histogram(
    "colocar_checkpoint_save_duration_seconds",
    "Seconds from a save's begin to this host's part being durable (the primary: to the commit)",
    buckets=SAVE_BUCKETS,
    registry=None,
)
_PIPELINES: weakref.WeakSet[Any] = weakref.WeakSet()  # the live pumps of loader pipelines
_PIPELINES_LOCK = threading.Lock()


def watch_pipeline(pump: Any) -> None:
    """A loader pipeline's pump (`loaders.pump.Pump`): its ring is reported while it runs."""
    with _PIPELINES_LOCK:
        _PIPELINES.add(pump)


def batch_finished(bad_records: int) -> None:
    LOADER_BATCHES.inc()
    if bad_records:
        LOADER_BAD_RECORDS.inc(bad_records)


def save_ended(outcome: str, seconds: float | None = None) -> None:
    """A step's save ended on this host; `seconds` for a durable part (not for a failure)."""
    CHECKPOINT_SAVES.labels(outcome).inc()
    if seconds is not None:
        CHECKPOINT_SECONDS.observe(seconds)


def _labelled(families: Iterable[Metric], labels: dict[str, str]) -> Iterator[Metric]:
    """The families with `labels` added to every sample (the host, on process-wide instruments)."""
    for family in families:
        family.samples = [s._replace(labels={**labels, **s.labels}) for s in family.samples]
        yield family


def _gauge(name: str, doc: str, value: float, host: str) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, doc, labels=["host"])
    family.add_metric([host], value)
    return family


def _counter(name: str, doc: str, value: float, host: str) -> CounterMetricFamily:
    family = CounterMetricFamily(name, doc, labels=["host"])
    family.add_metric([host], value)
    return family


class SidecarCollector(Collector):
    """Reads the sidecar's own counters at scrape time (no second bookkeeping); until `service`
    is set (the endpoint binds before the arena exists), only the process-wide instruments."""

    def __init__(self, host: str, version: str = "") -> None:
        self.host = host
        self.version = version
        self.service: SidecarService | None = None

    def collect(self) -> Iterator[Metric]:
        info = InfoMetricFamily("colocar_sidecar", "The sidecar", labels=["host"])
        info.add_metric([self.host], {"version": self.version})
        yield info
        if self.service is not None:
            yield from self._service(self.service)
            yield from self._pools(self.service)
        yield from self._pipelines()
        instruments = (
            LOADER_BATCHES,
            LOADER_BAD_RECORDS,
            CHECKPOINT_BYTES,
            CHECKPOINT_SAVES,
            CHECKPOINT_SECONDS,
        )
        for instrument in instruments:
            yield from _labelled(instrument.collect(), {"host": self.host})

    def _service(self, service: SidecarService) -> Iterator[Metric]:
        host, stats = self.host, service.stats
        yield _counter("colocar_calls", "Calls that ended (returned or raised)", stats.calls, host)
        yield _counter(
            "colocar_call_errors", "Calls that raised (in the shipped code or here)", stats.errors, host
        )
        yield _gauge("colocar_calls_in_flight", "Calls running now", stats.in_flight, host)
        yield _gauge(
            "colocar_calls_abandoned",
            "Cancelled calls whose thread still runs (a thread cannot be stopped)",
            service.cancels.abandoned(),
            host,
        )
        if stats.latency is not None:
            yield from _labelled(stats.latency.collect(), {"host": host})
        yield _gauge("colocar_sessions", "Controller sessions open", len(service.sessions), host)
        yield _gauge(
            "colocar_objects", "Remote objects alive (colocated_class instances)", len(service.objects), host
        )
        workers = len(service.workers) if service.workers else 0
        yield _gauge(
            "colocar_worker_processes", "Call worker processes (processes=True calls)", workers, host
        )
        yield _gauge("colocar_arena_size_bytes", "Bytes of the arena file", service.arena.arena.size, host)

    def _pools(self, service: SidecarService) -> Iterator[Metric]:
        """The arena's pools: bytes reserved, used (alignment included), peak, free, largest free
        run, and blocks."""
        names = {
            "reserved": ("colocar_arena_pool_reserved_bytes", "Bytes of the arena reserved for the pool"),
            "used": ("colocar_arena_pool_used_bytes", "Bytes of the pool in blocks now"),
            "peak": ("colocar_arena_pool_peak_bytes", "Most bytes of the pool in blocks at once"),
            "free": ("colocar_arena_pool_free_bytes", "Bytes of the pool not in blocks"),
            "largest_free": (
                "colocar_arena_pool_largest_free_bytes",
                "The largest block the pool can give now",
            ),
            "blocks": ("colocar_arena_pool_blocks", "Blocks of the pool now"),
        }
        families = {
            key: GaugeMetricFamily(name, doc, labels=["host", "pool"]) for key, (name, doc) in names.items()
        }
        for pool, values in service.arena.allocator.stats().items():
            values = {**values, "free": values["reserved"] - values["used"]}
            for key, family in families.items():
                family.add_metric([self.host, pool], values[key])
        yield from families.values()

    def _pipelines(self) -> Iterator[Metric]:
        """The running loader pipelines and their rings' slots (in use: written or held)."""
        with _PIPELINES_LOCK:
            pumps = [p for p in _PIPELINES if not p.stopped]
        slots = in_use = running = 0
        for pump in pumps:
            try:
                slots, in_use = slots + len(pump.ring), in_use + pump.ring.in_use()
                running += 1
            except Exception:  # noqa: BLE001 - it stopped meanwhile: no longer running
                continue
        yield _gauge("colocar_loader_pipelines", "Loader pipelines running here", running, self.host)
        yield _gauge("colocar_loader_ring_slots", "Ring slots of the running pipelines", slots, self.host)
        yield _gauge(
            "colocar_loader_ring_slots_in_use",
            "Ring slots being written or still held by the trainer (all of them: the trainer is slow)",
            in_use,
            self.host,
        )


class MetricsEndpoint:
    """`/metrics` over HTTP on `host:port` (port 0: any free one), served from a thread."""

    def __init__(self, host: str, port: int, label: str, version: str = "") -> None:
        instruments.enable(sys.modules[__name__])
        self.collector = SidecarCollector(label, version)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self.collector)
        ProcessCollector(registry=self.registry)  # CPU seconds, resident memory, open files
        self._server, self._thread = start_http_server(port, host, self.registry)
        bound = self._server.server_address
        self.address = f"{host}:{bound[1]}" if ":" not in host else f"[{host}]:{bound[1]}"

    def attach(self, service: SidecarService) -> None:
        """From now on the service's counters are reported too (its calls' durations from its
        first call: the sidecar attaches before it serves)."""
        if service.stats.latency is None:
            doc = "Seconds a call took here"
            service.stats.count_latency(
                Histogram("colocar_call_duration_seconds", doc, buckets=CALL_BUCKETS, registry=None)
            )
        self.collector.service = service

    def close(self) -> None:
        """Stops serving and frees the port."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)
