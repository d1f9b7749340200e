"""The `colocar` command: `sidecar`, `demo`, `bench`, `ckpt` (inspect checkpoints), `k8s` (render
manifests), `slurm` (sbatch scripts and their tasks), `pool` (a shared pool of tenants), `examples`
(write the example pipeline's data), `sessions` (list and end sessions), `clean` (what killed
sidecars left).

A user's mistake (a missing file, a bucket that does not exist, storage that does not answer)
ends the command with one line on stderr naming what failed, and exit status 1; a traceback
means a bug in colocar. `colocar --version` prints the installed version.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

USAGE = """usage: colocar [--version] {sidecar,demo,bench,ckpt,k8s,slurm,pool,examples,sessions,clean} ...

  sidecar   run a sidecar (colocar sidecar --help)
  demo      train on a local cluster, lose a host, recover from RAM (colocar demo --help)
  bench     run a benchmark, or every one's quick mode: colocar bench {NAME,all} [--json] [--quick]
  ckpt      list, inspect and convert checkpoints: colocar ckpt {ls PATH,show PATH STEP,convert SRC DST}
  k8s       render Kubernetes manifests: colocar k8s render --topology T --image I --bucket B
  slurm     Slurm jobs: colocar slurm render --nodes N -- COMMAND (an sbatch script); slurm run (under srun)
  pool      a shared pool several tenants use: colocar pool {up --tenants FILE,status,admit,down}
  examples  write the data examples/pipeline.yaml reads: colocar examples write-data examples/data
  sessions  list, end or stop sessions: colocar sessions {ls [ADDRESS...],close NAME [ADDRESS...],stop NAME}
  clean     remove the arenas and folders killed sidecars and controllers left on this machine

Each command's --help lists its flags and their defaults. Sizes are written one way everywhere:
bytes, or a number with K, M, G or T (binary: 16G = 16Gi = 16GiB)."""


def version() -> str:
    """The installed distribution's version ('unknown' when colocar runs from a plain checkout)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("colocar")
    except PackageNotFoundError:
        return "unknown"


def _command(name: str) -> Callable[[list[str]], object] | None:
    if name == "sidecar":
        from colocar.sidecar.server import main as sidecar_main

        return sidecar_main
    if name == "demo":
        from colocar.demo.cli import main as demo_main

        return demo_main
    if name == "bench":
        from colocar.bench.run import main as bench_main

        return bench_main
    if name == "ckpt":
        from colocar.checkpoint.cli import main as ckpt_main

        return ckpt_main
    if name == "k8s":
        from colocar.k8s.cli import main as k8s_main

        return k8s_main
    if name == "slurm":
        from colocar.slurm.cli import main as slurm_main

        return slurm_main
    if name == "pool":
        from colocar.pool.cli import main as pool_main

        return pool_main
    if name == "examples":
        from colocar.loaders.example_data import main as examples_main

        return examples_main
    if name == "sessions":
        from colocar.controller_bridge.sessions_cli import main as sessions_main

        return sessions_main
    if name == "clean":
        from colocar.controller_bridge.clean_cli import main as clean_main

        return clean_main
    return None


def main(argv: list[str] | None = None) -> None:
    from colocar.errors import ColocarError

    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        sys.exit(0 if argv else 2)
    if argv[0] == "--version":
        print(f"colocar {version()}")
        return
    command, rest = argv[0], argv[1:]
    run = _command(command)
    if run is None:
        known = "sidecar, demo, bench, ckpt, k8s, slurm, pool, examples, sessions, clean"
        print(f"colocar: unknown command {command!r} ({known})", file=sys.stderr)
        sys.exit(2)
    try:
        run(rest)
    except (ColocarError, OSError) as e:
        print(f"colocar {command}: error: {e}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        print(f"colocar {command}: interrupted", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    main()
