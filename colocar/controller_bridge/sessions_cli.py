"""`colocar sessions ls|close|stop`: the controller sessions sidecars hold, seen from outside.

Runs anywhere the sidecars are reachable (no JAX): `ls ADDRESS...` lists each sidecar's
sessions (name, controller, attached or detached with the grace left, objects and arena bytes
held); `close NAME ADDRESS...` ends a session (by name, or by an id prefix from `ls`) on those
sidecars: what it held is freed and its controller, if it still runs, gets `SessionEndedError`.
Addresses default to `COLOCAR_SIDECARS`, else to the sidecars of this machine's persistent named
local clusters (`local_cluster(persist=True, session=...)`), whose token each record names.
`stop NAME` stops such a local cluster's sidecars. The token comes from `--token-file`,
`COLOCAR_TOKEN` or `COLOCAR_TOKEN_FILE`, as for `connect`.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
from typing import Any

import grpc

from colocar.cli_help import HelpFormatter
from colocar.errors import ColocarError
from colocar.protocol import colocar_pb2 as pb
from colocar.protocol import colocar_pb2_grpc as pb_grpc
from colocar.protocol.tls import channel_credentials
from colocar.protocol.tokens import TOKEN_METADATA_KEY

from .addresses import sidecar_addresses, token_from_env
from .local import records

TIMEOUT = 10.0


def _targets(addresses: list[str], token_file: str | None) -> list[tuple[str, str]]:
    """(address, token) of each sidecar to ask."""
    if addresses or os.environ.get("COLOCAR_SIDECARS"):
        token = token_from_env(None, token_file) or ""
        return [(address, token) for address in sidecar_addresses(addresses or None)]
    found = []
    for record in records.every():
        token = token_from_env(None, os.path.join(record["workdir"], "token")) or ""
        found += [(host["address"], token) for host in record["hosts"] if records.running(host)]
    if not found:
        raise ColocarError(
            "no sidecars to ask: give their addresses (or COLOCAR_SIDECARS); no persistent named "
            "local cluster runs on this machine"
        )
    return found


def _ask(address: str, token: str, method: str, request: Any, tls: Any) -> pb.SessionList:
    channel = grpc.secure_channel(address, tls) if tls is not None else grpc.insecure_channel(address)
    with channel:
        stub = pb_grpc.SidecarStub(channel)
        try:
            return getattr(stub, method)(request, metadata=((TOKEN_METADATA_KEY, token),), timeout=TIMEOUT)
        except grpc.RpcError as e:
            raise ColocarError(f"sidecar at {address}: {e.code().name}: {e.details()}") from None


def _row(address: str, s: pb.SessionInfo) -> dict[str, Any]:
    return {
        "sidecar": address,
        "name": s.name,
        "id": s.id_prefix,
        "controller": s.controller,
        "state": "attached" if s.attached else f"detached, {s.grace_left_seconds:.0f} s left",
        "idle_seconds": round(s.idle_seconds, 1),
        "objects": s.objects,
        "arena_bytes": s.arena_bytes,
    }


def _print(rows: list[dict[str, Any]], as_json: bool) -> None:
    if as_json:
        print(json.dumps({"sessions": rows}))
        return
    print(
        f"{'sidecar':<22} {'name':<16} {'id':<8}  {'controller':<24} {'state':<24} {'objects':>7} {'MiB':>8}"
    )
    for r in rows:
        print(
            f"{r['sidecar']:<22} {r['name'] or '-':<16} {r['id']:<8}  {r['controller']:<24} "
            f"{r['state']:<24} {r['objects']:>7} {r['arena_bytes'] / 2**20:>8.1f}"
        )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="colocar sessions", description=__doc__, formatter_class=HelpFormatter)
    sub = p.add_subparsers(dest="verb", required=True)
    ls = sub.add_parser("ls", help="list the sessions of sidecars", formatter_class=HelpFormatter)
    close = sub.add_parser("close", help="end a session on sidecars", formatter_class=HelpFormatter)
    close.add_argument("session", help="the session's name, or an id prefix (8 characters or more) from ls")
    for verb in (ls, close):
        verb.add_argument("addresses", nargs="*", help="host:port of each sidecar")
        verb.add_argument("--token-file", help="file with the sidecars' token")
        verb.add_argument("--json", action="store_true", help="one JSON object instead of a table")
        for name in ("ca", "cert", "key"):
            verb.add_argument(f"--tls-{name}", help=f"TLS {name} file, as for connect(tls_{name}=...)")
    stop_ = sub.add_parser(
        "stop", help="stop a persistent named local cluster", formatter_class=HelpFormatter
    )
    stop_.add_argument("session", help="the session name it was started with")
    return p


def main(argv: list[str]) -> None:
    args = build_parser().parse_args(argv)
    if args.verb == "stop":
        from .local.reattach import stop  # imports JAX: only for this verb

        if not stop(args.session):
            raise ColocarError(f"no persistent local cluster of session {args.session!r} on this machine")
        print(f"stopped the sidecars of session {args.session!r}")
        return
    tls = channel_credentials(args.tls_ca, args.tls_cert, args.tls_key)
    targets = _targets(args.addresses, args.token_file)
    rows, failed = [], []
    for address, token in targets:  # a sidecar that does not answer does not hide the others
        try:
            if args.verb == "ls":
                reply = _ask(address, token, "ListSessions", pb.Empty(), tls)
            else:
                by = f"`colocar sessions close` on {socket.gethostname()} (pid {os.getpid()})"
                request = pb.SessionSelector(selector=args.session, by=by)
                reply = _ask(address, token, "CloseSession", request, tls)
        except ColocarError as e:
            failed.append(str(e))
            continue
        rows += [_row(address, s) for s in reply.sessions]
    if rows or args.verb == "ls":
        _print(rows, args.json)
    if failed:
        raise ColocarError("; ".join(failed))
    if args.verb == "close" and not rows:
        raise ColocarError(f"no session {args.session!r} on {[address for address, _ in targets]}")
