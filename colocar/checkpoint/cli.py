"""`colocar ckpt ls PATH`, `colocar ckpt show PATH STEP`: look into a checkpoint directory;
`colocar ckpt convert SRC DST`: rewrite its steps in the other layout (`convert`).

`ls` and `show` read manifests and markers only (no JAX, no sidecar), so they run anywhere the
storage is reachable; they list steps in colocar's format and in Orbax's layout alike.
`--json` prints one JSON object instead of a table. A path that holds nothing, a
missing bucket or storage that does not answer within `--timeout` seconds of retries ends the
command with one line saying so and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from colocar.cli_help import HelpFormatter
from colocar.errors import CheckpointError

from .convert import convert
from .format import layout
from .store.catalog import LAYOUTS, Catalog
from .store.steps import ManifestError, StepDirs
from .store.storage import DEFAULT_TIMEOUT, LocalStorage, Storage, StorageError, open_storage


def list_steps(catalog: Catalog) -> list[dict[str, Any]]:
    """One row per step directory of either layout; a step whose manifest is unreadable gets a
    row saying so (status "unreadable", its error in "error") instead of failing the listing."""
    return sorted((r for steps in catalog.layouts for r in _rows(steps)), key=lambda r: r["step"])


def _rows(steps: StepDirs) -> list[dict[str, Any]]:
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
                "layout": steps.layout,
            }
        )
    return rows


def _unreadable_row(steps: StepDirs, step: int, error: str) -> dict[str, Any]:
    status = "unreadable (committed)" if steps.is_committed(step) else "unreadable"
    row: dict[str, Any] = {"step": step, "status": status, "time": None, "leaves": 0, "bytes": 0}
    return {**row, "hosts": None, "layout": steps.layout, "error": error}


def _print_steps(url: str, rows: list[dict[str, Any]], as_json: bool) -> None:
    """`ls`: a table (the errors of unreadable steps after it, on stderr), or one JSON object."""
    if as_json:
        print(json.dumps({"path": url, "steps": rows}))
        return
    print(f"{url}: {len(rows)} step(s)")
    print(f"{'step':>10}  {'status':<24} {'saved':<19}  {'leaves':>6}  {'MiB':>10}  {'layout':<7}  hosts")
    for r in rows:
        print(
            f"{r['step']:>10}  {r['status']:<24} {_when(r['time']):<19}  {r['leaves']:>6}  "
            f"{r['bytes'] / 2**20:>10.1f}  {r['layout']:<7}  {r['hosts']}"
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


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="colocar ckpt", description=__doc__, formatter_class=HelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    ls = sub.add_parser("ls", help="list the steps of a checkpoint directory", formatter_class=HelpFormatter)
    ls.add_argument("path", help="gs://bucket/prefix, file:///path or a local path")
    show = sub.add_parser(
        "show", help="the tree, shapes, dtypes and shardings of one step", formatter_class=HelpFormatter
    )
    show.add_argument("path", help="gs://bucket/prefix, file:///path or a local path")
    show.add_argument("step", type=int)
    to_other = sub.add_parser(
        "convert",
        help="rewrite committed steps in the other layout (colocar's format <-> Orbax's)",
        formatter_class=HelpFormatter,
    )
    to_other.add_argument("path", help="the source: gs://bucket/prefix, file:///path or a local path")
    to_other.add_argument("destination", help="where the converted steps go (may be the source itself)")
    to_other.add_argument(
        "--to", choices=LAYOUTS, help="the layout to write (default: the one a step is not in)"
    )
    to_other.add_argument(
        "--step", type=int, action="append", help="a step to convert (default: every committed one)"
    )
    for p in (ls, show, to_other):
        p.add_argument("--json", action="store_true", help="print one JSON object")
        p.add_argument(
            "--timeout", type=float, default=DEFAULT_TIMEOUT, help="seconds of retries per storage call"
        )
    return parser


def _check_exists(storage: Storage) -> None:
    """A path that holds nothing is a mistake (a typo, the wrong bucket): say so, not "0 steps".
    An existing empty local directory is a checkpoint directory with no step yet."""
    if isinstance(storage, LocalStorage):
        if not os.path.isdir(storage.root):
            what = "is not a directory" if os.path.exists(storage.root) else "does not exist"
            raise ValueError(f"{storage.url} {what}")
        return
    if not storage.children(""):
        raise ValueError(f"{storage.url} does not exist (no object under it)")


def array_names(manifest: dict[str, Any]) -> dict[str, str]:
    """Each array leaf's directory under the step's arrays root, by key (`layout.array_name`:
    its escaped key path, or its index in a format-2 step); ValueError for an unknown layout."""
    try:
        leaves = manifest.get("leaves", {}).items()
        return {k: layout.array_name(manifest, e) for k, e in leaves if e["kind"] != "value"}
    except CheckpointError as e:
        raise ValueError(str(e)) from None


def _show(storage: Storage, catalog: Catalog, step: int, as_json: bool) -> None:
    """`show`: one step's tree (keys, dtypes, shapes, shardings, each array's directory), or its
    manifest as JSON (plus `arrays_root` and `arrays`: each array's directory by key)."""
    steps = catalog.holder(step) or next((s for s in catalog.layouts if step in s.all()), catalog.layouts[0])
    manifest = steps.read_manifest(step)
    if manifest is None:
        raise ValueError(f"no step {step} in {storage.url} (colocar ckpt ls {storage.url} lists them)")
    status = steps.status(step)
    names = array_names(manifest)
    root = steps.arrays_root(step, manifest)
    if as_json:
        shown = {"path": storage.url, "status": status, **manifest, "arrays_root": root, "arrays": names}
        print(json.dumps(shown))
        return
    saved = _when(manifest.get("time"))
    print(f"{storage.url} step {step}: {status}, saved {saved}, hosts {manifest.get('hosts')}")
    if manifest.get("metadata"):
        print(f"metadata: {json.dumps(manifest['metadata'])}")
    if names:
        if steps.layout == "orbax":
            print(f"arrays (one zarr array each) in the OCDBT database of {root}/ (orbax layout)")
        else:
            print(f"arrays (one zarr3 array each) under {root}/")
    for key, e in sorted(manifest["leaves"].items()):
        if e["kind"] == "value":
            print(f"  {key:<40} = {json.dumps(e['value'])[:60]}")
            continue
        dtype = f"key<{e['impl']}>" if e["kind"] == "prng_key" else e["dtype"]
        sharding = e.get("sharding") or {}
        where = sharding.get("spec", sharding.get("type", "host"))
        print(f"  {key:<40} {dtype}{e['shape']}  sharding {where}  chunks {e['chunks']}  {names[key]}/")


def _storage_failure(error: Exception, url: str) -> str | None:
    """A GCS answer as a user's message (a missing bucket, no permission), or None."""
    try:
        from google.api_core import exceptions
    except ImportError:
        return None
    if isinstance(error, exceptions.NotFound):
        bucket = url.removeprefix("gs://").split("/", 1)[0]
        return f"{url}: bucket {bucket!r} does not exist (or these credentials cannot see it)"
    if isinstance(error, exceptions.GoogleAPICallError):
        return f"{url}: storage refused the request: {error}"
    return None


def main(argv: list[str]) -> None:
    """`ls` or `show`; a user's mistake exits 2 with one line on stderr."""
    args = _parser().parse_args(argv)
    try:
        storage = open_storage(args.path, timeout=args.timeout)
    except ValueError as e:
        print(f"colocar ckpt: error: {e}", file=sys.stderr)
        sys.exit(2)
    try:
        _check_exists(storage)
        catalog = Catalog(storage)
        if args.command == "ls":
            _print_steps(storage.url, list_steps(catalog), args.json)
        elif args.command == "show":
            _show(storage, catalog, args.step, args.json)
        else:
            for line in convert(args.path, args.destination, args.to, args.step or None):
                print(line)
    except CheckpointError as e:
        print(f"colocar ckpt: error: {e}", file=sys.stderr)
        sys.exit(2)
    except (OSError, ValueError, StorageError) as e:
        print(f"colocar ckpt: error: {e}", file=sys.stderr)
        sys.exit(2)
    except Exception as e:
        message = _storage_failure(e, storage.url)
        if message is None:
            raise
        print(f"colocar ckpt: error: {message}", file=sys.stderr)
        sys.exit(2)
