"""The live Slurm fixture is a real cluster: srun spreads tasks over four nodes with the usual
SLURM_* variables, sbatch jobs run to COMPLETED, nodes report NodeAddr=127.0.0.1, and scancel
ends a running job together with its processes.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import psutil
from helpers import wait_for
from slurm_helpers import LiveSlurm

STEP_VARIABLES = (
    "SLURM_JOB_ID",
    "SLURM_PROCID",
    "SLURM_NODEID",
    "SLURMD_NODENAME",
    "SLURM_STEP_NODELIST",
    "SLURM_NTASKS",
    "SLURM_LOCALID",
)


def test_srun_runs_one_task_per_node_with_slurm_variables(slurm: LiveSlurm) -> None:
    dump = f"import json, os; print(json.dumps({{k: os.environ.get(k) for k in {STEP_VARIABLES!r}}}))"
    out = slurm.run(["srun", "-N4", "-n4", sys.executable, "-c", dump], timeout=180).stdout
    tasks = sorted(
        (json.loads(line) for line in out.splitlines() if line.strip()), key=lambda t: t["SLURM_PROCID"]
    )
    assert [t["SLURM_PROCID"] for t in tasks] == ["0", "1", "2", "3"]
    assert sorted(t["SLURMD_NODENAME"] for t in tasks) == ["node1", "node2", "node3", "node4"]
    assert sorted(t["SLURM_NODEID"] for t in tasks) == ["0", "1", "2", "3"]
    assert len({t["SLURM_JOB_ID"] for t in tasks}) == 1 and tasks[0]["SLURM_JOB_ID"].isdigit()
    for task in tasks:
        assert task["SLURM_STEP_NODELIST"] == "node[1-4]"
        assert task["SLURM_NTASKS"] == "4"
        assert task["SLURM_LOCALID"] == "0"  # one task per node


def test_sbatch_job_completes_and_writes_its_output(slurm: LiveSlurm, tmp_path: Path) -> None:
    script = tmp_path / "hello.sh"
    script.write_text('#!/bin/bash\necho "hello from $SLURMD_NODENAME job $SLURM_JOB_ID"\n')
    out = tmp_path / "hello.out"
    job_id = slurm.sbatch(script, args=["--output", str(out), "--chdir", str(tmp_path)])
    assert slurm.wait_job(job_id) == "COMPLETED"
    text = wait_for(lambda: out.exists() and out.read_text(), "the job's output file")
    assert f"job {job_id}" in text and "hello from node" in text


def test_nodes_report_their_address(slurm: LiveSlurm) -> None:
    record = slurm.run(["scontrol", "show", "node", "-o", "node2"]).stdout
    assert "NodeName=node2 " in record
    assert "NodeAddr=127.0.0.1 " in record


def test_scancel_ends_a_running_job_and_its_processes(slurm: LiveSlurm, tmp_path: Path) -> None:
    pid_file = tmp_path / "sleep.pid"
    script = tmp_path / "sleeper.sh"
    script.write_text(
        f"#!/bin/bash\nsleep 600 &\necho $! > {pid_file}.tmp\nmv {pid_file}.tmp {pid_file}\nwait\n"
    )
    job_id = slurm.sbatch(script, args=["--output", str(tmp_path / "sleeper.out"), "--chdir", str(tmp_path)])
    sleep_pid = int(
        wait_for(lambda: pid_file.exists() and pid_file.read_text().strip(), "the sleep's pid", 120)
    )
    assert slurm.job(job_id)["JobState"] == "RUNNING"
    assert sleep_pid in job_processes(str(job_id))  # the sleep runs, and the scan below can see it
    slurm.run(["scancel", str(job_id)])
    assert slurm.wait_job(job_id) == "CANCELLED"
    wait_for(lambda: not job_processes(str(job_id)), "the cancelled job's processes to end", 120)


def job_processes(job_id: str) -> list[int]:
    """Live processes whose environment says they belong to the job (its script and the sleep)."""
    found = []
    for process in psutil.process_iter():
        try:
            if process.status() != psutil.STATUS_ZOMBIE and process.environ().get("SLURM_JOB_ID") == job_id:
                found.append(process.pid)
        except psutil.Error:
            pass
    return found
