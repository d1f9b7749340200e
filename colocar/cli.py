"""The `colocar` command: `colocar sidecar ...`, `colocar bench NAME [--json] [--quick]`."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: colocar {sidecar,bench} ...\n")
        print("  sidecar   run a sidecar (colocar sidecar --help)")
        print("  bench     run a benchmark: colocar bench {rpc,transfer,loader} [--json] [--quick]")
        sys.exit(0 if argv else 2)
    command, rest = argv[0], argv[1:]
    if command == "sidecar":
        from colocar.sidecar.server import main as sidecar_main

        sidecar_main(rest)
    elif command == "bench":
        import pathlib

        root = pathlib.Path(__file__).resolve().parent.parent
        if (root / "benchmarks").is_dir() and str(root) not in sys.path:
            sys.path.insert(0, str(root))
        from benchmarks.run import main as bench_main

        bench_main(rest)
    else:
        print(f"colocar: unknown command {command!r} (sidecar, bench)", file=sys.stderr)
        sys.exit(2)
