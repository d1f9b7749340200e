"""What the benchmarks' JSON must satisfy whatever the machine's speed (test_benchmarks.py).

A ratio is checked against the figures it is made of with interval arithmetic: each figure is
known to within half a unit of its last reported digit, so rounding never fails a check and a
wrong formula (inverted, another key, a missing floor) does.
"""

from __future__ import annotations

import importlib
import re
import statistics

MiB = 1 << 20

Figure = str | float | tuple[float, float]  # a key of the result, an exact number, an interval


def _interval(result: dict, figure: Figure, digits: int) -> tuple[float, float]:
    if isinstance(figure, tuple):
        return figure
    if isinstance(figure, str):
        half = 0.5 * 10.0**-digits
        return result[figure] - half, result[figure] + half
    return figure, figure


def _floored(interval: tuple[float, float], floor: tuple[float, float]) -> tuple[float, float]:
    return max(interval[0], floor[0]), max(interval[1], floor[1])


def _assert_ratio(result: dict, ratio: str, num: Figure, den: Figure, digits=(3, 3, 3), scale=1.0) -> None:
    """result[ratio] (rounded to digits[0] decimals) = num / den * scale (rounded to digits[1]
    and digits[2] where they are keys)."""
    n, d = _interval(result, num, digits[1]), _interval(result, den, digits[2])
    assert d[0] > 0, (ratio, num, den, result.get(den) if isinstance(den, str) else den)
    quotients = [a / b * scale for a in n for b in d]
    got = _interval(result, ratio, digits[0])
    low, high = min(quotients), max(quotients)
    assert got[1] >= low and got[0] <= high, (
        f"{ratio} = {result[ratio]}, but {num} / {den} is in [{low}, {high}]"
    )


def _assert_per_round(result: dict, keys: list[str], rounds: int, digits: tuple[int, int]) -> None:
    """Each `key` lists one figure per round, and with one round the median is that figure
    (the median rounded to digits[0] decimals, the rounds to digits[1])."""
    tolerance = 0.5 * 10.0 ** -digits[0] + 0.5 * 10.0 ** -digits[1] + 1e-12
    for key in keys:
        per_round = result[f"{key}_per_round"]
        assert len(per_round) == rounds, (key, per_round)
        if rounds == 1:
            assert abs(result[key] - per_round[0]) <= tolerance, (key, result[key], per_round)


def _assert_in_order(result: dict, *keys: str) -> None:
    """A part never exceeds its whole (a time measured from the same start, ending earlier)."""
    values = [result[k] for k in keys]
    assert values == sorted(values), dict(zip(keys, values, strict=True))


# names like `blocked_s`, `*_syncfs_s`: the figures a benchmark's docstring promises
DOCUMENTED = re.compile(r"`(\*_)?([a-z][a-z0-9_]*(?:_s|_ms|_us|_mib|_bps|gbps|ratio|speedup|slowdown))`")
SYSTEMS_OF = {"ckpt": ("colocar", "colocar_orbax", "orbax"), "firstbatch": ("colocar", "grain")}


def assert_documented(name: str, result: dict) -> None:
    """Every figure the benchmark's module docstring names is in the JSON: as itself, for each
    of the benchmark's systems (`<system>_<name>`), or (`*_name`) under some prefix. The
    accelerator's figures only where there is one."""
    doc = importlib.import_module(f"colocar.bench.{name}").__doc__ or ""
    missing = []
    for any_prefix, figure in DOCUMENTED.findall(doc):
        if figure.startswith("accel_") and "accelerator" not in result:
            continue
        if any_prefix:
            found = any(key.endswith(f"_{figure}") for key in result)
        else:
            per_system = SYSTEMS_OF.get(name, ())
            found = (
                figure in result or bool(per_system) and all(f"{s}_{figure}" in result for s in per_system)
            )
        if not found:
            missing.append(figure)
    assert not missing, f"colocar bench {name}: documented but not in its JSON: {missing}"


def _check_transfer(r: dict) -> None:
    assert r["rounds"] == 3 and r["array_mib"] == 64 and "--quick" in r["array"]  # rounds: at least 3
    assert r["source_builds"] == 1  # the warm source really stayed warm on the sidecar
    assert isinstance(r["device_put_aliased"], bool)
    for key in ("call_ms", "memcpy_ms"):  # the median of the rounds (odd: one of them, same digits)
        assert r[key] == statistics.median(r[f"{key}_per_round"]) and len(r[f"{key}_per_round"]) == 3
    mb = r["array_mib"] * MiB / 1e6  # 64 MiB in GB/s from milliseconds
    _assert_ratio(r, "gbps", mb, "call_ms", (2, 0, 2))
    _assert_ratio(r, "memcpy_gbps", mb, "memcpy_ms", (2, 0, 2))
    _assert_ratio(r, "view_gbps", mb, "view_ms", (1, 0, 3))
    _assert_ratio(r, "ratio", "gbps", "memcpy_gbps", (3, 2, 2))


def _check_recovery(r: dict) -> None:
    assert r["rounds"] == 1
    rows = 504  # --quick: 16 x {w: f32[504, 2048] by rows over 4 hosts x 2 devices, b: f32[2048]}
    assert f"f32[{rows},2048]" in r["state"], r["state"]
    assert r["state_mib"] == round(16 * (rows + 1) * 2048 * 4 / MiB, 1)
    assert r["host_share_mib"] == round(16 * (rows // 4 + 1) * 2048 * 4 / MiB, 1)  # host 0: b too
    assert r["small_state_mib"] == round(16 * (8 + 1) * 2048 * 4 / MiB, 2)
    # every recovery ran, in round 0's order, after the kill of host 1
    assert r["order_per_round"] == ["ram/storage/orbax/storage_gcs/orbax_gcs"]
    assert r["victim_per_round"] == [1]
    _assert_per_round(r, ["ram_s", "storage_s", "orbax_s", "detect_s", "ram_read_s"], 1, (4, 4))
    _assert_per_round(r, ["snapshot_blocked_s", "small_snapshot_blocked_s"], 1, (4, 4))
    _assert_per_round(r, ["replication_slowdown", "save_slowdown"], 1, (3, 4))
    _assert_in_order(r, "ram_read_s", "ram_restore_s")  # the read, then the step
    from colocar.bench.recovery.benchmark import GOODPUT_STEP_S, GOODPUT_STEPS

    useful = GOODPUT_STEPS * GOODPUT_STEP_S  # the recovery alone costs the modelled run its time
    assert 0 < r["goodput"] <= useful / (useful + r["ram_s"]), r["goodput"]
    _assert_in_order(r, "snapshot_blocked_s", "snapshot_committed_s")
    _assert_in_order(r, "save_blocked_s", "save_durable_s")
    d = (2, 4, 4)
    for ratio, num, den in (
        ("speedup", "storage_s", "ram_s"),
        ("orbax_speedup", "orbax_s", "ram_s"),
        ("restore_speedup", "storage_restore_s", "ram_restore_s"),
        ("orbax_restore_speedup", "orbax_restore_s", "ram_restore_s"),
        ("gcs_speedup", "storage_gcs_s", "ram_s"),
        ("gcs_orbax_ratio", "storage_gcs_restore_s", "orbax_gcs_restore_s"),
        ("blocked_ratio", "snapshot_blocked_s", "memcpy_s"),
        ("ram_read_memcpy_ratio", "ram_read_s", "memcpy_state_s"),
    ):
        _assert_ratio(r, ratio, num, den, d)
    floor = (0.02, 0.02)  # SLOWDOWN_FLOOR: the noise of this machine
    slow = {k: _floored(_interval(r, k, 3), floor) for k in ("replication_slowdown", "save_slowdown")}
    _assert_ratio(r, "slowdown_ratio", slow["replication_slowdown"], slow["save_slowdown"], (3, 3, 3))


def _check_ckpt(r: dict) -> None:
    assert r["rounds"] == 1 and r["checkpoint_mib"] == 64.1
    assert r["checkpoint_bytes"] == 16 * (1024 * 1024 + 1024) * 4  # 16 x {w: f32[1024, 1024], b}
    assert isinstance(r["rpcs_per_small_save"], int) and r["rpcs_per_small_save"] >= 2  # 2 hosts
    for system in SYSTEMS_OF["ckpt"]:
        keys = ["blocked_s", "durable_s", "restore_s", "train_slowdown", "durable_training_s", "train_lost_s"]
        _assert_per_round(r, [f"{system}_{k}" for k in keys], 1, (3, 3))
        _assert_per_round(r, [f"{system}_peak_host_mem_mib"], 1, (1, 1))
        _assert_in_order(r, f"{system}_blocked_s", f"{system}_durable_s")
        _assert_in_order(r, f"{system}_syncfs_s", f"{system}_durable_s")  # durable includes the sync
    floor = (0.02, 0.02)
    for prefix, system in (("", "colocar"), ("orbax_layout_", "colocar_orbax")):
        for key in ("blocked", "durable", "restore", "durable_training"):
            _assert_ratio(r, f"{prefix}{key}_ratio", f"{system}_{key}_s", f"orbax_{key}_s")
        slow = [_floored(_interval(r, f"{s}_train_slowdown", 3), floor) for s in (system, "orbax")]
        _assert_ratio(r, f"{prefix}train_slowdown_ratio", *slow)
        lost = []
        for s in (system, "orbax"):  # floored at SLOWDOWN_FLOOR x the time the loop ran
            training = _interval(r, f"{s}_durable_training_s", 3)
            lost.append(
                _floored(_interval(r, f"{s}_train_lost_s", 3), (0.02 * training[0], 0.02 * training[1]))
            )
        _assert_ratio(r, f"{prefix}train_lost_ratio", *lost)
        mem = f"{system}_peak_host_mem_mib"
        _assert_ratio(r, f"{prefix}peak_host_mem_ratio", mem, r["checkpoint_bytes"], (3, 1, 0), MiB)
    _assert_ratio(
        r, "orbax_peak_host_mem_ratio", "orbax_peak_host_mem_mib", r["checkpoint_bytes"], (3, 1, 0), MiB
    )
    _assert_ratio(
        r, "orbax_written_restore_ratio", "orbax_written_colocar_restore_s", "orbax_written_orbax_restore_s"
    )
    cpu = ("orbax_written_colocar_critical_cpu_s", "orbax_written_orbax_cpu_s")
    _assert_ratio(r, "orbax_written_restore_cpu_ratio", *cpu)


def _check_loader(r: dict) -> None:
    assert r["rounds"] == 1 and r["records"] > 0
    for pipeline in ("transfer", "compute"):
        assert r[f"{pipeline}_timed_batches"] > 0 and r[f"{pipeline}_warmup_batches"] > 0
        colocar = [f"{pipeline}_colocar1", f"{pipeline}_colocar2"]
        systems = [f"{pipeline}_grain", *colocar]
        _assert_per_round(r, [f"{s}_bps" for s in systems], 1, (1, 1))
        # against grain: colocar's slower configuration, and its busier trainer
        bps = [_interval(r, f"{s}_bps", 1) for s in colocar]
        slowest = (min(b[0] for b in bps), min(b[1] for b in bps))
        _assert_ratio(r, f"{pipeline}_ratio", slowest, f"{pipeline}_grain_bps", (3, 1, 1))
        cpu = [_interval(r, f"{s}_cpu_ms", 2) for s in colocar]
        busiest = (max(c[0] for c in cpu), max(c[1] for c in cpu))
        _assert_ratio(r, f"{pipeline}_cpu_ratio", busiest, f"{pipeline}_grain_cpu_ms", (3, 2, 2))
    assert r["trainer_cpu_ratio"] == max(r["transfer_cpu_ratio"], r["compute_cpu_ratio"])


PHASES = ("imported", "cluster", "loader", "restored", "state_set", "first_batch")  # in this order


def _check_firstbatch(r: dict) -> None:
    assert r["repeats"] == 1 and isinstance(r["retries"], list)
    for system in SYSTEMS_OF["firstbatch"]:
        for mode in ("fresh", "resume"):
            _assert_per_round(r, [f"{system}_{mode}_s"], 1, (3, 3))
            phases = r[f"{system}_{mode}_phases"]
            # the phases happened in order, a restore only when resuming, the sidecars only for colocar
            assert set(phases) - set(PHASES) == set() and 0 < phases["imported"], phases
            assert [phases[p] for p in PHASES if p in phases] == sorted(phases.values()), phases
            assert ("restored" in phases) == ("state_set" in phases) == (mode == "resume"), phases
            assert ("cluster" in phases) == (system == "colocar"), phases
            assert phases["first_batch"] == r[f"{system}_{mode}_s"], phases
    for mode in ("fresh", "resume"):
        _assert_ratio(r, f"{mode}_ratio", f"colocar_{mode}_s", f"grain_{mode}_s")
    _assert_ratio(r, "peak_rss_ratio", "colocar_peak_rss_mib", "grain_peak_rss_mib", (3, 1, 1))


def _check_rpc(r: dict) -> None:
    """The control-path goals (issue 34): each ratio is its p50 over the socket's, against its
    goal, and the verdict follows from the two."""
    for name, p50, goal in (("socket", "p50_us", 4.0), ("future_socket", "future_p50_us", 6.0)):
        assert r[f"{name}_ratio"] == round(r[p50] / r["socket_p50_us"], 2), (name, r)
        assert r[f"{name}_ratio_goal"] == goal
        assert r[f"{name}_goal_met"] is (r[f"{name}_ratio"] <= goal), (name, r)
    assert min(r["future_p50_us"], r["future_timeout_p50_us"], r["p50_us"]) >= r["socket_p50_us"], r
    assert r["array_call_ratio"] == round(r["array_call_p50_us"] / r["hosts_calls_p50_us"], 2), r


def _check_pool(r: dict) -> None:
    assert r["rounds"] == 1 and len(r["per_round"]["alone"]) == len(r["per_round"]["flooded"]) == 1
    _assert_ratio(r, "throughput_ratio", "flooded_batches_per_s", "alone_batches_per_s", (3, 1, 1))
    _assert_ratio(r, "p99_ratio", "flooded_p99_us", "alone_p99_us", (3, 1, 1))
    assert r["goals_met"] == (r["throughput_ratio"] >= 0.8 and r["p99_ratio"] <= 2.0)


CHECKS = {
    "pool": _check_pool,
    "rpc": _check_rpc,
    "transfer": _check_transfer,
    "recovery": _check_recovery,
    "ckpt": _check_ckpt,
    "loader": _check_loader,
    "firstbatch": _check_firstbatch,
}
