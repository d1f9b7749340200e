"""Where sidecar-side code reports events for the metrics endpoint, at no cost without one.

Loader pumps and checkpoint writers report here; the reports reach the Prometheus instruments
of `metrics.py` only once a `--metrics-port` endpoint has loaded them (`enable`). A sidecar
without metrics never imports prometheus_client (about 3 MiB and its import time per sidecar).
"""

from __future__ import annotations

from typing import Any

_sink: Any = None  # the `metrics` module, once an endpoint enabled it


def enable(sink: Any) -> None:
    """From now on the reports go to `sink` (the `metrics` module)."""
    global _sink
    _sink = sink


def watch_pipeline(pump: Any) -> None:
    """A loader pipeline's pump: its ring is reported while it runs."""
    if _sink is not None:
        _sink.watch_pipeline(pump)


def batch_finished(bad_records: int) -> None:
    if _sink is not None:
        _sink.batch_finished(bad_records)


def bytes_written(nbytes: int) -> None:
    """Array bytes a checkpoint writer made durable."""
    if _sink is not None:
        _sink.CHECKPOINT_BYTES.inc(nbytes)


def save_ended(outcome: str, seconds: float | None = None) -> None:
    """A step's save ended on this host; `seconds` for a durable part (not for a failure)."""
    if _sink is not None:
        _sink.save_ended(outcome, seconds)
