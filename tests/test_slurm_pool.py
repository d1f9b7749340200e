"""A shared pool as a Slurm job: `colocar slurm render --pool` and its tasks on a live Slurm.

Offline: the pool's script and what render refuses (exit 2, nothing on stdout). Live (the
`slurm` fixture: four slurmd on this machine, reached by NodeAddr): the rendered script,
submitted with sbatch on 2 nodes, runs a pool node on each and the agent on the first, which
writes pool.json; a tenant's job step in the pool's allocation (`srun --jobid --overlap`, two
jax.distributed processes) runs a colocated call, each process on the sidecar of its own
node; a wrong token is refused; scancel leaves no process, no /dev/shm file, no pool.json;
a node daemon that dies ends the pool job, which leaves nothing behind either.
"""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from slurm_helpers import TERMINAL_STATES, assert_job_left_nothing, job_processes

from colocar.protocol.tokens import new_token, write_token_file
from colocar.slurm.cli import main

ROOT = Path(__file__).resolve().parent.parent
PROGRAM = ROOT / "tests" / "programs" / "slurm_pool_job.py"
DEADLINE = 180.0


def _tenants(folder: Path, *names: str) -> Path:
    """A tenants file naming `names`, each with a fresh token file beside it."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in (*names, "stranger"):
        write_token_file(str(folder / f"{name}.token"), new_token())
    entries = {n: {"token_file": f"{n}.token", "quotas": {"arena": "16M", "processes": 1}} for n in names}
    path = folder / "tenants.yaml"
    path.write_text(yaml.safe_dump({"tenants": entries}))
    return path


def test_the_pool_script(capsys, tmp_path: Path) -> None:
    tenants = _tenants(tmp_path, "ann")
    main(["render", "--pool", "--nodes", "3", "--tenants", str(tenants), "--pool-dir", str(tmp_path / "p")])
    script, err = capsys.readouterr()
    sbatch = {line.split()[1] for line in script.splitlines() if line.startswith("#SBATCH")}
    assert {"--nodes=3", "--ntasks-per-node=1", "--job-name=colocar-pool", "--exclusive"} <= sbatch
    srun = script[script.index("\nsrun ") :]
    assert "--overlap" in srun and f"slurm pool-task --tenants {tenants}" in srun
    assert f"--pool-dir {tmp_path / 'p'}" in srun
    assert "srun --jobid=<pool job id> --overlap -N 3" in err and f"{tmp_path / 'p'}/pool.json" in err
    path = tmp_path / "pool.sh"
    path.write_text(script)
    subprocess.run(["bash", "-n", str(path)], check=True)


@pytest.mark.parametrize(
    "args,message",
    [
        (["--pool", "--nodes", "2"], "--pool needs --tenants FILE"),
        (["--pool", "--nodes", "2", "--tenants", "{bad}"], "expected a mapping 'tenants:'"),
        (["--pool", "--nodes", "2", "--tenants", "{nofile}"], "No such file"),
        (["--pool", "--nodes", "2", "--tenants", "{missing_token}"], "needs token_file"),
        (["--pool", "--nodes", "2", "--tenants", "{good}", "--", "python", "x"], "runs no command"),
        (["--pool", "--nodes", "2", "--tenants", "{good}", "--capacity", "lots"], "--capacity"),
        (["--pool", "--nodes", "0", "--tenants", "{good}"], "--nodes 0"),
        (["--pool", "--nodes", "2", "--tenants", "{good}", "--topology", "single"], "not a pool's"),
        (["--nodes", "2", "--tenants", "{good}", "--", "x"], "add --pool"),
    ],
)
def test_bad_pool_input_is_refused_with_nothing_on_stdout(args, message, capsys, tmp_path) -> None:
    files = {"good": _tenants(tmp_path, "ann"), "nofile": tmp_path / "none.yaml"}
    files["bad"] = tmp_path / "bad.yaml"
    files["bad"].write_text("- just a list\n")
    files["missing_token"] = tmp_path / "missing.yaml"
    files["missing_token"].write_text("tenants:\n  ann: {priority: 1}\n")
    with pytest.raises(SystemExit) as exc:
        main(["render", *(a.format(**files) for a in args)])
    out, err = capsys.readouterr()
    assert exc.value.code == 2 and out == "" and message in err, err


def _env(slurm, tmp_path: Path) -> dict[str, str]:
    """What the jobs inherit from the submitting shell: not the suite's colocar variables."""
    env = {k: v for k, v in slurm.env.items() if not k.startswith(("COLOCAR_", "JAX_COORD", "XLA_FLAGS"))}
    env.update(JAX_PLATFORMS="cpu", COLOCAR_JOB_DIR=str(tmp_path / "job"))
    return env


def _wait_pool_file(slurm, job: int, path: Path, out: Path) -> dict:
    deadline = time.monotonic() + DEADLINE
    while not path.exists():
        log = out.read_text()[-3000:] if out.exists() else ""
        assert slurm.job(job).get("JobState") not in TERMINAL_STATES, log
        assert time.monotonic() < deadline, f"no {path}: {log}"
        time.sleep(0.5)
    return json.loads(path.read_text())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _tenant_step(job: int, env: dict[str, str], pool_file: Path, token: Path) -> list[dict]:
    """Two jax.distributed processes in the pool's allocation, one per node; their results."""
    command = ["srun", f"--jobid={job}", "--overlap", "-N2", "--ntasks-per-node=1", sys.executable]
    command += [str(PROGRAM), str(pool_file), str(token), f"127.0.0.1:{_free_port()}"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=DEADLINE, cwd=ROOT)
    output = done.stdout + done.stderr
    assert done.returncode == 0 and done.stdout.count("OK") == 2, output[-4000:]
    lines = done.stdout.splitlines()
    return [json.loads(line.split(" ", 1)[1]) for line in lines if line.startswith("RESULT ")]


def _submit_pool(slurm, tmp_path: Path) -> tuple[int, Path, Path, dict[str, str]]:
    """The rendered pool script on 2 nodes, submitted with sbatch: (job, tenants file, pool
    folder, environment)."""
    tenants = _tenants(tmp_path / "tenants", "ann")
    pool_dir, script, out = tmp_path / "pool", tmp_path / "pool.sh", tmp_path / "out.txt"
    render = [sys.executable, "-m", "colocar", "slurm", "render", "--pool", "--nodes", "2"]
    render += ["--tenants", str(tenants), "--capacity", "64M", "--pool-dir", str(pool_dir)]
    script.write_text(subprocess.run(render, check=True, capture_output=True, text=True).stdout)
    env = _env(slurm, tmp_path)
    job = slurm.sbatch(script, env=env, args=["--output", str(out), "--chdir", str(ROOT)])
    return job, tenants, pool_dir, env


def test_a_pool_job_serves_tenants_steps_on_its_nodes(slurm, tmp_path) -> None:
    import colocar
    from colocar.controller_bridge import pool_client as client

    job, tenants, pool_dir, env = _submit_pool(slurm, tmp_path)
    out = tmp_path / "out.txt"
    try:
        record = _wait_pool_file(slurm, job, pool_dir / "pool.json", out)
        assert record["hosts"] == 2 and record["slurm_job_id"] == job, record
        results = _tenant_step(job, env, pool_dir / "pool.json", tenants.parent / "ann.token")
        assert sorted(r["process"] for r in results) == [0, 1], results
        assert sorted(r["node"] for r in results) == sorted(record["machines"]), results
        for r in results:  # each process on the sidecar of its own node
            assert r["sidecar"] == {"SLURMD_NODENAME": r["node"], "COLOCAR_NODE_NAME": r["node"]}, r
        admin = Path(record["admin_token_file"])  # `colocar pool status` reads the record as is
        assert stat.S_IMODE(admin.stat().st_mode) == 0o600
        status = client.pool_status(str(pool_dir / "pool.json"), admin.read_text().strip())
        assert status["hosts"] == 2 and "ann" in status["tenants"], status
        stranger = str(tenants.parent / "stranger.token")
        with pytest.raises(colocar.AuthError, match="is this token in the pool's tenants file"):
            colocar.connect(pool=str(pool_dir / "pool.json"), token_file=stranger)
    finally:
        slurm.run(["scancel", str(job)])
        state = slurm.wait_job(job, timeout=DEADLINE)
    assert state == "CANCELLED", out.read_text()[-3000:]
    assert_job_left_nothing(job, (pool_dir / "pool.json", tmp_path / "job"))
    assert "stopping the pool's tenants and daemons here" in out.read_text()
    assert os.listdir(pool_dir) == []


def test_a_pool_node_that_dies_ends_the_pool_job(slurm, tmp_path) -> None:
    """The second node's daemon killed outright: every task stops, the job fails, and it
    leaves nothing behind either."""
    job, _, pool_dir, _ = _submit_pool(slurm, tmp_path)
    out = tmp_path / "out.txt"
    try:
        _wait_pool_file(slurm, job, pool_dir / "pool.json", out)
        (node,) = [
            p
            for p in job_processes(job)
            if "colocar.pool.node_main" in " ".join(p.cmdline()) and p.environ()["SLURMD_NODENAME"] == "node2"
        ]
        node.kill()
        state = slurm.wait_job(job, timeout=DEADLINE)
    finally:
        slurm.run(["scancel", str(job)])
    output = out.read_text()
    assert state == "FAILED" and "pool-node-node2 exited (-9)" in output, output[-3000:]
    assert "the pool's job step ended: node2" in output, output[-3000:]
    assert_job_left_nothing(job, (pool_dir / "pool.json", tmp_path / "job"))
