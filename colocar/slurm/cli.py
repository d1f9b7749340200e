"""`colocar slurm render|run|pool-task`: print a job's sbatch script, or run one task of its step.

`render` writes the script on stdout; bad input exits 2 with a message and nothing on
stdout. `run` is what the script's `srun` starts on every node (README: Run on Slurm).
`render --pool` prints a long-running shared pool's script instead (no COMMAND), whose tasks
are `pool-task`: tenants then run their steps in its allocation, `srun --jobid=<pool job id>
--overlap ...`, and connect with `colocar.connect(pool="DIR/pool.json", token_file=...)`.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from typing import Any

from colocar.cli_help import HelpFormatter
from colocar.sizes import parse_size

from . import pool
from .pool_render import PoolScriptOptions, render_pool, tenant_step
from .render import TOPOLOGIES, ScriptOptions, render
from .supervisor import RunOptions, run
from .task import SlurmError


def _split(argv: list[str]) -> tuple[list[str], list[str]]:
    """(flags, COMMAND): the command is everything after the first `--`."""
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1 :]
    return argv, []


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--topology",
        default="multi",
        choices=TOPOLOGIES,
        help="multi: a trainer per node; single: one controller",
    )
    p.add_argument("--arena", default="16G", help="each node's arena, e.g. 16G (binary units)")
    p.add_argument(
        "--trainer-restarts", type=int, default=0, help="restarts in place of every node's trainer (multi)"
    )


def _pool_flags(p: Any) -> None:
    """What `render --pool` and `pool-task` share: the pool's tenants and limits."""
    p.add_argument("--tenants", help="the tenants file (YAML; colocar pool up --help)")
    p.add_argument("--pool-dir", help="where pool.json goes, seen by the tenants (default: the job dir)")
    p.add_argument("--capacity", default="1G", help="arena bytes per node for all tenants served at once")
    p.add_argument("--max-tenants", type=int, default=8, help="tenants served at once")
    p.add_argument(
        "--idle-seconds", type=float, default=60.0, help="a tenant without sessions this long is stopped"
    )


def _pool_render(r: argparse.ArgumentParser) -> None:
    g = r.add_argument_group(
        "a shared pool (--pool)",
        "a long-running job serving the tenants of --tenants on its nodes; tenants run their "
        "steps in its allocation: srun --jobid=<pool job id> --overlap ... python train.py, with "
        'colocar.connect(pool="DIR/pool.json", token_file=...) (no COMMAND)',
    )
    g.add_argument("--pool", action="store_true", help="render a shared pool's job")
    _pool_flags(g)


def _pool_task(sub: Any) -> None:
    t = sub.add_parser(
        "pool-task", help="a task of a shared pool's job step (srun)", formatter_class=HelpFormatter
    )
    _pool_flags(t)
    t.add_argument("--job-dir", help="the job's directory ($COLOCAR_JOB_DIR, else ~/.colocar/slurm/JOB_ID)")
    t.add_argument("--lease-seconds", type=float, default=30.0, help="the tenants' sidecars' session lease")
    t.add_argument("--shm-root", default="/dev/shm", help="where each node's arena folder is made (tmpfs)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="colocar slurm", description=__doc__, formatter_class=HelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser(
        "render", help="print a job's sbatch script: ... -- COMMAND", formatter_class=HelpFormatter
    )
    r.add_argument("--nodes", type=int, required=True, help="nodes of the job, one sidecar each")
    _common(r)
    r.add_argument("--job-name", help="the job's name in squeue (colocar; with --pool: colocar-pool)")
    r.add_argument("--signal-seconds", type=int, default=120, help="SIGTERM this long before the time limit")
    r.add_argument("--python", default=sys.executable, help="the Python (with colocar) on the nodes")
    r.add_argument(
        "--sbatch", action="append", default=[], help="one more #SBATCH line: --sbatch=--time=4:00:00"
    )
    _pool_render(r)
    _pool_task(sub)
    t = sub.add_parser(
        "run", help="a task of the job step (srun): ... [-- COMMAND]", formatter_class=HelpFormatter
    )
    _common(t)
    t.add_argument(
        "--job-dir", help="the job's shared directory ($COLOCAR_JOB_DIR, else ~/.colocar/slurm/JOB_ID)"
    )
    t.add_argument("--shm-dir", default="/dev/shm", help="where the arena lives (tmpfs)")
    t.add_argument("--pool", action="append", default=[], help="reserve NAME=SIZE of the arena (repeatable)")
    t.add_argument("--processes", type=int, default=2, help="the sidecar's worker processes")
    return p


def _render(args: argparse.Namespace, flags: list[str], command: list[str]) -> None:
    argv = flags[1:] + (["--", *command] if command else [])
    if not args.pool:
        if args.tenants or args.pool_dir:
            raise SlurmError("--tenants and --pool-dir are a shared pool's: add --pool")
        options = ScriptOptions(
            nodes=args.nodes,
            command=command,
            topology=args.topology,
            arena=args.arena,
            trainer_restarts=args.trainer_restarts,
            job_name=args.job_name or "colocar",
            signal_seconds=args.signal_seconds,
            python=args.python,
            sbatch=tuple(args.sbatch),
        )
        sys.stdout.write(render(options, argv))
        return
    if command:
        raise SlurmError(f"a pool's job runs no command: drop `-- {shlex.join(command)}`")
    if args.topology != "multi" or args.trainer_restarts or args.arena != "16G":
        raise SlurmError("--topology, --arena and --trainer-restarts are a job's, not a pool's")
    o = PoolScriptOptions(
        nodes=args.nodes,
        tenants=args.tenants,
        pool_dir=args.pool_dir,
        capacity=args.capacity,
        max_tenants=args.max_tenants,
        idle_seconds=args.idle_seconds,
        job_name=args.job_name or "colocar-pool",
        python=args.python,
        sbatch=tuple(args.sbatch),
    )
    script = render_pool(o, argv)
    sys.stdout.write(script)
    sys.stderr.write(tenant_step(o))


def _run(args: argparse.Namespace, command: list[str]) -> int:
    sidecar = ["--arena-size", str(parse_size(args.arena)), "--processes", str(args.processes)]
    for name in args.pool:
        sidecar += ["--pool", name]
    return run(
        RunOptions(
            command=command,
            topology=args.topology,
            trainer_restarts=args.trainer_restarts,
            job_dir=args.job_dir,
            shm_dir=args.shm_dir,
            sidecar_options=sidecar,
        )
    )


def _pool_task_run(args: argparse.Namespace) -> int:
    if not args.tenants:
        raise SlurmError("pool-task needs --tenants FILE")
    options = pool.PoolOptions(
        tenants=os.path.abspath(args.tenants),
        pool_dir=args.pool_dir,
        job_dir=args.job_dir,
        capacity=args.capacity,
        max_tenants=args.max_tenants,
        idle_seconds=args.idle_seconds,
        lease_seconds=args.lease_seconds,
        shm_root=args.shm_root,
    )
    return pool.run(options)


def main(argv: list[str] | None = None) -> None:
    flags, command = _split(list(sys.argv[1:] if argv is None else argv))
    args = build_parser().parse_args(flags)
    try:
        if args.command == "render":
            _render(args, flags, command)
            return
        code = _run(args, command) if args.command == "run" else _pool_task_run(args)
    except SlurmError as e:
        print(f"colocar slurm {args.command}: error: {e}", file=sys.stderr)
        sys.exit(2 if args.command == "render" else 1)
    sys.exit(code)
