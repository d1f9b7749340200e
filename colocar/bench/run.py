"""`colocar bench NAME [--json] [--quick] [--repeats N]` (also `python -m colocar.bench.run NAME`).

Runs one benchmark module's `run(quick, repeats) -> dict`, prints a table and, with --json,
the result as one JSON object on the last line of stdout. `colocar bench all` runs every
benchmark's quick mode and prints where they stand (`colocar.bench.suite`).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
from typing import Any

BENCHMARKS = {
    "rpc": "round trip of a trivial colocated call vs a bare gRPC echo and a TCP ping-pong",
    "transfer": "a 256 MiB array out of a sidecar through the arena vs np.copyto",
    "loader": "input pipelines of 64 x 224x224x3 images: colocar sidecars vs grain mp_prefetch",
    "ckpt": "save and restore 1 GiB of sharded float32 arrays: colocar CheckpointManager vs Orbax async",
    "recovery": "kill 1 of 4 hosts, time to a step on the survivors: peer snapshots vs storage vs Orbax",
    "firstbatch": "script start to the first batch, fresh and resumed; peak RSS: colocar vs grain + Orbax",
    "pool": "a shared pool: tenant B's call p99 and stream throughput while tenant A floods, vs B alone",
}
DEFAULT_REPEATS = {"rpc": 7, "transfer": 7, "loader": 5, "ckpt": 5, "recovery": 3, "firstbatch": 5, "pool": 5}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="colocar bench", description="colocar benchmarks")
    names = "; ".join(f"{k}: {v}" for k, v in BENCHMARKS.items())
    every = "all: every benchmark's quick mode, one after another, and a table of their goals"
    p.add_argument("name", choices=[*sorted(BENCHMARKS), "all"], help=f"{names}; {every} (all --help)")
    p.add_argument("--json", action="store_true", help="print the result as JSON on the last line")
    p.add_argument("--quick", action="store_true", help="fewer calls and a smaller array (< 1 min)")
    p.add_argument("--repeats", type=int, default=None, help="rounds/repeats (medians are over these)")
    return p


def _table(name: str, result: dict[str, Any]) -> None:
    rows = [(k, v) for k, v in result.items() if not isinstance(v, (list, dict))]
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(f"colocar bench {name}")
        for key, value in rows:
            print(f"  {key:<28} {value}")
        return
    table = Table(title=f"colocar bench {name}", show_header=True)
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in rows:
        table.add_row(key, str(value))
    Console(file=sys.stdout, width=100).print(table)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["all"]:
        from colocar.bench import suite

        return suite.main(argv[1:])
    args = _parser().parse_args(argv)
    # The controller side runs JAX on the CPU (the transfer benchmark uses device_put there).
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    module = importlib.import_module(f"colocar.bench.{args.name}")
    repeats = args.repeats if args.repeats is not None else DEFAULT_REPEATS[args.name]
    if repeats < 1:
        raise SystemExit("--repeats must be >= 1")
    started = time.monotonic()
    result = module.run(quick=args.quick, repeats=repeats)
    result["seconds"] = round(time.monotonic() - started, 1)
    _table(args.name, result)
    if args.json:
        sys.stdout.flush()
        print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
