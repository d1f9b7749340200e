"""`colocar slurm render` and the parts of `colocar slurm run` that need no scheduler: the
script's parts, refused input, the error outside an srun step, the ports (JAX's own Slurm
coordinator port; a port held by another process skipped), the job directory's token, and
`colocar.connect()` reading the job's connection file. The jobs themselves run on a live
Slurm in tests/test_slurm_jobs.py.
"""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from colocar.slurm import ports
from colocar.slurm.cli import main
from colocar.slurm.jobdir import JobDir
from colocar.slurm.sidecar import NodeSidecar
from colocar.slurm.task import SlurmError, SlurmTask

STEP_ENV = {
    "SLURM_JOB_ID": "4242",
    "SLURM_STEP_ID": "0",
    "SLURM_PROCID": "1",
    "SLURM_NTASKS": "2",
    "SLURM_NODEID": "1",
    "SLURM_STEP_NUM_NODES": "2",
    "SLURMD_NODENAME": "node2",
    "SLURM_STEP_NODELIST": "node[1-2]",
    "SLURM_LOCALID": "0",
}


def _render(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    main(["render", *args])
    return capsys.readouterr().out


def test_multi_controller_script_keeps_an_elastic_job_alive(capsys, tmp_path: Path) -> None:
    script = _render(
        capsys, "--nodes", "4", "--trainer-restarts", "2", "--", "python", "train.py", "--ckpt", "/a b"
    )
    lines = script.splitlines()
    assert lines[0] == "#!/bin/bash"
    sbatch = {line.split()[1] for line in lines if line.startswith("#SBATCH")}
    assert {"--nodes=4", "--ntasks-per-node=1", "--no-kill", "--requeue", "--signal=TERM@120"} <= sbatch
    srun = script[script.index("srun ") :]
    assert "--kill-on-bad-exit=0" in srun and "--ntasks-per-node=1" in srun
    assert (
        f"{sys.executable} -m colocar slurm run --topology multi --arena 16G --trainer-restarts 2 --" in srun
    )
    assert "python train.py --ckpt '/a b'" in srun  # quoted for the shell
    path = tmp_path / "job.sh"
    path.write_text(script)
    subprocess.run(["bash", "-n", str(path)], check=True)  # valid shell


def test_single_controller_script(capsys) -> None:
    script = _render(
        capsys,
        "--nodes",
        "2",
        "--topology",
        "single",
        "--arena",
        "512M",
        "--sbatch=--time=1:00:00",
        "--",
        "python",
        "c.py",
    )
    assert "#SBATCH --time=1:00:00" in script
    assert "slurm run --topology single --arena 512M -- \\\n    python c.py" in script


@pytest.mark.parametrize(
    "args,message",
    [
        (
            ["--nodes", "2", "--topology", "single", "--trainer-restarts", "1", "--", "x"],
            "use --topology multi",
        ),
        (["--nodes", "0", "--", "x"], "--nodes 0"),
        (["--nodes", "2", "--arena", "lots", "--", "x"], "--arena"),
        (["--nodes", "2"], "give the command after --"),
        (["--nodes", "2", "--trainer-restarts", "-1", "--", "x"], "must be 0 or more"),
    ],
)
def test_bad_input_is_refused_with_nothing_on_stdout(args, message, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["render", *args])
    out, err = capsys.readouterr()
    assert exc.value.code == 2 and out == "" and message in err


def test_run_outside_an_srun_step_is_a_clear_error(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")}
    done = subprocess.run(
        [sys.executable, "-m", "colocar", "slurm", "run", "--", "true"],
        env=env,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 1
    assert "must run as a task of a job step, under srun" in done.stderr and "SLURM_JOB_ID" in done.stderr


def test_one_task_per_node() -> None:
    with pytest.raises(SlurmError, match="ntasks-per-node=1"):
        SlurmTask.from_env({**STEP_ENV, "SLURM_NTASKS": "4"})
    assert SlurmTask.from_env(STEP_ENV).node_name == "node2"


def test_the_jax_coordinator_port_is_jaxs_own(monkeypatch) -> None:
    """Where node names resolve, JAX's own Slurm detection and colocar agree on the address."""
    from jax._src.clusters.slurm_cluster import SlurmCluster

    for name, value in {**STEP_ENV, "SLURM_STEP_NODELIST": "localhost"}.items():
        monkeypatch.setenv(name, value)
    assert SlurmCluster.is_env_present()
    assert SlurmCluster.get_coordinator_address(None, None) == f"localhost:{ports.jax_coordinator_port(4242)}"
    assert ports.jax_coordinator_port(4242, 1) != ports.jax_coordinator_port(4242)  # a restart moves it


def test_sidecar_ports_differ_per_node_and_job() -> None:
    first = {(job, node): next(ports.sidecar_ports(job, node)) for job in (1, 2, 1501) for node in range(4)}
    assert len({first[(1, n)] for n in range(4)} | {first[(2, n)] for n in range(4)}) == 8
    assert all(20000 <= p < 32000 for p in first.values())
    assert len(set(ports.sidecar_ports(7, 0))) == 16  # the retries are other ports


def test_the_token_is_written_once_and_kept_private(tmp_path: Path) -> None:
    jobdir = str(tmp_path / "job")
    with ThreadPoolExecutor(8) as pool:
        files = list(pool.map(lambda _: JobDir(jobdir).token_file(), range(8)))
    assert len(set(files)) == 1
    assert stat.S_IMODE(os.stat(files[0]).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(jobdir).st_mode) == 0o700
    assert len(Path(files[0]).read_text()) == 64 and not list(Path(jobdir).glob("*.tmp"))
    os.chmod(files[0], 0o644)
    with pytest.raises(SlurmError, match="readable by others"):
        JobDir(jobdir).token_file()


def test_connect_reads_the_jobs_connection_file(make_cluster, tmp_path: Path, monkeypatch) -> None:
    """A bare `colocar.connect()` in an salloc shell finds the sidecars `colocar slurm run`
    published; without them it says where it looked."""
    import colocar

    sidecars = make_cluster(hosts=2)
    jobdir = tmp_path / "job"
    for name in ("COLOCAR_SIDECARS", "COLOCAR_TOKEN", "COLOCAR_TOKEN_FILE", "COLOCAR_JOB_DIR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("HOME", str(tmp_path))
    with pytest.raises(colocar.ColocarError, match="colocar/slurm/77/connection.json"):
        colocar.connect()
    jobdir = tmp_path / ".colocar" / "slurm" / "77"
    JobDir(str(jobdir)).write_connection([h.address for h in sidecars.hosts], sidecars.token_file, "single")
    assert json.loads((jobdir / "connection.json").read_text())["topology"] == "single"
    with colocar.connect() as cluster:
        assert [h.address for h in cluster.hosts] == [h.address for h in sidecars.hosts]
        assert colocar.colocated(lambda: 6 * 7).on(cluster.hosts)() == [42, 42]


def test_a_port_another_process_holds_is_skipped(tmp_path: Path, shm_dir: str) -> None:
    """Another job (or anything) on the node holds the derived port: the sidecar takes the
    next candidate, serves there, and leaves no arena when stopped."""
    task = SlurmTask.from_env(STEP_ENV)
    candidates = list(ports.sidecar_ports(task.job_id, task.node_id))
    token_file = JobDir(str(tmp_path / "job")).token_file()
    with socket.socket() as held:
        held.bind(("0.0.0.0", candidates[0]))
        held.listen()
        options = ["--arena-size", str(16 << 20), "--processes", "0"]
        sidecar = NodeSidecar(task, token_file, shm_dir, str(tmp_path), options).start()
        try:
            assert sidecar.port == candidates[1], sidecar.log_tail()
            assert os.path.exists(sidecar.info["arena"])
        finally:
            sidecar.stop()
    assert sidecar.exited() == 0, sidecar.log_tail()  # -9: its drain outlasted stop()'s wait
    assert not os.path.exists(sidecar.info["arena"])
