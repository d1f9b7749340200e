"""`colocar sessions ls|close|stop` and `colocar clean` as a user runs them: the real command in
a subprocess, against real sidecars.

`ls` lists a named session with its state; `close` ends it, and its controller's next call
says who closed it; a wrong token or an unknown session is one line on stderr and exit 1.
`stop` ends a persistent named local cluster another process started. `clean` removes what
killed sidecars and a killed controller left (arenas, their sockets, the work folder) and
touches nothing a live sidecar uses.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile

import pytest
from helpers import running, wait_for
from notebook_helpers import REPO

import colocar
from colocar.pids import start_of


def _colocar(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "colocar.cli", *args]
    environment = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    return subprocess.run(command, capture_output=True, text=True, timeout=120, env=environment)


@colocar.colocated
def ident(x):
    return x


def test_sessions_ls_and_close(make_cluster):
    sidecar = make_cluster(persist=True)
    address, token_file = sidecar.hosts[0].address, sidecar.token_file
    with colocar.connect([address], token_file=token_file, session="nb@alice") as c:
        listed = _colocar("sessions", "ls", address, "--token-file", token_file, "--json")
        assert listed.returncode == 0, listed.stderr
        sessions = {s["name"]: s for s in json.loads(listed.stdout.splitlines()[-1])["sessions"]}
        assert sessions["nb@alice"]["state"] == "attached"
        assert sessions["nb@alice"]["controller"].endswith(f":{os.getpid()}")
        table = _colocar("sessions", "ls", address, "--token-file", token_file).stdout
        assert "nb@alice" in table and "attached" in table

        closed = _colocar("sessions", "close", "nb@alice", address, "--token-file", token_file)
        assert closed.returncode == 0, closed.stderr
        with pytest.raises(colocar.SessionEndedError, match="closed by `colocar sessions close`"):
            ident.on(c.hosts[0])(1)

    missing = _colocar("sessions", "close", "nobody", address, "--token-file", token_file)
    assert missing.returncode == 1 and "no session 'nobody'" in missing.stderr
    wrong = _colocar("sessions", "ls", address, env={"COLOCAR_TOKEN": "wrong"})
    assert wrong.returncode == 1 and "UNAUTHENTICATED" in wrong.stderr and "Traceback" not in wrong.stderr


def _started_in_a_child(session: str | None, env: dict[str, str], persist: bool = True) -> dict:
    """A local cluster that a child process starts and leaves (it is killed: nothing closed it);
    its record (sidecar pids and arenas, the work folder)."""
    code = (
        "import colocar, json, os, sys\n"
        f"c = colocar.local_cluster(hosts=2, arena_size=16 << 20, processes=0, persist={persist}, "
        f"session={session!r})\n"
        "print(json.dumps({'workdir': os.path.dirname(c.token_file), "
        "'hosts': [{'pid': p.pid, 'arena': h.connection.session.info.arena_path} "
        "for p, h in zip(c.processes, c.hosts)]}), flush=True)\n"
        "sys.stdin.read()\n"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", code],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO), **env},
    )
    record = json.loads(child.stdout.readline())  # type: ignore[union-attr]
    child.kill()
    child.wait()
    return record


def test_sessions_stop_ends_a_persistent_named_local_cluster(tmp_path, shm_dir, monkeypatch):
    env = {"COLOCAR_STATE_DIR": str(tmp_path / "state"), "COLOCAR_SHM_DIR": tempfile.mkdtemp(dir=shm_dir)}
    record = _started_in_a_child("kept", env)
    pids = [h["pid"] for h in record["hosts"]]
    try:
        assert running(pids) == pids  # persistent: they outlived the killed controller
        monkeypatch.setenv("COLOCAR_STATE_DIR", env["COLOCAR_STATE_DIR"])
        with pytest.raises(colocar.ColocarError, match="2 persistent sidecars running.*sessions stop kept"):
            colocar.local_cluster(hosts=1, persist=True, session="kept")  # another size: not these
        listed = _colocar("sessions", "ls", "--json", env=env)  # no address: this machine's clusters
        assert listed.returncode == 0, listed.stderr
        assert {s["name"] for s in json.loads(listed.stdout.splitlines()[-1])["sessions"]} == {"kept"}
        stopped = _colocar("sessions", "stop", "kept", env=env)
        assert stopped.returncode == 0, stopped.stderr
        wait_for(lambda: not running(pids), "the sidecars to stop")
        assert os.listdir(env["COLOCAR_SHM_DIR"]) == [] and not os.path.exists(record["workdir"])
        again = _colocar("sessions", "stop", "kept", env=env)
        assert again.returncode == 1 and "no persistent local cluster" in again.stderr
    finally:
        for pid in pids:
            if running([pid]):
                os.kill(pid, signal.SIGKILL)
        os.rmdir(env["COLOCAR_SHM_DIR"])


def test_clean_removes_what_killed_sidecars_and_their_controller_left(tmp_path, shm_dir, make_cluster):
    folder = tempfile.mkdtemp(dir=shm_dir)
    (tmp_path / "tmp").mkdir()  # the killed controller's own: local clusters other tests start look in /tmp
    env = {"COLOCAR_STATE_DIR": str(tmp_path / "state"), "COLOCAR_SHM_DIR": folder}
    env["TMPDIR"] = str(tmp_path / "tmp")
    live = make_cluster(shm_dir=folder)  # a live sidecar in the same folder (started first: a
    live_arena = live.hosts[0].connection.session.info.arena_path  # sidecar starting sweeps it)
    record = _started_in_a_child("left", env)
    for host in record["hosts"]:  # the sidecars die too, unable to clean (an OOM kill of all)
        os.kill(host["pid"], signal.SIGKILL)
    wait_for(lambda: not running([h["pid"] for h in record["hosts"]]), "the sidecars to die")
    arenas = [h["arena"] for h in record["hosts"]]
    assert all(os.path.exists(a) for a in arenas) and os.path.isdir(record["workdir"])

    cleaned = _colocar("clean", "--shm-dir", folder, env=env)
    assert cleaned.returncode == 0, cleaned.stderr
    assert not any(os.path.exists(a) for a in arenas) and not os.path.exists(record["workdir"])
    assert all(f"removed {a}" in cleaned.stdout for a in arenas)
    assert os.path.exists(live_arena) and ident.on(live.hosts[0])(2) == 2
    live.close()
    os.rmdir(folder)


def test_a_cluster_starting_removes_what_a_killed_controller_left_and_only_that(
    tmp_path, shm_dir, make_cluster
):
    """A restarted kernel: its sidecars end with it, and its work folder (logs, token) stays
    until the next local cluster starts. A live controller's folder stays, even when its
    sidecars were killed: their logs are there. (The killed controllers use a temporary folder
    of their own: local clusters other tests start look in /tmp.)"""
    (tmp_path / "tmp").mkdir()
    env = {
        "COLOCAR_STATE_DIR": str(tmp_path / "state"),
        "COLOCAR_SHM_DIR": tempfile.mkdtemp(dir=shm_dir),
        "TMPDIR": str(tmp_path / "tmp"),
    }
    killed = _started_in_a_child(None, env, persist=False)
    wait_for(lambda: not running([h["pid"] for h in killed["hosts"]]), "the sidecars to end with it")
    assert os.path.isdir(killed["workdir"])
    later = _started_in_a_child(None, env, persist=False)  # killed too, once started
    assert not os.path.exists(killed["workdir"])
    wait_for(lambda: not running([h["pid"] for h in later["hosts"]]), "the sidecars to end with it")

    mine = make_cluster()
    os.kill(mine.processes[0].pid, signal.SIGKILL)
    wait_for(lambda: not running([mine.processes[0].pid]), "the sidecar to die")
    make_cluster()
    assert os.path.exists(mine.log_files[0]) and os.path.exists(mine.token_file)
    os.rmdir(env["COLOCAR_SHM_DIR"])


def test_a_stale_record_never_signals_a_process_that_took_its_sidecars_number(tmp_path, monkeypatch):
    """A record whose sidecars died long ago: their pids may name other processes by now."""
    from colocar.controller_bridge.local import records

    monkeypatch.setenv("COLOCAR_STATE_DIR", str(tmp_path / "state"))
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        workdir = tmp_path / "work"
        workdir.mkdir()
        start = start_of(bystander.pid)
        earlier = {"started": start["started"] - 3600, "since_boot": start["since_boot"] - 3600}
        host = {"pid": bystander.pid, **start, **earlier, "address": "x"}
        records.save(
            str(workdir), "stale", {"workdir": str(workdir), "argv": [], "arena_bytes": 0, "hosts": [host]}
        )
        assert not records.running(host)
        stopped = _colocar("sessions", "stop", "stale", env={"COLOCAR_STATE_DIR": str(tmp_path / "state")})
        assert stopped.returncode == 0, stopped.stderr
        assert bystander.poll() is None  # untouched
        assert records.read("stale") is None and not workdir.exists()
    finally:
        bystander.kill()
        bystander.wait()


def test_reattaching_when_one_recorded_sidecar_died_starts_anew(tmp_path, shm_dir, monkeypatch):
    """The session lost part of what it held: the survivor is stopped (a warning says so) and
    the cluster starts again, under the same name."""
    env = {"COLOCAR_STATE_DIR": str(tmp_path / "state"), "COLOCAR_SHM_DIR": tempfile.mkdtemp(dir=shm_dir)}
    record = _started_in_a_child("half", env)
    old = [h["pid"] for h in record["hosts"]]
    os.kill(old[1], signal.SIGKILL)
    wait_for(lambda: running(old) == old[:1], "one sidecar to die")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    try:
        with pytest.warns(UserWarning, match=r"sidecars of \['host1'\] are gone; stopping the others"):
            c = colocar.local_cluster(hosts=2, arena_size=16 << 20, processes=0, persist=True, session="half")
        try:
            assert c.took_over == {} and running(old) == []
            assert not set(old) & {p.pid for p in c.processes}
            assert ident.on(c.hosts[1])(3) == 3
        finally:
            c.shutdown()
        assert os.listdir(env["COLOCAR_SHM_DIR"]) == []
    finally:
        for pid in running(old):
            os.kill(pid, signal.SIGKILL)
        os.rmdir(env["COLOCAR_SHM_DIR"])
