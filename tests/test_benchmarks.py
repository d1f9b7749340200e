"""`colocar bench NAME --quick --json` end to end, for every benchmark: the last line is the result.

Speeds are not asserted (this machine is shared and noisy). What is: each benchmark runs and
cleans up; its JSON has the keys RESULTS.md and the CLI promise (positive) and every figure
its module docstring names; it measured what it says (the state's bytes from its documented
layout, the rounds, every system and recovery it compares); each ratio agrees with the figures
it is made of; parts of a time never exceed the whole, phases come in order. And the checks
each benchmark makes of its restores do catch a wrong one.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest
from bench_helpers import CHECKS, assert_documented

PACKAGES = {"ckpt", "firstbatch", "recovery"}  # benchmarks that are subpackages of colocar/bench
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
        "orbax_layout_durable_ratio",  # colocar writing Orbax's layout
        "orbax_layout_train_slowdown_ratio",
        "orbax_layout_train_lost_ratio",
        "orbax_layout_peak_host_mem_ratio",
        "orbax_written_colocar_restore_s",  # a checkpoint Orbax wrote, restored by both
        "orbax_written_orbax_restore_s",
        "orbax_written_restore_ratio",
        "orbax_written_restore_cpu_ratio",  # the busiest sidecar's CPU + the controller's, to Orbax's
    ),
    "recovery": (
        "ram_s",
        "storage_s",
        "orbax_s",
        "speedup",
        "orbax_speedup",
        "snapshot_blocked_s",
        "memcpy_s",
        "blocked_ratio",
        "detect_s",
        "ram_restore_s",
        "storage_restore_s",
        "orbax_restore_s",
        "slowdown_ratio",
        "state_mib",
        "goodput",
    ),
    "firstbatch": (
        "colocar_fresh_s",
        "grain_fresh_s",
        "fresh_ratio",
        "colocar_resume_s",
        "grain_resume_s",
        "resume_ratio",
        "colocar_peak_rss_mib",
        "grain_peak_rss_mib",
        "peak_rss_ratio",
    ),
    "rpc": (
        "p50_us",
        "p99_us",
        "grpc_echo_p50_us",
        "ratio",
        "socket_p50_us",
        "future_p50_us",
        "future_timeout_p50_us",
        "socket_ratio",
        "future_socket_ratio",
        "array_call_p50_us",
        "hosts_calls_p50_us",
        "array_call_ratio",
    ),
    "transfer": ("gbps", "memcpy_gbps", "ratio", "view_ms", "device_put_ms"),
    "pool": (
        "alone_p50_us",
        "alone_p99_us",
        "alone_batches_per_s",
        "flooded_p99_us",
        "flooded_batches_per_s",
        "throughput_ratio",
        "p99_ratio",
    ),
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

TEXT: dict = {"capture_output": True, "text": True, "timeout": 300}


def _command(name: str) -> list[str]:
    """`colocar bench NAME --quick --json`, one round: the suite checks the output, not the speed."""
    cli = [sys.executable, "-c", "from colocar.cli import main; main()", "bench", name]
    return [*cli, "--quick", "--json", "--repeats", "1"]


def _result(name: str, returncode: int, stdout: str, stderr: str) -> dict:
    assert returncode == 0, f"colocar bench {name} failed:\n{stdout[-3000:]}\n{stderr[-3000:]}"
    lines = stdout.strip().splitlines()
    assert lines, f"colocar bench {name} printed nothing"
    result = json.loads(lines[-1])
    assert isinstance(result, dict)
    return result


@pytest.fixture(scope="module")
def firstbatch_run(tmp_path_factory):
    """firstbatch (six fresh Python processes, mostly starting up) runs alongside the other
    benchmarks' tests, from the first of them; its own test, the last, collects it."""
    folder = tmp_path_factory.mktemp("firstbatch")
    with open(folder / "out", "w") as out, open(folder / "err", "w") as err:
        process = subprocess.Popen(_command("firstbatch"), stdout=out, stderr=err, start_new_session=True)
    yield process, folder
    if process.poll() is None:  # its test did not run, or failed: the run and its sidecars go
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def _bench(name: str, firstbatch_run: tuple) -> dict:
    if name == "firstbatch":
        process, folder = firstbatch_run
        returncode = process.wait(timeout=300)
        return _result(name, returncode, (folder / "out").read_text(), (folder / "err").read_text())
    done = subprocess.run(_command(name), capture_output=True, text=True, timeout=300)
    return _result(name, done.returncode, done.stdout, done.stderr)


# rpc's JSON is checked by test_bench_runs_from_an_installed_wheel; firstbatch comes last
@pytest.mark.parametrize("name", [*sorted(set(REQUIRED) - {"rpc", "firstbatch"}), "firstbatch"])
def test_bench_quick_json(name: str, firstbatch_run: tuple) -> None:
    result = _bench(name, firstbatch_run)
    assert result["quick"] is True
    for key in REQUIRED[name]:
        value = result[key]
        assert isinstance(value, (int, float)) and not isinstance(value, bool), (key, value)
        assert value > 0, (key, value)
    assert_documented(name, result)
    CHECKS[name](result)


def test_bench_runs_from_an_installed_wheel(tmp_path) -> None:
    """`colocar bench` needs nothing but the package: a wheel built from the repository holds
    the benchmark modules, and `colocar bench` run from that wheel alone (its folder on
    PYTHONPATH, a working directory outside the repository) lists them and runs one (rpc: its
    sidecar and its peer processes import colocar from the wheel too)."""
    import shutil
    import zipfile
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(root / name, src / name)
    shutil.copytree(root / "colocar", src / "colocar", ignore=shutil.ignore_patterns("__pycache__"))
    build = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q"]
    done = subprocess.run([*build, str(src), "-w", str(tmp_path / "dist")], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("colocar-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for module in ("run", *sorted(REQUIRED)):
        path = f"colocar/bench/{module}/__init__.py" if module in PACKAGES else f"colocar/bench/{module}.py"
        assert path in names, sorted(n for n in names if "bench" in n)
    installed = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(installed)  # a pure-Python wheel: what pip install --target lays out
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(installed)
    where = subprocess.run(
        [sys.executable, "-c", "import colocar; print(colocar.__file__)"], env=env, cwd=tmp_path, **TEXT
    )
    assert where.stdout.strip() == str(installed / "colocar" / "__init__.py"), where
    cli = [sys.executable, "-m", "colocar.cli", "bench"]
    listing = subprocess.run([*cli, "--help"], env=env, cwd=tmp_path, **TEXT)
    assert listing.returncode == 0, listing.stderr[-3000:]
    assert all(name in listing.stdout for name in REQUIRED), listing.stdout
    done = subprocess.run([*cli, "rpc", "--quick", "--json", "--repeats", "1"], env=env, cwd=tmp_path, **TEXT)
    assert done.returncode == 0, f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["quick"] is True and all(result[key] > 0 for key in REQUIRED["rpc"]), result
    assert_documented("rpc", result)
    CHECKS["rpc"](result)


def test_the_benchmarks_restore_checks_catch_a_wrong_restore() -> None:
    """ckpt and recovery fail their run when a restore differs from the state (`check`,
    `Survivors.check`): one wrong element, or the right values on another sharding."""
    import jax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from colocar.bench.ckpt.measure import check
    from colocar.bench.recovery.systems import Survivors

    mesh = Mesh(np.array(jax.devices()), ("data",))
    by_rows, whole = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())
    values = np.arange(64, dtype=np.float32).reshape(16, 4)
    wrong = values.copy()
    wrong[3, 1] += 1
    state = {"layer_00": {"w": jax.device_put(values, by_rows)}}
    survivors = Survivors(target=None, expected=state, compiled=None)
    for verify in (lambda got: check(got, state), lambda got: survivors.check(got, "recovery")):
        verify({"layer_00": {"w": jax.device_put(values.copy(), by_rows)}})  # equal: no error
        for bad in (jax.device_put(wrong, by_rows), jax.device_put(values, whole)):
            with pytest.raises(AssertionError, match="restored wrong"):
                verify({"layer_00": {"w": bad}})
