"""`colocar bench all [--json] [--quick] [--only NAME,NAME] [--timeout S]`: every benchmark's
quick mode, one after another, each in a process of its own, then one table of where they stand.

Each benchmark runs as `colocar bench NAME --quick --json` would, and its result is the JSON
object on the last line of its stdout (nothing is measured here). One that fails, prints no
JSON or outlives `--timeout` (its process group is killed; its sidecars end with it) is
reported as an error and the others still run. The table and the goals are `colocar.bench.summary`'s.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any, TextIO

from colocar.bench import child_env
from colocar.bench.summary import HEADLINES, assemble, render

DEFAULT_TIMEOUT_S = 600.0
# a fresh interpreter that imports the colocar of child_env's PYTHONPATH, not one in its cwd
CHILD = "import sys; sys.path.pop(0); from colocar.bench.run import main; main()"


def bench_command(name: str, repeats: int | None = None) -> list[str]:
    """`colocar bench NAME --quick --json [--repeats N]` in a fresh Python process."""
    command = [sys.executable, "-c", CHILD, name, "--quick", "--json"]
    return command + (["--repeats", str(repeats)] if repeats is not None else [])


def _last_line_json(stdout: str) -> dict[str, Any] | None:
    lines = stdout.strip().splitlines()
    try:
        result = json.loads(lines[-1]) if lines else None
    except ValueError:
        return None
    return result if isinstance(result, dict) else None


def _stop(process: subprocess.Popen) -> None:
    """Ends the run's process group: SIGTERM (sidecars clean up), then SIGKILL."""
    for sig, grace in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 30.0)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            continue


def run_one(command: list[str], timeout: float) -> dict[str, Any]:
    """The JSON result a benchmark's command printed last, or {"error": why not}."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        process = subprocess.Popen(command, stdout=out, stderr=err, env=child_env(), start_new_session=True)
        try:
            returncode = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _stop(process)
            return {"error": f"timed out after {timeout:g} s"}
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    if returncode != 0:
        last = stderr.strip().splitlines()[-1:] or ["no output on stderr"]
        return {"error": f"exit status {returncode}: {last[0][:300]}"}
    result = _last_line_json(stdout)
    if result is None:
        return {"error": "no JSON object on the last line of its output"}
    return result


def run_all(
    names: list[str],
    timeout: float,
    command: Callable[[str], list[str]] = bench_command,
    log: TextIO | None = None,
) -> dict[str, dict[str, Any]]:
    """Each benchmark's result (or error), run one after another in the order given."""
    results = {}
    for name in names:
        started = time.monotonic()
        results[name] = run_one(command(name), timeout)
        took = time.monotonic() - started
        said = results[name].get("error", "done")
        print(f"colocar bench all: {name}: {said} ({took:.1f} s)", file=log or sys.stderr, flush=True)
    return results


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="colocar bench all",
        description="Runs every benchmark's QUICK mode (always: `all` has no full-size mode), one "
        "after another, each in its own process with a timeout, and prints one table: each "
        "headline figure, its goal and whether this run met it. The goals are set for the "
        "full-size runs (colocar bench NAME), so quick figures are indicative. A benchmark "
        "that fails or times out is reported as an error and the others still run; the exit "
        "status is then 1.",
    )
    p.add_argument("--json", action="store_true", help="print the summary as JSON on the last line")
    p.add_argument("--quick", action="store_true", help="accepted for symmetry: `all` is always quick")
    p.add_argument("--only", default="", help=f"a comma-separated subset of: {','.join(HEADLINES)}")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds per benchmark")
    p.add_argument("--repeats", type=int, default=None, help="rounds/repeats for every benchmark")
    return p


def _names(only: str) -> list[str]:
    if not only:
        return list(HEADLINES)
    names = [n.strip() for n in only.split(",") if n.strip()]
    unknown = [n for n in names if n not in HEADLINES]
    if unknown or not names:
        raise SystemExit(f"colocar bench all: --only takes names of {', '.join(HEADLINES)}; got {only!r}")
    return names


def main(argv: list[str]) -> dict[str, Any]:
    args = _parser().parse_args(argv)
    if args.timeout <= 0 or (args.repeats is not None and args.repeats < 1):
        raise SystemExit("colocar bench all: --timeout must be > 0 and --repeats >= 1")
    results = run_all(_names(args.only), args.timeout, lambda name: bench_command(name, args.repeats))
    summary = assemble(results)
    print(render(summary))
    if args.json:
        sys.stdout.flush()
        print(json.dumps(summary), flush=True)
    if any("error" in entry for entry in summary["benchmarks"].values()):
        sys.exit(1)
    return summary
