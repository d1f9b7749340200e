"""A pid kept with its process's start (`colocar.pids`) still names that process after the clock
is set. psutil's start times are wall-clock times; they move with every step of the clock (NTP
on a fresh VM), and compared across one, live processes looked gone: `colocar clean` removed a
live cluster's work folder (a CI run lost the shared cluster's token file so), and a live
writer's lease looked free.

Setting the clock needs root, so these tests show psutil a /proc whose boot time moved, as the
kernel shows it after a step: /proc/stat with `btime` shifted, the processes' own entries the
real ones. Each runs in a child process, so no other thread of this worker reads that /proc.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from colocar import pids
from colocar.controller_bridge.local import records


def _stepped_procfs(root: os.PathLike, processes: list[int], seconds: int) -> str:
    """A /proc as after the clock was set `seconds` forward: `btime` moved, `processes` real."""
    os.makedirs(root)
    with open("/proc/stat") as f:
        lines = [
            f"btime {int(line.split()[1]) + seconds}\n" if line.startswith("btime ") else line for line in f
        ]
    with open(os.path.join(root, "stat"), "w") as f:
        f.writelines(lines)
    for pid in processes:
        os.symlink(f"/proc/{pid}", os.path.join(root, str(pid)))
    return str(root)


def _after_the_step(procfs: str, code: str, env: dict[str, str] | None = None, **values: Any) -> Any:
    """Runs `code`, which sets `result`, in a child whose psutil reads `procfs` (with `env`
    added to its environment); the result. `values` reach it as JSON-decoded names."""
    script = "\n".join(
        [
            "import json, psutil",
            f"psutil.PROCFS_PATH = {procfs!r}",
            *(f"{name} = json.loads({json.dumps(value)!r})" for name, value in values.items()),
            code,
            "print(json.dumps(result))",
        ]
    )
    environment = {**os.environ, **(env or {})}
    command = [sys.executable, "-c", script]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, env=environment)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen]:
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    yield process
    process.kill()
    process.wait()


@pytest.mark.parametrize("seconds", [30, -30])
def test_a_process_is_itself_after_the_clock_is_set(tmp_path, sleeper, seconds):
    start = pids.start_of(sleeper.pid)
    procfs = _stepped_procfs(tmp_path / "proc", [sleeper.pid], seconds)
    moved, same, later, other_boot = _after_the_step(
        procfs,
        """from colocar import pids
found = lambda start: pids.process_with(pid, start) is not None
result = [psutil.Process(pid).create_time() - start["started"], found(start),
          found({**start, "since_boot": start["since_boot"] + 1}), found({**start, "boot": "another"})]""",
        pid=sleeper.pid,
        start=start,
    )
    assert moved == pytest.approx(seconds, abs=0.05)  # psutil's wall-clock start did move
    assert same, "the process was taken for gone after the clock was set"
    assert not later and not other_boot  # a pid's later process, or one of another boot, is not it


def test_clean_leaves_a_live_cluster_alone_after_the_clock_is_set(tmp_path, cluster):
    """What `colocar clean` would remove, asked after the clock moved: never this live cluster."""
    record = os.path.join(os.path.dirname(cluster.token_file), records.WORKDIR_RECORD)
    assert os.path.exists(record)
    procfs = _stepped_procfs(tmp_path / "proc", [p.pid for p in cluster.processes], 30)
    left = _after_the_step(
        procfs,
        """from colocar.controller_bridge.local import records
result = [r["path"] for r in records.left_over()]""",
    )
    assert record not in left, "a live cluster's work folder was found left over"


def test_a_live_writers_lease_is_not_free_after_the_clock_is_set(tmp_path, sleeper):
    holder = {
        "hostname": socket.gethostname(),
        "pid": sleeper.pid,
        **pids.start_of(sleeper.pid),
    }
    procfs = _stepped_procfs(tmp_path / "proc", [sleeper.pid], 30)
    code = "from colocar.checkpoint.store.lease import is_dead\nresult = is_dead(holder)"
    assert _after_the_step(procfs, code, holder=holder) is False
    sleeper.kill()
    sleeper.wait()
    assert _after_the_step(procfs, code, holder=holder) is True  # a gone holder is still seen gone


def test_a_record_of_another_pid_namespace_is_never_left_over(tmp_path, sleeper):
    """Containers sharing a /tmp: the pids another one recorded name nothing here, so its
    folders stay, even though no process here matches them. A record of an earlier boot goes
    (its processes ended with it)."""
    gone = pids.start_of(sleeper.pid)
    sleeper.kill()
    sleeper.wait()
    other_namespace = {**gone, "pidns": "pid:[1]"}
    kept = {
        "here": {"pid": sleeper.pid, **gone},
        "other_namespace": {"pid": sleeper.pid, **other_namespace},
        "other_boot": {"pid": sleeper.pid, **other_namespace, "boot": "an-earlier-boot"},
    }
    for name, process in kept.items():
        os.makedirs(tmp_path / f"colocar-{name}")
        record = {"workdir": str(tmp_path / f"colocar-{name}"), "argv": [], "arena_bytes": 0}
        records.save(record["workdir"], "", {**record, "hosts": [process], "controller": process})
    code = "from colocar.controller_bridge.local import records\n"
    code += "result = [r['workdir'] for r in records.left_over()]"
    left = _after_the_step(
        "/proc",
        code,
        env={"TMPDIR": str(tmp_path), "COLOCAR_STATE_DIR": str(tmp_path / "state")},
    )
    assert sorted(left) == [str(tmp_path / "colocar-here"), str(tmp_path / "colocar-other_boot")]
