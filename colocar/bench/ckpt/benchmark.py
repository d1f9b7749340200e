"""The ckpt benchmark's rounds and summary: `run(quick, repeats)`; what it measures is in the
package's docstring (`colocar/bench/ckpt/__init__.py`).
"""

from __future__ import annotations

from colocar.bench import request_cpu_devices

_DEVICES_FLAG = request_cpu_devices(8)  # before JAX starts (`colocar bench` imports this module first)

import os  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402

from colocar.bench.ckpt.memory import Memory  # noqa: E402
from colocar.bench.ckpt.systems import (  # noqa: E402
    LAYERS,
    colocar_round,
    host_bytes,
    make_state,
    orbax_checkpointer,
    orbax_round,
    orbax_written_restores,
    rpcs_per_small_save,
)

MiB = 1 << 20
MESH_SHAPE = (4, 2)
ARENA_MARGIN = 16 * MiB  # on top of the bytes one host writes
BASELINE_SECONDS = 1.0  # --quick: half
SLOWDOWN_FLOOR = 0.02
SYSTEMS = ("colocar", "colocar_orbax", "orbax")  # colocar_orbax: colocar writing Orbax's layout
LAYOUT_OF = {"colocar": "colocar", "colocar_orbax": "orbax"}
RATIO_PREFIX = {"colocar": "", "colocar_orbax": "orbax_layout_"}  # colocar_orbax's ratios: orbax_layout_*
PER_ROUND = ("blocked_s", "durable_s", "restore_s", "train_slowdown", "durable_training_s", "train_lost_s")
# (key, scale, digits) of the figures reported per system, as medians over rounds
FIGURES = (
    ("blocked_s", 1, 3),
    ("durable_s", 1, 3),
    ("restore_s", 1, 3),
    ("train_slowdown", 1, 3),
    ("durable_training_s", 1, 3),
    ("train_lost_s", 1, 3),
    ("syncfs_s", 1, 4),
    ("step_ms", 1, 3),
    ("peak_host_mem", MiB, 1),
    ("restore_mem", MiB, 1),
)

Results = dict[str, list[dict[str, Any]]]


def _rounds(
    state: dict[str, Any], arena: int, rounds: int, baseline_s: float
) -> tuple[Results, dict[str, Any]]:
    """Every round of the systems (the order reversed every other round), in a temporary folder
    removed after; then the small-save RPC count and the restores of a checkpoint Orbax wrote.
    Returns each system's measurements and those figures."""
    root = tempfile.mkdtemp(prefix="colocar-bench-ckpt-")
    results: Results = {s: [] for s in SYSTEMS}
    memory = Memory()
    try:
        ckptr = orbax_checkpointer(state, root)
        try:
            for r in range(rounds):
                for system in SYSTEMS if r % 2 == 0 else SYSTEMS[::-1]:
                    directory = os.path.join(root, f"{system}-{r}")
                    os.makedirs(directory)
                    if system in LAYOUT_OF:
                        m = colocar_round(memory, state, directory, arena, baseline_s, LAYOUT_OF[system])
                    else:
                        m = orbax_round(memory, ckptr, state, directory, baseline_s)
                    results[system].append(m)
                    shutil.rmtree(directory)
            extra = orbax_written_restores(ckptr, state, root, arena, rounds)
        finally:
            ckptr.close()
        extra["rpcs_per_small_save"] = rpcs_per_small_save(state, os.path.join(root, "rpcs"))
    finally:
        memory.close()
        shutil.rmtree(root, ignore_errors=True)
    return results, extra


def _summary(head: dict[str, Any], results: Results, nbytes: int) -> dict[str, Any]:
    """The result: `head`, then the medians over rounds, the colocar / Orbax ratios (slowdown
    and lost time floored, see the module's doc) and the figures of each round."""

    def med(system: str, key: str) -> float:
        return statistics.median(m[key] for m in results[system])

    out = dict(head)
    for key, scale, digits in FIGURES:
        suffix = "_mib" if scale == MiB else ""
        for system in SYSTEMS:
            out[f"{system}_{key}{suffix}"] = round(med(system, key) / scale, digits)
    slow = {s: max(med(s, "train_slowdown"), SLOWDOWN_FLOOR) for s in SYSTEMS}
    lost = {s: max(med(s, "train_lost_s"), SLOWDOWN_FLOOR * med(s, "durable_training_s")) for s in SYSTEMS}
    for system, prefix in RATIO_PREFIX.items():  # each colocar layout against Orbax
        for key in ("arena_wait_s", "writer_durable_s"):
            out[f"{system}_{key}"] = round(med(system, key), 3)
        for key in ("blocked", "durable", "restore", "durable_training"):
            out[f"{prefix}{key}_ratio"] = round(med(system, f"{key}_s") / med("orbax", f"{key}_s"), 3)
        out[f"{prefix}train_slowdown_ratio"] = round(slow[system] / slow["orbax"], 3)
        out[f"{prefix}train_lost_ratio"] = round(lost[system] / lost["orbax"], 3)
        out[f"{prefix}peak_host_mem_ratio"] = round(med(system, "peak_host_mem") / nbytes, 3)
    out["orbax_peak_host_mem_ratio"] = round(med("orbax", "peak_host_mem") / nbytes, 3)
    for system in SYSTEMS:
        for key in PER_ROUND:
            out[f"{system}_{key}_per_round"] = [round(m[key], 3) for m in results[system]]
        mem = [round(m["peak_host_mem"] / MiB, 1) for m in results[system]]
        out[f"{system}_peak_host_mem_mib_per_round"] = mem
    return out


def run(quick: bool, repeats: int) -> dict:
    """Builds the state on a (4, 2) mesh of the 8 CPU devices, runs the rounds, sums up."""
    import jax

    devices = jax.devices("cpu")
    if len(devices) != 8:
        raise RuntimeError(
            f"the ckpt benchmark needs 8 CPU devices, got {len(devices)}: set XLA_FLAGS={_DEVICES_FLAG} "
            "before JAX is imported"
        )
    rounds = min(repeats, 2) if quick else repeats
    n = 1024 if quick else 4096
    baseline_s = BASELINE_SECONDS / 2 if quick else BASELINE_SECONDS
    mesh = jax.sharding.Mesh(np.array(devices).reshape(MESH_SHAPE), ("data", "model"))
    state = make_state(n, mesh)
    nbytes = sum(leaf.nbytes for leaf in jax.tree.leaves(state))
    arena = -(-(max(host_bytes(state, devices)) + ARENA_MARGIN) // MiB) * MiB
    results, extra = _rounds(state, arena, rounds, baseline_s)
    head: dict[str, Any] = {
        "benchmark": "ckpt",
        "quick": quick,
        "rounds": rounds,
        "state": f"{LAYERS} x {{w: f32[{n},{n}] P(data,model), b: f32[{n}] P(model)}}, mesh (4, 2), 2 hosts",
        "checkpoint_bytes": nbytes,
        "checkpoint_mib": round(nbytes / MiB, 1),
        "arena_mib_per_host": arena // MiB,
        "rpcs_per_small_save": extra.pop("rpcs_per_small_save"),
    }
    return {**_summary(head, results, nbytes), **extra}
