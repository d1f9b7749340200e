"""examples/train.py, the program of docs/multi-controller.md, in the three topologies: one
controller with two local sidecars, two jax.distributed processes each with its own sidecar
(the environment the rendered k8s manifests give), and one controller reaching two sidecars
over gRPC without shared memory. The same records and the same state: equal checksums.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

from checkpoint_helpers import MiB

ROOT = Path(__file__).resolve().parent.parent
PROGRAM = ROOT / "examples" / "train.py"
FINAL = re.compile(
    r"^train\.py: process (\d) of (\d): 4 steps, state (\w+), batches (\w+), replayed from step 2: same$"
)


def _env(devices: int, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COLOCAR_SIDECARS", "JAX_COORD"))}
    env.update(
        XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
        JAX_PLATFORMS="cpu",
        PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]),
        **extra,
    )
    return env


def _start(args: list[str], env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(PROGRAM), *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _finals(processes: list[subprocess.Popen]) -> list[tuple[str, ...]]:
    """Each process's final line, parsed (process, count, state, batches); kills them after."""
    try:
        outputs = [p.communicate(timeout=240)[0] for p in processes]
    finally:
        for p in processes:
            if p.poll() is None:
                p.kill()
                p.wait()
    finals = []
    for p, out in zip(processes, outputs, strict=True):
        assert p.returncode == 0, out[-3000:]
        matches = [m for m in map(FINAL.match, out.splitlines()) if m]  # JAX may log after it
        assert len(matches) == 1, out[-3000:]
        finals.append(matches[0].groups())
    return finals


def _free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def test_train_example_gives_the_same_state_in_every_topology(make_cluster, tmp_path):
    """Equal state and batch checksums from one controller with local sidecars, two JAX
    processes on their own sidecars, and one controller over gRPC with shm off; each run also
    checked that its restored checkpoint replays the same steps (its last line says so)."""
    local = _start(["--local", "2", "--ckpt", str(tmp_path / "local")], _env(8))
    sidecars = make_cluster(hosts=2, arena_size=16 * MiB, persist=True)
    port = _free_port()
    multi = [
        _start(
            ["--ckpt", str(tmp_path / "multi")],
            _env(
                4,
                COLOCAR_SIDECARS=sidecars.hosts[i].address,
                COLOCAR_TOKEN_FILE=sidecars.token_file,
                JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
                COLOCAR_NUM_HOSTS="2",
                JOB_COMPLETION_INDEX=str(i),
            ),
        )
        for i in range(2)
    ]
    (one,) = _finals([local])
    processes = _finals(multi)
    addresses = ",".join(h.address for h in sidecars.hosts)
    env = _env(8, COLOCAR_SIDECARS=addresses, COLOCAR_TOKEN_FILE=sidecars.token_file)
    (remote,) = _finals([_start(["--no-shm", "--ckpt", str(tmp_path / "grpc")], env)])
    assert one[:2] == ("0", "1") and remote[:2] == ("0", "1")
    assert [p[:2] for p in processes] == [("0", "2"), ("1", "2")]
    assert {p[2:] for p in (one, remote, *processes)} == {one[2:]}, (one, remote, processes)


def test_the_multi_controller_page_shows_the_whole_program():
    """The "Multi-controller JAX" page (docs/multi-controller.md) holds examples/train.py after
    its docstring, exactly (the block after the marker comment), so the two cannot drift apart."""
    section = (ROOT / "docs" / "multi-controller.md").read_text()
    marker = "<!-- examples/train.py after its docstring"
    block = section[section.index(marker) :].split("```python\n", 1)[1].split("```\n", 1)[0]
    program = PROGRAM.read_text()
    assert block == program[program.index("from __future__") :]
