"""`colocar slurm render|run`: print a job's sbatch script, or run one task of its step.

`render` writes the script on stdout; bad input exits 2 with a message and nothing on
stdout. `run` is what the script's `srun` starts on every node (README: Run on Slurm).
"""

from __future__ import annotations

import argparse
import sys

from colocar.cli_help import HelpFormatter
from colocar.sizes import parse_size

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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="colocar slurm", description=__doc__, formatter_class=HelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser(
        "render", help="print a job's sbatch script: ... -- COMMAND", formatter_class=HelpFormatter
    )
    r.add_argument("--nodes", type=int, required=True, help="nodes of the job, one sidecar each")
    _common(r)
    r.add_argument("--job-name", default="colocar", help="the job's name in squeue")
    r.add_argument("--signal-seconds", type=int, default=120, help="SIGTERM this long before the time limit")
    r.add_argument("--python", default=sys.executable, help="the Python (with colocar) on the nodes")
    r.add_argument(
        "--sbatch", action="append", default=[], help="one more #SBATCH line: --sbatch=--time=4:00:00"
    )
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


def main(argv: list[str] | None = None) -> None:
    flags, command = _split(list(sys.argv[1:] if argv is None else argv))
    args = build_parser().parse_args(flags)
    try:
        if args.command == "render":
            options = ScriptOptions(
                nodes=args.nodes,
                command=command,
                topology=args.topology,
                arena=args.arena,
                trainer_restarts=args.trainer_restarts,
                job_name=args.job_name,
                signal_seconds=args.signal_seconds,
                python=args.python,
                sbatch=tuple(args.sbatch),
            )
            sys.stdout.write(render(options, flags[1:] + (["--", *command] if command else [])))
            return
        sidecar = ["--arena-size", str(parse_size(args.arena)), "--processes", str(args.processes)]
        for pool in args.pool:
            sidecar += ["--pool", pool]
        code = run(
            RunOptions(
                command=command,
                topology=args.topology,
                trainer_restarts=args.trainer_restarts,
                job_dir=args.job_dir,
                shm_dir=args.shm_dir,
                sidecar_options=sidecar,
            )
        )
    except SlurmError as e:
        print(f"colocar slurm {args.command}: error: {e}", file=sys.stderr)
        sys.exit(2 if args.command == "render" else 1)
    sys.exit(code)
