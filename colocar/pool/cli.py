"""`colocar pool up|status|admit|down|node`: a shared, long-running pool of sidecars.

`up` starts the pool's agent in a session of its own (it outlives the command and the jobs),
with a fresh admin token, and writes the pool file (`DIR/pool.json`: the agent's address and
pid, the admin token's file) that `connect(pool=...)` and the other commands read. `down`
stops every tenant's sidecars, then the agent, and removes what they left. A pool spanning
machines runs `colocar pool node` on each and `up --nodes` names them (`nodes.py`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import psutil

from colocar import pids
from colocar.cli_help import HelpFormatter
from colocar.controller_bridge import pool_client as client
from colocar.controller_bridge.local.sidecars import Sidecar, wait_ready
from colocar.errors import ColocarError
from colocar.protocol.tokens import new_token, write_token_file
from colocar.shm.arena import remove_stale_arenas
from colocar.sidecar.auth import read_token_file

DEFAULT_DIR = "colocar-pool"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="colocar pool", description=__doc__, formatter_class=HelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="start a pool", formatter_class=HelpFormatter)
    up.add_argument("--hosts", type=int, default=1, help="sidecars per tenant (one per host) on this machine")
    up.add_argument(
        "--nodes", help="a pool spanning machines: its nodes (colocar pool node), HOST:PORT,... host by host"
    )
    up.add_argument("--node-token-file", help="with --nodes: the token the nodes were started with")
    up.add_argument("--tenants", required=True, help="the tenants file (YAML; re-read when it changes)")
    up.add_argument("--dir", default=DEFAULT_DIR, help="the pool's folder (pool.json, logs)")
    up.add_argument("--capacity", default="1G", help="arena bytes per host for all tenants served at once")
    up.add_argument("--max-tenants", type=int, default=8, help="tenants served at once")
    up.add_argument(
        "--idle-seconds", type=float, default=60.0, help="a tenant without sessions this long is stopped"
    )
    up.add_argument("--lease-seconds", type=float, default=30.0, help="the sidecars' session lease")
    up.add_argument("--address", default="127.0.0.1:0", help="the agent's host:port (port 0: any)")
    up.add_argument("--shm-dir", default="/dev/shm", help="where the tenants' arenas live")
    up.add_argument(
        "--metrics-port", type=int, help="the agent's per-tenant Prometheus metrics (0: any port)"
    )
    for name, what in (("status", "the pool's tenants, their use and the queue"), ("down", "stop the pool")):
        s = sub.add_parser(name, help=what, formatter_class=HelpFormatter)
        s.add_argument("--pool", default=os.path.join(DEFAULT_DIR, "pool.json"), help="the pool file")
        s.add_argument("--token-file", help="a tenant's token (default: the pool's admin token)")
        if name == "status":
            s.add_argument("--json", action="store_true", help="print JSON")
    sub.add_parser(
        "node",
        help="serve one machine of a pool spanning several (colocar pool node --help)",
        add_help=False,
    )
    a = sub.add_parser(
        "admit", help="wait for a tenant's turn; print its sidecars", formatter_class=HelpFormatter
    )
    a.add_argument("--pool", default=os.path.join(DEFAULT_DIR, "pool.json"), help="the pool file")
    a.add_argument("--token-file", required=True, help="the tenant's token")
    a.add_argument("--timeout", type=float, default=0.0, help="give up after this many seconds (0: never)")
    return p


def up(args: argparse.Namespace) -> dict:
    if args.nodes and not args.node_token_file:
        raise ColocarError("--nodes needs --node-token-file: the token the pool's nodes were started with")
    folder = os.path.abspath(args.dir)
    os.makedirs(folder, mode=0o700, exist_ok=True)
    pool_file = os.path.join(folder, "pool.json")
    if os.path.exists(pool_file) and _agent(pool_file) is not None:
        raise ColocarError(f"a pool is already up at {pool_file}: colocar pool down --pool {pool_file}")
    admin = os.path.join(folder, "admin.token")
    write_token_file(admin, new_token())
    argv = [
        sys.executable, "-m", "colocar.pool.agent_main",
        "--tenants", os.path.abspath(args.tenants), "--admin-token-file", admin, "--workdir", folder,
        "--hosts", str(args.hosts), "--capacity", args.capacity, "--max-tenants", str(args.max_tenants),
        "--idle-seconds", str(args.idle_seconds), "--lease-seconds", str(args.lease_seconds),
        "--shm-dir", args.shm_dir, "--address", args.address,
        *_nodes_flags(args),
        *(["--metrics-port", str(args.metrics_port)] if args.metrics_port is not None else []),
    ]  # fmt: skip
    agent = Sidecar(0, folder, label="agent")  # the same start: its own session, a ready pipe, a log
    agent.spawn(argv, dict(os.environ))
    wait_ready([agent], 60.0)
    hosts = len(args.nodes.split(",")) if args.nodes else args.hosts
    record = pool_record(dict(agent.info or {}), admin, hosts, args.shm_dir, agent.log_file)
    write_pool_file(pool_file, record)
    print(f"pool up: agent at {record['address']} (pid {record['pid']}); pool file {pool_file}")
    return record


def pool_record(info: dict, admin_token_file: str, hosts: int, shm_dir: str, log: str, **extra: Any) -> dict:
    """What a pool file holds: the agent's address and pid (from its ready line) and start
    time (a pid reused later is not taken for it), the admin token's file, the hosts, where
    the arenas are, the agent's log; `extra` for what a launcher adds (Slurm: the job id)."""
    return {
        **info,
        **pids.start_of(info["pid"]),
        "admin_token_file": admin_token_file,
        "hosts": hosts,
        "shm_dir": shm_dir,
        "log": log,
        **extra,
    }


def write_pool_file(path: str, record: dict) -> None:
    """Writes the pool file whole (a reader never sees half of it)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fresh = f"{path}.{os.getpid()}.tmp"
    with open(fresh, "w") as f:
        json.dump(record, f, indent=1)
    os.replace(fresh, path)


def _nodes_flags(args: argparse.Namespace) -> list[str]:
    if not args.nodes:
        return []
    return ["--nodes", args.nodes, "--node-token-file", os.path.abspath(args.node_token_file)]


def _agent(pool_file: str) -> psutil.Process | None:
    """The pool's agent process while it runs (its pid and start time match the record)."""
    try:
        with open(pool_file) as f:
            record = json.load(f)
    except (OSError, ValueError):
        return None
    return pids.process_with(record.get("pid", -1), record) if isinstance(record, dict) else None


def _token(args: argparse.Namespace) -> str:
    if args.token_file:
        return read_token_file(args.token_file)
    try:
        with open(args.pool) as f:
            return read_token_file(json.load(f)["admin_token_file"])
    except (OSError, ValueError, KeyError) as e:
        raise ColocarError(f"pool file {args.pool}: {e} (is the pool up? colocar pool up)") from None


def down(args: argparse.Namespace) -> None:
    agent = _agent(args.pool)
    if agent is None:
        raise ColocarError(f"no pool runs at {args.pool}")
    with open(args.pool) as f:
        record = json.load(f)
    client.shutdown(args.pool, _token(args))
    try:
        agent.wait(timeout=120)
    except psutil.TimeoutExpired:
        agent.kill()
    remove_stale_arenas(record.get("shm_dir", "/dev/shm"))
    os.unlink(args.pool)
    print("pool down")


def status(args: argparse.Namespace) -> None:
    found = client.pool_status(args.pool, _token(args))
    if args.json:
        print(json.dumps(found))
        return
    print(f"pool: {found['served']} of {found['max_tenants']} tenants served, {found['waiting']} waiting")
    for name, t in found["tenants"].items():
        use = t["hosts"]
        sessions = sum(h.get("sessions", 0) for h in use)
        arena = sum(h.get("arena_used", 0) for h in use)
        state = f"served at {', '.join(t['addresses'])}" if t["served"] else "not served"
        print(
            f"  {name} (priority {t['priority']}): {state}; {sessions} sessions, {arena} arena bytes in use"
        )
    for w in found["queue"]:
        print(f"  queue {w['position']}: {w['tenant']} (waiting {w['waiting_seconds']:.0f} s)")
    if found.get("tenants_file_error"):
        print(f"  tenants file: {found['tenants_file_error']}")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["node"]:
        from .node_main import main as node_main

        return node_main(argv[1:])
    args = build_parser().parse_args(argv)
    if args.command == "up":
        up(args)
    elif args.command == "down":
        down(args)
    elif args.command == "status":
        status(args)
    else:
        admitted = client.admit(args.pool, read_token_file(args.token_file), queue_timeout=args.timeout)
        print(",".join(admitted.addresses))
