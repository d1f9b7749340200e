"""Counters and call latency of a sidecar, reported by the Stats RPC and its metrics endpoint."""

from __future__ import annotations

import collections
import threading
import time

import numpy as np
from prometheus_client import Histogram

LATENCY_WINDOW = 4096
# Seconds: a call takes from about 100 us (an empty call) to minutes (a whole save or epoch).
CALL_BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 60)


class Stats:
    def __init__(self) -> None:
        self.started = time.monotonic()
        self.calls = 0
        self.errors = 0
        self.in_flight = 0
        self._latencies: collections.deque[float] = collections.deque(maxlen=LATENCY_WINDOW)
        self._lock = threading.Lock()
        # Every call's duration, cumulative (the endpoint of `metrics` exports it; no registry here).
        self.latency = Histogram(
            "colocar_call_duration_seconds", "Seconds a call took here", buckets=CALL_BUCKETS, registry=None
        )

    def begin(self) -> float:
        with self._lock:
            self.in_flight += 1
        return time.perf_counter()

    def end(self, started: float, failed: bool) -> None:
        elapsed = time.perf_counter() - started
        with self._lock:
            self.in_flight -= 1
            self.calls += 1
            self.errors += failed
            self._latencies.append(elapsed)
            self.latency.observe(elapsed)  # under the lock: its count always equals `calls`

    def latency_us(self) -> tuple[float, float]:
        """p50 and p99 over the last calls, in microseconds."""
        with self._lock:
            values = np.array(self._latencies)
        if values.size == 0:
            return 0.0, 0.0
        p50, p99 = np.percentile(values, [50, 99]) * 1e6
        return float(p50), float(p99)
