"""`colocar clean`: removes what killed sidecars and controllers left on this machine.

A sidecar removes its arena when it ends, a local cluster's controller its sidecars' work
folder, and a controller that sees one of its sidecars die removes that one's arena; killed
together (an OOM kill of both, `kill -9` of a controller whose sidecars were killed too) nobody
can. A sidecar removes what dead sidecars left in its shm folder when it starts; `colocar
clean` does it now: arenas of dead sidecars (nobody holds their lock), the sockets beside them
and half-made arenas, in /dev/shm, `COLOCAR_SHM_DIR` and each `--shm-dir`, and in the shm
folders the records name; and the records and work folders of local clusters whose controller
and sidecars all ended (a local cluster starting removes those too). Nothing a live sidecar or
controller uses is touched. Prints each path it removed.
"""

from __future__ import annotations

import argparse
import os

from colocar.cli_help import HelpFormatter
from colocar.shm import remove_stale_arenas

from .local import records


def clean(shm_dirs: list[str]) -> list[str]:
    """Removes what dead sidecars and controllers left (see the module); the paths removed."""
    removed = []
    folders = set(shm_dirs)
    for record in records.left_over():
        folders |= {os.path.dirname(h["arena"]) for h in record["hosts"] if h.get("arena")}
        removed += records.remove_left_over(record)
    for folder in sorted(f for f in folders if os.path.isdir(f)):
        removed += remove_stale_arenas(folder)
    return removed


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="colocar clean", description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--shm-dir", action="append", default=[], help="another shm folder to clean (repeatable)")
    args = p.parse_args(argv)
    defaults = ["/dev/shm", os.environ.get("COLOCAR_SHM_DIR", "")]
    removed = clean([d for d in [*defaults, *args.shm_dir] if d])
    for path in removed:
        print(f"removed {path}")
    print(f"colocar clean: {len(removed)} left-over file(s) or folder(s) removed")
