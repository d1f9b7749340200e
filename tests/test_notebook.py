"""Notebooks as people use them: a real Jupyter kernel (ipykernel, driven by jupyter_client)
runs the cells of `examples/notebook.ipynb`, is interrupted the way Jupyter interrupts (SIGINT
to the kernel's process group) and restarted the way Jupyter restarts (SIGKILL to the group).

The cluster survives the interrupt and the next cell gets its own result; running the cluster
cell again starts no second set of sidecars; after a restart the cell reattaches to the same
persistent sidecars under the session's name, whose named object is still there. A kernel
restart under a cluster that is not persistent leaves no sidecar and no arena file.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import psutil
import pytest
from helpers import running, wait_for
from notebook_helpers import REPO, Kernel, notebook_cells

import colocar

PIDS = "print([p.pid for p in cluster.processes])"


def _env(shm: Path, state: Path) -> dict[str, str]:
    return {
        "COLOCAR_SHM_DIR": str(shm),
        "COLOCAR_STATE_DIR": str(state),
        "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": str(REPO),  # the kernel imports this checkout's colocar
    }


def _sidecars_using(shm: Path) -> list[int]:
    """Every running sidecar process whose arena lives in `shm`."""
    found = []
    for process in psutil.process_iter(["cmdline"]):
        command = process.info["cmdline"] or []
        if "colocar.sidecar" in command and str(shm) in command:
            found.append(process.pid)
    return running(found)


@pytest.fixture
def folders(tmp_path, shm_dir, monkeypatch):
    """A shm folder and a state folder of the test's own; whatever the kernels left running in
    them is stopped at the end, also after a failure."""
    shm, state = Path(shm_dir) / f"nb-{os.getpid()}-{tmp_path.name}", tmp_path / "state"
    shm.mkdir()
    monkeypatch.setenv("COLOCAR_STATE_DIR", str(state))
    yield shm, state
    from colocar.controller_bridge.local.reattach import stop

    stop("notebook")
    for pid in _sidecars_using(shm):
        psutil.Process(pid).kill()
    for name in os.listdir(shm):
        os.unlink(shm / name)
    shm.rmdir()


def _in_flight(addresses: list[str], token_file: str) -> bool:
    with colocar.connect(addresses, token_file=token_file, shm=False, devices=[[]] * len(addresses)) as c:
        return all(h.stats()["in_flight"] >= 1 for h in c.hosts)


def test_the_example_notebook_in_a_real_kernel(folders):
    shm, state = folders
    cells = notebook_cells()
    with Kernel(_env(shm, state)) as kernel:
        for name in ("setup", "cluster", "functions"):
            kernel.run(cells[name], name)
        assert "sum: 240.0" in kernel.run(cells["call"]).stdout
        assert "counter: 1" in kernel.run(cells["counter"]).stdout
        record = json.loads((state / "notebook.json").read_text())
        sidecars = [h["pid"] for h in record["hosts"]]
        addresses = [h["address"] for h in record["hosts"]]
        token_file = os.path.join(record["workdir"], "token")

        # ■ during a call that runs in a worker process on both sidecars
        long_call = kernel.start(cells["long-call"])
        wait_for(lambda: _in_flight(addresses, token_file), "the long call to run on both sidecars")
        kernel.interrupt()
        assert kernel.wait(long_call).error == "KeyboardInterrupt"
        again = kernel.run(cells["call-again"]).stdout
        assert "sum: 240.0 slow: ['done', 'done']" in again, again

        # the cluster cell once more: the same two sidecars, no others
        kernel.run(cells["cluster"], "cluster")
        assert _sidecars_using(shm) == sorted(sidecars) == sorted(running(sidecars))
        assert "counter: 2" in kernel.run(cells["counter"]).stdout

        # "Restart kernel": the group is killed; the persistent sidecars live on
        old_kernel = kernel.pid
        kernel.restart()
        assert kernel.pid != old_kernel and sorted(running(sidecars)) == sorted(sidecars)
        kernel.run(cells["setup"], "setup")
        took_over = kernel.run(cells["cluster"], "cluster").stdout
        assert re.search(rf"took over from: \['[^']*:{old_kernel}'\]", took_over), took_over
        assert _sidecars_using(shm) == sorted(sidecars)
        kernel.run(cells["functions"], "functions")
        assert "sum: 240.0" in kernel.run(cells["call"]).stdout
        assert "counter: 3" in kernel.run(cells["counter"]).stdout  # made before the restart

        kernel.run(cells["shutdown"], "shutdown")
        wait_for(lambda: not running(sidecars), "the sidecars to stop")
        assert not os.listdir(shm) and not (state / "notebook.json").exists()


def test_a_kernel_restart_leaves_no_sidecar_and_no_arena(folders):
    shm, state = folders
    cells = notebook_cells()
    with Kernel(_env(shm, state)) as kernel:
        kernel.run(cells["setup"], "setup")
        cell = "cluster = colocar.local_cluster(hosts=2, arena_size=16 << 20)\n" + PIDS
        replaced = json.loads(kernel.run(cell).stdout)
        sidecars = json.loads(kernel.run(cell).stdout)  # the cell once more: the first cluster goes
        wait_for(lambda: not running(replaced), "the replaced cluster's sidecars to stop")
        assert _sidecars_using(shm) == sorted(sidecars)
        kernel.run(cells["functions"], "functions")
        assert "sum: 240.0" in kernel.run(cells["call"]).stdout
        assert len([name for name in os.listdir(shm) if name.endswith(".arena")]) == 2
        kernel.restart()  # SIGKILL to the kernel's process group: the sidecars are not in it
        wait_for(lambda: not running(sidecars), "the sidecars to end with their kernel")
        assert os.listdir(shm) == []
