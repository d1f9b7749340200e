"""`colocar bench rpc|transfer|loader|ckpt --quick --json` run end to end: the last line is the result.

Numbers are not asserted (this machine is shared and noisy); only that each benchmark runs,
cleans up, and reports the keys RESULTS.md and the CLI promise, with positive values.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

REQUIRED = {
    "ckpt": (
        "blocked_ratio",
        "durable_ratio",
        "restore_ratio",
        "train_slowdown_ratio",
        "peak_host_mem_ratio",
        "checkpoint_bytes",
        "arena_mib_per_host",
        "colocar_blocked_s",
        "orbax_blocked_s",
        "colocar_durable_s",
        "orbax_durable_s",
        "colocar_restore_s",
        "orbax_restore_s",
        "colocar_durable_training_s",
        "orbax_durable_training_s",
        "colocar_peak_host_mem_mib",
    ),
    "rpc": ("p50_us", "p99_us", "grpc_echo_p50_us", "ratio", "socket_p50_us"),
    "transfer": ("gbps", "memcpy_gbps", "ratio", "view_ms", "device_put_ms"),
    "loader": (
        "transfer_ratio",
        "compute_ratio",
        "trainer_cpu_ratio",
        "transfer_grain_bps",
        "transfer_colocar1_bps",
        "transfer_colocar2_bps",
        "compute_grain_bps",
        "compute_colocar1_bps",
        "compute_colocar2_bps",
        "transfer_grain_cpu_ms",
        "compute_colocar2_cpu_ms",
    ),
}


def _bench(name: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", "from colocar.cli import main; main()", "bench", name, "--quick", "--json"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, f"colocar bench {name} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    lines = done.stdout.strip().splitlines()
    assert lines, f"colocar bench {name} printed nothing"
    result = json.loads(lines[-1])
    assert isinstance(result, dict)
    return result


@pytest.mark.parametrize("name", sorted(REQUIRED))
def test_bench_quick_json(name: str) -> None:
    result = _bench(name)
    assert result["quick"] is True
    for key in REQUIRED[name]:
        value = result[key]
        assert isinstance(value, (int, float)) and not isinstance(value, bool), (key, value)
        assert value > 0, (key, value)
    if name == "transfer":
        assert isinstance(result["device_put_aliased"], bool)
        assert result["array_mib"] == 64 and "--quick" in result["array"]
        assert result["source_builds"] == 1  # the warm source really stayed warm on the sidecar
    if name == "ckpt":
        assert result["rounds"] == 2 and result["checkpoint_mib"] == 64.1
        for system in ("colocar", "orbax"):
            assert isinstance(result[f"{system}_train_slowdown"], float)  # may be ~0 or below
            for key in ("blocked_s", "durable_s", "restore_s", "train_slowdown", "durable_training_s"):
                assert len(result[f"{system}_{key}_per_round"]) == 2
    if name == "loader":
        assert result["rounds"] == 3
        for key in ("transfer", "compute"):
            for system in ("grain", "colocar1", "colocar2"):
                assert len(result[f"{key}_{system}_bps_per_round"]) == 3
