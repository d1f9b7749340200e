"""The sidecar's own log lines: who wrote them (host, pid, thread) and the drain on SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_sigterm_logs_the_drain_with_host_pid_and_thread(tmp_path: Path, shm_dir: str) -> None:
    ready = tmp_path / "ready"
    command = [sys.executable, "-m", "colocar.sidecar", "--ready-file", str(ready), "--shm-dir", shm_dir]
    command += ["--label", "host7", "--processes", "0", "--drain-seconds", "5"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert process.poll() is None and time.monotonic() < deadline, process.stderr
            time.sleep(0.05)
        arena = json.loads(ready.read_text())["arena"]
        process.send_signal(signal.SIGTERM)
        _, err = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=30)
    assert process.returncode == 0, err
    prefix = f"[host7 pid={process.pid} MainThread]"
    lines = err.splitlines()
    assert any(prefix in line and "serving on" in line for line in lines), err
    assert any(prefix in line and "SIGTERM: draining" in line and "5 s" in line for line in lines), err
    assert any(prefix in line and "drained in" in line for line in lines), err
    assert not os.path.exists(arena)
