"""`colocar ckpt ls PATH` and `colocar ckpt show PATH STEP`: look into a checkpoint directory.

Reads the manifest and markers only (no JAX, no sidecar), so it runs anywhere the storage is
reachable. `--json` prints one JSON object instead of a table.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from .steps import ManifestError, StepDirs
from .storage import open_storage


def list_steps(steps: StepDirs) -> list[dict[str, Any]]:
    """One row per step directory; a step whose manifest is unreadable gets a row saying so
    (status "unreadable", its error in "error") instead of failing the whole listing."""
    rows = []
    for step in steps.all():
        try:
            manifest = steps.read_manifest(step) or {}
        except ManifestError as e:
            rows.append(_unreadable_row(steps, step, str(e)))
            continue
        leaves = manifest.get("leaves", {}).values()
        nbytes = sum(_nbytes(e) for e in leaves if e.get("kind") != "value")
        rows.append(
            {
                "step": step,
                "status": steps.status(step),
                "time": manifest.get("time"),
                "leaves": len(manifest.get("leaves", {})),
                "bytes": nbytes,
                "hosts": manifest.get("hosts"),
            }
        )
    return rows


def _unreadable_row(steps: StepDirs, step: int, error: str) -> dict[str, Any]:
    status = "unreadable (committed)" if steps.is_committed(step) else "unreadable"
    row: dict[str, Any] = {"step": step, "status": status, "time": None, "leaves": 0, "bytes": 0}
    return {**row, "hosts": None, "error": error}


def _print_steps(url: str, rows: list[dict[str, Any]], as_json: bool) -> None:
    """`ls`: a table (the errors of unreadable steps after it, on stderr), or one JSON object."""
    if as_json:
        print(json.dumps({"path": url, "steps": rows}))
        return
    print(f"{url}: {len(rows)} step(s)")
    print(f"{'step':>10}  {'status':<24} {'saved':<19}  {'leaves':>6}  {'MiB':>10}  hosts")
    for r in rows:
        print(
            f"{r['step']:>10}  {r['status']:<24} {_when(r['time']):<19}  {r['leaves']:>6}  "
            f"{r['bytes'] / 2**20:>10.1f}  {r['hosts']}"
        )
    for r in rows:
        if "error" in r:
            print(r["error"], file=sys.stderr)


def _nbytes(entry: dict[str, Any]) -> int:
    import numpy as np

    try:
        import ml_dtypes  # noqa: F401  (registers bfloat16 and friends with numpy)
    except ImportError:
        pass
    count = 1
    for n in entry["stored_shape"]:
        count *= n
    return count * np.dtype(entry["stored_dtype"]).itemsize


def _when(t: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if t else "-"


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="colocar ckpt", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    ls = sub.add_parser("ls", help="list the steps of a checkpoint directory")
    ls.add_argument("path", help="gs://bucket/prefix, file:///path or a local path")
    ls.add_argument("--json", action="store_true")
    show = sub.add_parser("show", help="the tree, shapes, dtypes and shardings of one step")
    show.add_argument("path")
    show.add_argument("step", type=int)
    show.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    try:
        storage = open_storage(args.path)
        steps = StepDirs(storage)
        if args.command == "ls":
            _print_steps(storage.url, list_steps(steps), args.json)
            return
        manifest = steps.read_manifest(args.step)
        if manifest is None:
            raise ValueError(f"no step {args.step} in {storage.url}")
        status = steps.status(args.step)
        if args.json:
            print(json.dumps({"path": storage.url, "status": status, **manifest}))
            return
        print(
            f"{storage.url} step {args.step}: {status}, saved {_when(manifest.get('time'))}, "
            f"hosts {manifest.get('hosts')}"
        )
        if manifest.get("metadata"):
            print(f"metadata: {json.dumps(manifest['metadata'])}")
        for key, e in sorted(manifest["leaves"].items()):
            if e["kind"] == "value":
                print(f"  {key:<40} = {json.dumps(e['value'])[:60]}")
                continue
            dtype = f"key<{e['impl']}>" if e["kind"] == "prng_key" else e["dtype"]
            sharding = e.get("sharding") or {}
            where = sharding.get("spec", sharding.get("type", "host"))
            print(f"  {key:<40} {dtype}{e['shape']}  sharding {where}  chunks {e['chunks']}")
    except (OSError, ValueError) as e:
        print(f"colocar ckpt: {e}", file=sys.stderr)
        sys.exit(2)
