"""`colocar demo`: sets up the data, the storage and a local cluster, runs `train.train` with a
host killed midway, then shows and writes the summary and the plot.

Runs in the controller. Exits 0 only if the loss fell, the test accuracy beat its floor, the
recovery came from the snapshots in RAM and the record stream was the uninterrupted run's;
otherwise 1 with a message per broken promise. The cluster and the GCS server are stopped on
every way out (Ctrl-C and SIGTERM included), so no process or /dev/shm file stays behind.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Iterator
from typing import Any

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

FULL: dict[str, Any] = {"steps": 400, "hidden": 128, "snapshot_every": 5, "save_every": 50, "floor": 0.9}
QUICK: dict[str, Any] = {"steps": 120, "hidden": 64, "snapshot_every": 5, "save_every": 40, "floor": 0.85}


def default_kill_step(steps: int, preset: dict[str, Any]) -> int:
    """Midway between two saves past the middle of the run: the snapshots since the last save
    had steps enough to reach their peers, so the recovery can come from RAM (a kill right after
    a save would find that save newer than every complete snapshot)."""
    save = preset["save_every"]
    return min((steps // 2) // save * save + save // 2 - 1, steps - 2)


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="colocar demo",
        description="Trains a small model on the handwritten digits with its input pipeline and "
        "checkpoints on local sidecars, kills a host midway and recovers from RAM.",
    )
    p.add_argument("--hosts", type=int, default=4, help="sidecar hosts, 2 CPU devices each (default 4)")
    p.add_argument("--steps", type=int, help=f"steps (default {FULL['steps']}, --quick {QUICK['steps']})")
    p.add_argument(
        "--kill-step",
        type=int,
        help="kill host1 after this step (default: between two saves past the middle; -1: no kill)",
    )
    p.add_argument(
        "--storage",
        default="gcs",
        help="where checkpoints go: 'gcs' (a local fake GCS server, the default), a directory, or gs://BUCKET/PATH",
    )
    p.add_argument("--out", default="demo-out", help="data, summary.json, demo.png (default demo-out/)")
    p.add_argument(
        "--batch",
        type=int,
        default=48,
        help="global batch of a new pipeline.yaml (48 divides 8, 6, 4 devices)",
    )
    p.add_argument("--quick", action="store_true", help="a run of under a minute through every stage")
    args = p.parse_args(argv)
    preset = QUICK if args.quick else FULL
    args.steps = args.steps or preset["steps"]
    args.kill_step = default_kill_step(args.steps, preset) if args.kill_step is None else args.kill_step
    args.kill_step = None if args.kill_step < 0 else args.kill_step
    if args.kill_step is not None and not 0 <= args.kill_step < args.steps - 1:
        p.error(f"--kill-step must be below --steps - 1 ({args.steps - 1})")
    if args.hosts < 2:
        p.error("--hosts must be at least 2 (one is killed)")
    args.preset = preset
    return args


@contextlib.contextmanager
def storage(spec: str, out: str) -> Iterator[tuple[str, dict[str, str]]]:
    """(checkpoint URL for this run, environment the sidecars need): a fresh run directory under
    a directory or bucket, or a bucket on a local fake GCS server started (and stopped) here."""
    run = time.strftime("run-%Y%m%d-%H%M%S")
    if spec == "gcs":
        from .gcs import serve

        with serve(out, "colocar-demo") as server:
            yield f"gs://colocar-demo/{run}", server.env
    elif spec.startswith("gs://"):
        yield f"{spec.rstrip('/')}/{run}", {}
    else:
        path = os.path.join(os.path.abspath(spec), run)
        os.makedirs(path, exist_ok=True)
        yield path, {}


def _terminate(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt  # unwinds through the cluster's and the server's cleanup


def settings_for(args: argparse.Namespace, config: str) -> Any:
    """The training settings of this run: the preset, the pipeline config, the kill."""
    from colocar.elastic import faults

    from . import train

    return train.Settings(
        config=config,
        storage="",  # set once the storage is up
        steps=args.steps,
        hidden=args.preset["hidden"],
        snapshot_every=args.preset["snapshot_every"],
        save_every=args.preset["save_every"],
        faults=[] if args.kill_step is None else [faults.kill("host1", at_step=args.kill_step)],
    )


def cluster_for(args: argparse.Namespace, env: dict[str, str]) -> Any:
    """`hosts` local sidecars with 2 devices each; small arenas. The killed sidecar is noticed at
    once (its sockets reset); the default 1 s heartbeat keeps a laptop that is busy for a
    moment from taking a slow host for a lost one."""
    import jax

    import colocar

    if jax.device_count() < 2 * args.hosts:
        raise RuntimeError(
            f"{args.hosts} hosts need {2 * args.hosts} devices, JAX has {jax.device_count()}: set "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={2 * args.hosts} before starting"
        )
    return colocar.local_cluster(
        hosts=args.hosts,
        devices=jax.devices()[: 2 * args.hosts],
        arena_size=32 << 20,
        lease_seconds=10,
        heartbeat_seconds=1.0,
        processes=0,
        env=env,
    )


def run(args: argparse.Namespace, display: Any) -> dict[str, Any]:
    """Data, storage, cluster, training, evaluation: the summary."""
    from colocar.loaders.config import load_config

    from . import data, scaleup, summary, train
    from .monitor import Monitor

    written = data.write(os.path.join(args.out, "data"), args.batch)
    display.note(
        f"data: {written['train']} train / {written['test']} test digits; pipeline: {written['config']}"
    )
    settings = settings_for(args, written["config"])
    args.batch = load_config(written["config"]).global_batch_size  # the file wins: it may be edited
    later = None if args.kill_step is None else min(args.steps - 2, args.kill_step + args.steps // 4)
    settings.faults += scaleup.fault("host1", later)  # the host back, when this colocar can
    monitor = Monitor(args.batch, display)
    with storage(args.storage, args.out) as (url, env):
        settings.storage = url
        display.note(f"checkpoints: {url}; starting {args.hosts} sidecars with 2 devices each")
        with cluster_for(args, env) as cluster, display:
            params, elastic = train.train(cluster, settings, monitor)
            monitor.finish(elastic)
    images, labels = data.read_test(os.path.join(args.out, "data"))
    where = url if args.storage != "gcs" else f"{url} (local fake GCS server, gone with the demo)"
    return summary.build(
        monitor,
        elastic,
        {
            "hosts": args.hosts,
            "steps": args.steps,
            "kill_step": args.kill_step,
            "scale_up_at": later,
            "global_batch": args.batch,
            "storage": where,
            "plot": os.path.join(args.out, "demo.png"),
            "quick": args.quick,
            "test_accuracy": round(train.accuracy(params, images, labels), 4),
            "accuracy_floor": args.preset["floor"],
            "reference": summary.reference_stream(written["config"], written["train"], args.steps),
            "_monitor": monitor,
        },
    )


def report(result: dict[str, Any], display: Any) -> int:
    """Writes summary.json and the plot, shows the table; the exit status."""
    from . import plot, summary

    monitor = result.pop("_monitor")
    problems = summary.checks(result)
    result["passed"], result["problems"] = not problems, problems
    title = f"colocar demo: {result['hosts']} hosts, host1 killed after step {result['kill_step']}"
    if result["scale_up"]["ran"]:
        title += f", back at step {result['scale_up']['step']}"
    plot.draw(result["plot"], monitor.steps, monitor.events, title)
    with open(os.path.join(os.path.dirname(result["plot"]), "summary.json"), "w") as f:
        json.dump(result, f, indent=2)
    display.summary(summary.rows(result), not problems)
    for problem in problems:
        print(f"colocar demo: {problem}", file=sys.stderr)
    return 0 if not problems else 1


def main(argv: list[str]) -> None:
    from .display import Display

    args = parse(argv)
    os.makedirs(args.out, exist_ok=True)
    logging.getLogger("colocar.elastic").addHandler(logging.NullHandler())  # the display shows them
    signal.signal(signal.SIGTERM, _terminate)
    signal.signal(signal.SIGINT, _terminate)  # also when started in the background (SIGINT ignored)
    display = Display(args.steps, every=max(1, args.steps // 20))
    started = time.monotonic()
    try:
        result = run(args, display)
    except RuntimeError as e:  # no devices enough, the GCS server did not start: one line
        print(f"colocar demo: error: {e}", file=sys.stderr)
        sys.exit(1)
    result["wall_seconds"] = round(time.monotonic() - started, 1)
    sys.exit(report(result, display))
