"""colocar jobs on a live Slurm (the `slurm` fixture: slurmctld and four slurmd on this
machine; the node names do not resolve, the nodes are reached by NodeAddr): the script
`colocar slurm render` prints, submitted as is with sbatch, runs examples/train.py in both
topologies to the checksums of a local run; a node's task lost mid-run is recovered in both;
scancel ends every process; salloc plus a notebook attaches to the job's sidecars. After
each job no process of it and no /dev/shm file of it is left.
"""

from __future__ import annotations

import glob
import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parent.parent
TRAIN = ROOT / "examples" / "train.py"
ELASTIC = ROOT / "tests" / "programs" / "slurm_elastic.py"
PREEMPTED = ROOT / "tests" / "programs" / "slurm_preempted.py"
FINAL = re.compile(
    r"^train\.py: process (\d) of (\d): 4 steps, state (\w+), batches (\w+), replayed from step 2: same$"
)
DEADLINE = 300.0


def _env(slurm, tmp_path: Path, devices: int) -> dict[str, str]:
    """What the job inherits from the submitting shell (sbatch exports it): not the suite's
    shm directory (the tasks use /dev/shm, as a user's would) nor its sidecars."""
    drop = ("COLOCAR_", "JAX_COORD", "XLA_FLAGS")
    env = {k: v for k, v in slurm.env.items() if not k.startswith(drop)}
    env.update(
        XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
        JAX_PLATFORMS="cpu",
        COLOCAR_JOB_DIR=str(tmp_path / "job"),
    )
    return env


def _render(*args: str) -> str:
    """The script, printed by the command a user runs."""
    command = [sys.executable, "-m", "colocar", "slurm", "render", *args]
    return subprocess.run(command, check=True, capture_output=True, text=True).stdout


def _submit(slurm, tmp_path: Path, env: dict[str, str], *args: str) -> tuple[int, Path]:
    script = tmp_path / "job.sh"
    script.write_text(_render(*args))
    out = tmp_path / "out.txt"
    job = slurm.sbatch(script, env=env, args=["--output", str(out), "--chdir", str(ROOT)])
    return job, out


def _job_processes(job: int) -> list[psutil.Process]:
    """Every process that runs in job `job` (its environment says so), daemons aside."""
    found = []
    for p in psutil.process_iter(["name"]):
        try:
            if p.info["name"] != "slurmstepd" and p.environ().get("SLURM_JOB_ID") == str(job):
                found.append(p)
        except psutil.Error:
            pass
    return found


def _assert_nothing_left(job: int) -> None:
    """No process of the job and no arena of its sidecars in /dev/shm (within a deadline)."""
    deadline = time.monotonic() + 60
    while True:
        processes = [p for p in _job_processes(job) if p.status() != psutil.STATUS_ZOMBIE]
        files = glob.glob(f"/dev/shm/colocar-slurm{job}-*")
        if not processes and not files:
            return
        assert time.monotonic() < deadline, (
            f"left by job {job}: {[(p.pid, p.cmdline()[:4]) for p in processes]}, files {files}"
        )
        time.sleep(0.5)


def _finals(out: str) -> list[tuple[str, ...]]:
    return [m.groups() for m in map(FINAL.match, out.splitlines()) if m]


@pytest.fixture(scope="module")
def local_run(tmp_path_factory) -> tuple[str, ...]:
    """examples/train.py with 4 local sidecars, 16 devices: the checksums every job must give."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COLOCAR_SIDECARS", "JAX_COORD"))}
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=16"
    ckpt = tmp_path_factory.mktemp("local") / "ckpt"
    done = subprocess.run(
        [sys.executable, str(TRAIN), "--local", "4", "--ckpt", str(ckpt)],
        env=env, capture_output=True, text=True, timeout=DEADLINE,
    )  # fmt: skip
    (final,) = _finals(done.stdout)
    return final


@pytest.mark.parametrize("topology,devices", [("multi", 4), ("single", 16)])
def test_the_rendered_script_trains_as_a_local_run(slurm, tmp_path, local_run, topology, devices) -> None:
    """sbatch of the script as printed: 4 nodes, each with its sidecar (and, multi, its
    trainer: 4 jax.distributed processes of 4 devices); the same state and batches."""
    env = _env(slurm, tmp_path, devices)
    ckpt = tmp_path / "ckpt"
    job, out = _submit(
        slurm, tmp_path, env, "--nodes", "4", "--topology", topology, "--arena", "64M",
        "--", sys.executable, str(TRAIN), "--ckpt", str(ckpt),
    )  # fmt: skip
    state = slurm.wait_job(job, timeout=DEADLINE)
    output = out.read_text()
    assert state == "COMPLETED", output[-4000:]
    finals = sorted(_finals(output))
    expected = (
        [(str(i), "4", *local_run[2:]) for i in range(4)]
        if topology == "multi"
        else [("0", "1", *local_run[2:])]
    )
    assert finals == expected, output[-4000:]
    assert not (tmp_path / "job").exists()  # the script's trap removed the job's directory (token)
    _assert_nothing_left(job)


@pytest.mark.parametrize("topology,lost", [("single", "sidecar"), ("multi", "trainer"), ("multi", "sidecar")])
def test_a_lost_node_is_recovered_from_ram(slurm, tmp_path, topology, lost) -> None:
    """Single (4 nodes): the third node's sidecar is killed after step 4; the controller goes on
    on the other three from their RAM. Multi (2 nodes): after step 4 the second node's
    trainer is killed, or its sidecar (started again, empty); every trainer restarts in place
    and resumes from the sidecars' RAM, an empty sidecar refilled from its peer's replicas
    (step 4's snapshot, or step 3's if the kill came before step 4's was complete everywhere). Each step
    checked its records; the state is the uninterrupted run's."""
    nodes, devices = (4, 12) if topology == "single" else (2, 6)  # 12 devices in all
    extra = ["--trainer-restarts", "1"] if topology == "multi" else []
    job, out = _submit(
        slurm, tmp_path, _env(slurm, tmp_path, devices), "--nodes", str(nodes), "--topology", topology,
        "--arena", "64M", *extra, "--", sys.executable, str(ELASTIC), str(tmp_path / "ckpt"), "4", lost,
    )  # fmt: skip
    state = slurm.wait_job(job, timeout=DEADLINE)
    output = out.read_text()
    results = [
        json.loads(line.split(" ", 1)[1]) for line in output.splitlines() if line.startswith("RESULT ")
    ]
    assert all(r["gap"] < 1e-5 for r in results), output[-4000:]
    if topology == "single":
        (result,) = results
        assert result["hosts"] == 3 and result["counts"]["loss"] == 1, result
        # the newest snapshot complete on the survivors: step 4's, or 3's if the kill beat it
        assert result["restored_from"] == "snapshot" and result["first_step"] in (4, 5), result
        assert "the sidecar died" in output  # the lost node's task says so, and fails
        assert state == "FAILED", output[-4000:]
    else:
        assert sorted(r["process"] for r in results) == [0, 1], output[-4000:]
        assert len({r["first_step"] for r in results}) == 1 and results[0]["first_step"] in (4, 5), results
        assert all(r["restart"] == 1 for r in results), results
        assert all(r["restored_from"] == "snapshot" for r in results), results
        assert "restarting every node's trainer in place" in output
        assert ("starting it again" in output) == (lost == "sidecar"), output[-4000:]
        assert state == "COMPLETED", output[-4000:]
    _assert_nothing_left(job)


def _wait_for(path: Path, output: Path | None = None) -> None:
    deadline = time.monotonic() + DEADLINE
    while not path.exists():
        log = output.read_text()[-3000:] if output and output.exists() else ""
        assert time.monotonic() < deadline, f"no {path}: {log}"
        time.sleep(0.5)


def _wait_output(out: Path, text: str, count: int = 1) -> str:
    deadline = time.monotonic() + DEADLINE
    while (output := out.read_text() if out.exists() else "").count(text) < count:
        assert time.monotonic() < deadline, output[-3000:]
        time.sleep(0.5)
    return output


def _tree(pid: int) -> list[psutil.Process]:
    top = psutil.Process(pid)
    return [top, *top.children(recursive=True)]


def test_scancel_ends_every_process_of_the_job(slurm, tmp_path) -> None:
    """A task killed outright (SIGKILL: an OOM kill) takes its trainer, sidecar and workers
    along and leaves its arena to no one; scancel then ends the other tasks the same way."""
    trainer = "import time; print('training', flush=True); time.sleep(600)"
    job, out = _submit(
        slurm, tmp_path, _env(slurm, tmp_path, 1), "--nodes", "4", "--arena", "64M",
        "--", sys.executable, "-c", trainer,
    )  # fmt: skip
    _wait_output(out, "training", 4)
    running = _job_processes(job)
    sidecars = [p for p in running if "colocar.sidecar" in " ".join(p.cmdline())]
    assert len(sidecars) == 4 and len(glob.glob(f"/dev/shm/colocar-slurm{job}-*.arena")) == 4
    record = json.loads((tmp_path / "job" / "step-0.0" / "sidecars" / "3.json").read_text())
    lost = _tree(record["pid"])  # node4's task: its trainer, its sidecar and any workers of it
    commands = [" ".join(p.cmdline()) for p in lost]
    assert any("colocar.sidecar" in c for c in commands) and any("time.sleep" in c for c in commands), (
        commands
    )
    lost[0].kill()
    _, alive = psutil.wait_procs(lost[1:], timeout=60)
    assert not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE], alive
    assert not glob.glob(f"/dev/shm/colocar-slurm{job}-node4-*")
    slurm.run(["scancel", str(job)])
    assert slurm.wait_job(job, timeout=DEADLINE) == "CANCELLED"
    _assert_nothing_left(job)
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in running)


def _preempted(slurm, tmp_path: Path, *args: str) -> tuple[int, Path]:
    """A single-controller job whose controller saves a last step on SIGTERM."""
    return _submit(
        slurm, tmp_path, _env(slurm, tmp_path, 4), "--nodes", "2", "--topology", "single",
        "--arena", "64M", *args, "--", sys.executable, str(PREEMPTED), str(tmp_path / "ckpt"),
    )  # fmt: skip


def _assert_saved_last(slurm, job: int, out: Path) -> None:
    """The job completed, its controller saved a last step, and the step is committed."""
    assert slurm.wait_job(job, timeout=DEADLINE) == "COMPLETED", out.read_text()[-3000:]
    saved = re.search(r"^SAVED (\d+)$", out.read_text(), re.M)
    assert saved, out.read_text()[-3000:]
    command = [sys.executable, "-m", "colocar", "ckpt", "ls", str(out.parent / "ckpt")]
    listing = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    assert saved.group(1) in listing.split(), listing
    _assert_nothing_left(job)


def test_the_time_limit_signal_saves_a_last_checkpoint(slurm, tmp_path) -> None:
    """What the rendered `--signal=TERM@S` sends before the time limit, SIGTERM to every task
    of the step (not to the batch shell), sent now with `scancel --signal=TERM`: the controller
    saves a last step through the sidecars, which stay until it is done; the job completes."""
    job, out = _preempted(slurm, tmp_path)
    _wait_output(out, "training 3")
    slurm.run(["scancel", "--signal=TERM", str(job)])
    _assert_saved_last(slurm, job, out)


@pytest.mark.slow
def test_a_real_time_limit_saves_a_last_checkpoint(slurm, tmp_path) -> None:
    """The same from Slurm's own timer: a one-minute job signalled 50 s before its limit."""
    job, out = _preempted(slurm, tmp_path, "--sbatch=--time=1", "--signal-seconds", "50")
    _assert_saved_last(slurm, job, out)


def _resolving_name() -> str:
    """This host's name where it resolves to an IPv4 address here, else `localhost`."""
    name = socket.gethostname()
    try:
        socket.getaddrinfo(name, None, socket.AF_INET)
    except socket.gaierror:
        return "localhost"
    return name


def test_a_task_that_cannot_start_ends_the_step_for_the_others(slurm, tmp_path) -> None:
    """The second node's sidecar cannot start (its shm directory is a file): the first
    node's task stops waiting for it at once, saying why, instead of at the 600 s timeout."""
    run = f"{sys.executable} -m colocar slurm run --arena 64M"
    (tmp_path / "a-file").write_text("")
    tasks = tmp_path / "tasks.conf"  # srun --multi-prog: one command line per task
    tasks.write_text(f"0 {run} -- sleep 600\n1 {run} --shm-dir {tmp_path / 'a-file'} -- sleep 600\n")
    command = ["srun", "-N", "2", "--ntasks-per-node=1", "--kill-on-bad-exit=0", "--multi-prog", str(tasks)]
    done = subprocess.run(
        command, env=_env(slurm, tmp_path, 1), capture_output=True, text=True, timeout=DEADLINE
    )
    assert done.returncode != 0
    assert "node2: the sidecar of node2 failed to start" in done.stderr, done.stderr[-3000:]
    assert "the job step ended before it started" in done.stderr, done.stderr[-3000:]
    assert "did not start within" not in done.stderr  # no task waited out its timeout


@pytest.fixture(params=["address", "name"])
def node_addresses(request, slurm):
    """How the nodes are reached: by the literal NodeAddr of the fixture (their names do not
    resolve), or, as on clusters whose node names resolve, by a name (this host's)."""
    if request.param == "address":
        yield "127.0.0.1"
        return
    name = _resolving_name()
    slurm.run(["scontrol", "update", "NodeName=node[1-2]", f"NodeAddr={name},{name}"])
    try:
        yield name
    finally:
        slurm.run(["scontrol", "update", "NodeName=node[1-2]", "NodeAddr=127.0.0.1,127.0.0.1"])


def test_salloc_and_a_notebook_attach_to_the_jobs_sidecars(slurm, tmp_path, node_addresses) -> None:
    """salloc, the sidecars started with srun in the allocation, and a real Jupyter kernel
    with the allocation's environment: a bare `colocar.connect()` finds them."""
    from notebook_helpers import Kernel

    granted = slurm.run(["salloc", "--no-shell", "-w", "node[1-2]", "--job-name", "interactive"])
    job = int(re.search(r"Granted job allocation (\d+)", granted.stderr + granted.stdout).group(1))
    env = _env(slurm, tmp_path, 2)
    command = ["srun", "--jobid", str(job), "-N", "2", "--ntasks-per-node=1", sys.executable, "-m", "colocar"]
    sidecars = subprocess.Popen([*command, "slurm", "run", "--topology", "single", "--arena", "64M"], env=env)
    try:
        connection = tmp_path / "job" / "connection.json"
        _wait_for(connection)
        published = json.loads(connection.read_text())["sidecars"]
        assert [a.rsplit(":", 1)[0] for a in published] == [node_addresses] * 2, published
        kernel_env = {
            "SLURM_JOB_ID": str(job),
            "COLOCAR_JOB_DIR": env["COLOCAR_JOB_DIR"],
            "XLA_FLAGS": env["XLA_FLAGS"],
        }
        with Kernel(kernel_env) as kernel:
            kernel.run("import colocar\ncluster = colocar.connect()")
            node = "lambda: __import__('os').environ['SLURMD_NODENAME']"  # where the sidecar runs
            cell = f"print(colocar.colocated({node}).on(cluster.hosts)())"
            assert kernel.run(cell).stdout.strip() == "['node1', 'node2']"
            kernel.run("cluster.close()")
    finally:
        slurm.run(["scancel", str(job)])
        sidecars.wait(timeout=DEADLINE)
    _assert_nothing_left(job)
