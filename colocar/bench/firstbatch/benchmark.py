"""The firstbatch benchmark's runs and summary: `run(quick, repeats)`; what it measures is in
the package's docstring (`colocar/bench/firstbatch/__init__.py`).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np

from colocar.bench import child_env
from colocar.bench.firstbatch import systems

SYSTEMS = ("colocar", "grain")
MODES = ("fresh", "resume")
FILES, PER_FILE = 2, 256
CHILD = "import sys; sys.path.pop(0); from colocar.bench.firstbatch.systems import main; main()"


def write_records(directory: str) -> None:
    from array_record.python.array_record_module import ArrayRecordWriter

    os.makedirs(os.path.join(directory, "data"))
    rng = np.random.default_rng(0)
    for f in range(FILES):
        path = os.path.join(directory, "data", f"images-{f:02d}.array_record")
        writer = ArrayRecordWriter(path, "group_size:1")
        for i in range(PER_FILE):
            image = rng.integers(0, 256, systems.SHAPE, dtype=np.uint8)
            writer.write(image.tobytes() + np.int32(f * PER_FILE + i).astype("<i4").tobytes())
        writer.close()


def child(system: str, mode: str, directory: str, retries: list[str] | None = None) -> dict[str, Any]:
    """Runs one script; its phases as seconds since the start, its labels and peak RSS.

    A script that fails with a sidecar found lost (on a heavily oversubscribed machine a
    sidecar can miss its keepalive deadline while it imports a module) runs once more; each
    such retry is appended to `retries`, which the result reports."""
    env = {**child_env(), "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    for attempt in range(2):
        started = time.time()
        done = subprocess.run(
            [sys.executable, "-c", CHILD, system, mode, directory],
            capture_output=True,
            text=True,
            env=env,
            timeout=300,
            cwd=directory,
        )
        if done.returncode == 0:
            break
        if attempt == 0 and "HostLostError" in done.stderr and retries is not None:
            retries.append(f"{system} {mode}: {done.stderr.strip().splitlines()[-1][:200]}")
            continue
        raise RuntimeError(f"{system} {mode} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    out = json.loads(done.stdout.strip().splitlines()[-1])
    out["phases"] = {k: round(v - started, 3) for k, v in out.pop("marks").items()}
    return out


def _median(values: list[float]) -> float:
    return round(statistics.median(values), 3)


Results = dict[tuple[str, str], list[dict[str, Any]]]


def _summary(results: Results, repeats: int, quick: bool) -> dict[str, Any]:
    out: dict[str, Any] = {"benchmark": "firstbatch", "quick": quick, "repeats": repeats}
    for mode in MODES:
        for system in SYSTEMS:
            runs = results[(system, mode)]
            out[f"{system}_{mode}_s"] = _median([r["phases"]["first_batch"] for r in runs])
        out[f"{mode}_ratio"] = round(out[f"colocar_{mode}_s"] / out[f"grain_{mode}_s"], 3)
    for system in SYSTEMS:
        rss = [r["peak_rss_mib"] for mode in MODES for r in results[(system, mode)]]
        out[f"{system}_peak_rss_mib"] = round(statistics.median(rss), 1)
    out["peak_rss_ratio"] = round(out["colocar_peak_rss_mib"] / out["grain_peak_rss_mib"], 3)
    for (system, mode), runs in results.items():
        out[f"{system}_{mode}_s_per_round"] = [r["phases"]["first_batch"] for r in runs]
        phases = {k for r in runs for k in r["phases"]}
        out[f"{system}_{mode}_phases"] = {k: _median([r["phases"][k] for r in runs]) for k in sorted(phases)}
    return out


def run(quick: bool, repeats: int) -> dict:
    """Writes the records, saves a checkpoint with each system, then times fresh and resumed
    starts, alternating systems (order rotating per round)."""
    rounds = min(repeats, 2) if quick else repeats
    directory = tempfile.mkdtemp(prefix="colocar-bench-firstbatch-")
    try:
        write_records(directory)
        retries: list[str] = []
        expected = {s: child(s, "save", directory, retries)["labels"] for s in SYSTEMS}
        results: Results = {(s, m): [] for s in SYSTEMS for m in MODES}
        for r in range(rounds):
            for system in SYSTEMS[r % 2 :] + SYSTEMS[: r % 2]:
                for mode in MODES:
                    out = child(system, mode, directory, retries)
                    if mode == "resume" and out["labels"] != expected[system]:
                        raise RuntimeError(f"{system} resumed at the wrong batch: {out['labels']}")
                    results[(system, mode)].append(out)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    return {**_summary(results, rounds, quick), "retries": retries}
