"""The demo's summary: what the run measured and whether it did what the demo promises.

Runs in the controller, after the run. `build` turns the monitor's record and the elastic
manager's stats into the JSON summary; `checks` lists the promises (the loss fell, the test
accuracy beat its floor, recovery came from RAM, the record stream is the uninterrupted run's)
with a message for each one broken.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from colocar.loaders.config import load_config
from colocar.loaders.sampler import IndexSampler


def reference_stream(config: str, num_records: int, steps: int) -> list[list[int]]:
    """The record ids of batches 0..steps-1 as an uninterrupted run reads them."""
    cfg = load_config(config)
    sampler = IndexSampler.for_config(cfg, num_records)
    return [sampler.batch_indices(k).tolist() for k in range(steps)]


def _blocked(stats: dict[str, Any], kind: str) -> float | None:
    count = stats["counts"].get(kind, 0)
    return round(1000 * stats["seconds"].get(kind, 0.0) / count, 2) if count else None


def _share(stats: dict[str, Any], kind: str, monitor: Any) -> float | None:
    """The share of the training loop's wall time (first step to last) that `kind` blocked it."""
    if len(monitor.steps) < 2:
        return None
    loop = monitor.steps[-1].time - monitor.steps[0].time
    return round(stats["seconds"].get(kind, 0.0) / loop, 4) if loop > 0 else None


def _recovery(monitor: Any) -> tuple[str | None, int | None]:
    """Where the state came back from after the first loss, and its step (a later scale-up
    restores again, from the kept state: not a recovery)."""
    event = next((e for e in monitor.events if e["kind"] == "recovery"), None)
    if event is None:
        return None, None
    return str(event["detail"]).removeprefix("from "), event["step"]


def build(monitor: Any, elastic: Any, run: dict[str, Any]) -> dict[str, Any]:
    """The summary of a finished run; `run` holds what the caller knows (settings, paths,
    accuracy, the reference stream under "reference", the scale-up step under "scale_up_at")."""
    from . import scaleup

    stats = elastic.stats()
    timed = [s for s in monitor.steps if s.seconds == s.seconds]  # not an attempt's first step
    steady = [s.seconds for s in timed[5:] if s.attempt == 1] or [s.seconds for s in timed] or [float("nan")]
    recovery = None
    if monitor.kill_time is not None and monitor.first_step_after_kill is not None:
        recovery = round(monitor.first_step_after_kill - monitor.kill_time, 3)
    losses = [s.loss for s in monitor.steps]
    reference = run.pop("reference")
    restored_from, restored_step = _recovery(monitor)
    return {
        **run,
        "steps_run": len(monitor.steps),
        "throughput_examples_per_s": round(run["global_batch"] / float(np.median(steady)), 1),
        "snapshot_blocked_ms": _blocked(stats, "snapshot"),
        "snapshot_share": _share(stats, "snapshot", monitor),
        "save_blocked_ms": _blocked(stats, "save"),
        "snapshots": stats["counts"].get("snapshot", 0),
        "saves": stats["counts"].get("save", 0),
        "host_losses": stats["counts"].get("loss", 0),
        "recovery_seconds": recovery,
        "restored_from": restored_from,
        "restored_step": restored_step,
        "steps_lost": monitor.steps_lost(),
        "lost_hosts": sorted({h for e in monitor.events if e["kind"] == "loss" for h in e["hosts"]}),
        "hosts_at_end": stats["hosts"],
        "record_stream_intact": monitor.trained_on() == reference,
        "loss_first": round(float(np.mean(losses[:5])), 4),
        "loss_last": round(float(np.mean(losses[-5:])), 4),
        "scale_up": scaleup.result(monitor.events, run["scale_up_at"]),
    }


def checks(summary: dict[str, Any]) -> list[str]:
    """What went wrong, one message each (empty: the demo did what it promises)."""
    problems = []
    if not summary["loss_last"] < 0.5 * summary["loss_first"]:
        start, end = summary["loss_first"], summary["loss_last"]
        problems.append(f"the loss did not fall (to half or less): {start} at the start, {end} at the end")
    if not summary["test_accuracy"] > summary["accuracy_floor"]:
        problems.append(
            f"test accuracy {summary['test_accuracy']:.3f} is not above the floor {summary['accuracy_floor']}"
        )
    if summary["kill_step"] is not None:
        if summary["host_losses"] < 1:
            problems.append(f"the host killed at step {summary['kill_step']} was never seen lost")
        elif summary["restored_from"] != "snapshot":
            problems.append(f"recovery came from {summary['restored_from']}, not from the snapshots in RAM")
    if not summary["record_stream_intact"]:
        problems.append("the records trained on differ from an uninterrupted run's record stream")
    return problems


def rows(summary: dict[str, Any]) -> list[tuple[str, str]]:
    """The summary table's rows, for the display."""
    recovery = summary["recovery_seconds"]
    scale = summary["scale_up"]
    return [
        ("steps", f"{summary['steps_run']} run for {summary['steps']} ({summary['steps_lost']} replayed)"),
        ("throughput", f"{summary['throughput_examples_per_s']:.0f} examples/s"),
        (
            "snapshot (RAM)",
            f"{summary['snapshots']} taken, {summary['snapshot_blocked_ms']} ms blocked each, "
            f"{100 * (summary['snapshot_share'] or 0):.1f}% of the training time",
        ),
        ("checkpoint save", f"{summary['saves']} started, {summary['save_blocked_ms']} ms blocked each"),
        ("host lost", ", ".join(summary["lost_hosts"]) or "none"),
        ("recovery", "-" if recovery is None else f"{recovery:.2f} s from kill to the next step"),
        ("restored from", f"{summary['restored_from']} (step {summary['restored_step']})"),
        ("record stream", "intact" if summary["record_stream_intact"] else "DIFFERS"),
        (
            "scale-up",
            f"back to {len(summary['hosts_at_end'])} hosts at step {scale['step']} in {scale['seconds']} s"
            if scale["ran"]
            else f"skipped: {scale['reason']}",
        ),
        ("loss", f"{summary['loss_first']} -> {summary['loss_last']}"),
        ("test accuracy", f"{summary['test_accuracy']:.3f} (floor {summary['accuracy_floor']})"),
        ("checkpoints", summary["storage"]),
        ("plot", summary["plot"]),
    ]
