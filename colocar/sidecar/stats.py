"""Counters and call latency of a sidecar, reported by the Stats RPC and its metrics endpoint."""

from __future__ import annotations

import collections
import threading
import time
from typing import Any

import numpy as np

LATENCY_WINDOW = 4096


class Stats:
    def __init__(self) -> None:
        self.started = time.monotonic()
        self.calls = 0
        self.errors = 0
        self.in_flight = 0
        self._latencies: collections.deque[float] = collections.deque(maxlen=LATENCY_WINDOW)
        self._lock = threading.Lock()
        # Every call's duration, cumulative: a Prometheus histogram set by the metrics endpoint
        # (`metrics.MetricsEndpoint.attach`, before the first call), else None.
        self.latency: Any = None

    def count_latency(self, histogram: Any) -> None:
        """From now on each call's duration is observed by `histogram` too."""
        with self._lock:
            self.latency = histogram

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
            if self.latency is not None:  # under the lock: its count always equals `calls`
                self.latency.observe(elapsed)

    def latency_us(self) -> tuple[float, float]:
        """p50 and p99 over the last calls, in microseconds."""
        with self._lock:
            values = np.array(self._latencies)
        if values.size == 0:
            return 0.0, 0.0
        p50, p99 = np.percentile(values, [50, 99]) * 1e6
        return float(p50), float(p99)
